"""Progress bars for long transfers: uploads, downloads and moves of ``PROGRESS_MIN`` bytes or more
show a ``tqdm`` bar (bytes, MB/s, ETA) when someone can see it (a terminal or a notebook), and
nothing when output goes to a file or a pipe.

``progress=True`` / ``False`` on ``ember.array_api``'s ``asarray``, ``to_numpy`` and ``to_device``
forces a bar or none (True shows one at any size, wherever stderr goes); the default ``None``
defers to the global switch :func:`set_progress` (``ember.set_progress``), then to
``EMBER_PROGRESS=1|0``, then to the automatic rule above.
"""

from __future__ import annotations

import os
import sys
from typing import Any

#: Transfers at least this large get a bar automatically.
PROGRESS_MIN = 64 * 2**20

_setting: bool | None = None


def set_progress(on: bool | None) -> None:
    """Progress bars: True always, False never, None (default) for large transfers a person can see."""
    global _setting
    if on is not None and not isinstance(on, bool):
        raise TypeError(f"set_progress takes True, False or None, got {on!r}")
    _setting = on


def _env() -> bool | None:
    v = os.environ.get("EMBER_PROGRESS", "").strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    return None


def _visible() -> bool:
    """Is there a person to see a bar: a terminal on stderr, or a notebook kernel?"""
    try:
        if sys.stderr is not None and sys.stderr.isatty():
            return True
    except (AttributeError, ValueError):
        pass
    ipython = sys.modules.get("IPython")
    shell = getattr(ipython, "get_ipython", lambda: None)() if ipython is not None else None
    return shell is not None and "ipykernel" in sys.modules and hasattr(shell, "kernel")


class Bar:
    """One ``tqdm`` bar in bytes; ``update_to`` moves it to an absolute count."""

    def __init__(self, total: int, what: str) -> None:
        from tqdm.auto import tqdm
        self._t = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000, desc=f"ember: {what}",
                       leave=False, dynamic_ncols=True, file=sys.stderr)

    def update_to(self, n: int) -> None:
        if n > self._t.n:
            self._t.update(n - self._t.n)

    def close(self) -> None:
        self._t.close()


class Progress:
    """Makes the bar of one transfer (see ``client.bulk``)."""

    def bar(self, total: int, what: str) -> Bar:
        return Bar(total, what)


def choose(progress: bool | None, nbytes: int) -> Progress | None:
    """A ``Progress`` when this transfer of ``nbytes`` should show a bar, else None."""
    if progress is None:
        progress = _setting if _setting is not None else _env()
    if progress is False:
        return None
    if progress is None and (nbytes < PROGRESS_MIN or not _visible()):
        return None
    return Progress()


__all__ = ["PROGRESS_MIN", "set_progress", "choose", "Progress", "Bar"]
