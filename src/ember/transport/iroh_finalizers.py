"""Never free an iroh object inside one of iroh's own threads (a deadlock in the binding).

iroh 1.2's Python binding frees each Rust object from its ``__del__``. When Python's
garbage collector happens to run inside a uniffi callback -- Rust calling back into
Python to wake an awaiting future, from one of its runtime threads, while it still
holds the QUIC connection's lock -- and collects a ``SendStream`` of that connection,
the Rust ``drop`` waits for that same lock: the runtime thread, the connection and
every stream on it hang for good. The protocol fuzzer found it (after ~75,000 cases
of short-lived streams opened and reset).

:func:`install` replaces the ``__del__`` of every binding class: on a thread Python
did not start (a Rust thread, seen as ``threading._DummyThread``) the handle is handed
to a small reaper thread that frees it a moment later, outside any lock; on Python's
own threads nothing changes.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable

import iroh.iroh_ffi as _ffi

_pending: "queue.SimpleQueue[tuple[Any, Any]]" = queue.SimpleQueue()
_reaper: threading.Thread | None = None
_lock = threading.Lock()
_installed = False
deferred = 0  # frees handed to the reaper so far (for tests and curiosity)


def _reap() -> None:
    while True:
        free, handle = _pending.get()
        try:
            _ffi._uniffi_rust_call(free, handle)
        except Exception:  # noqa: BLE001 - a failed free must not kill the reaper
            pass


def _defer(free: Any, handle: Any) -> None:
    global _reaper, deferred
    with _lock:
        if _reaper is None:
            _reaper = threading.Thread(target=_reap, name="ember-iroh-reaper", daemon=True)
            _reaper.start()
        deferred += 1
    _pending.put((free, handle))


def _deleter(free: Any) -> Callable[[Any], None]:
    # bound now: at interpreter exit module globals are already gone when the last objects die
    current, dummy, call, defer = threading.current_thread, threading._DummyThread, _ffi._uniffi_rust_call, _defer

    def __del__(self: Any) -> None:
        handle = getattr(self, "_handle", None)
        if handle is None:
            return
        try:
            if isinstance(current(), dummy):  # a Rust thread
                defer(free, handle)
            else:
                call(free, handle)
        except Exception:  # noqa: BLE001 - at interpreter exit: nothing left to free into
            pass
    return __del__


def install() -> int:
    """Patch the binding's classes (idempotent); returns how many were patched."""
    global _installed
    if _installed:
        return 0
    n = 0
    lib = _ffi._UniffiLib
    for name, cls in list(vars(_ffi).items()):
        free = getattr(lib, f"uniffi_iroh_ffi_fn_free_{name.lower()}", None)
        if isinstance(cls, type) and free is not None and "__del__" in vars(cls):
            cls.__del__ = _deleter(free)
            n += 1
    _installed = True
    return n


__all__ = ["install"]
