"""``__array_namespace_info__()``: capabilities, devices and dtypes of this namespace."""

from __future__ import annotations

from typing import Any

from . import _dtypes as d
from ._device import KNOWN, dtype_names, resolve

__all__ = ["__array_namespace_info__"]

_KINDS = {"bool": d.BOOL, "signed integer": frozenset(x for x in d.ALL if x.kind == "i"),
          "unsigned integer": frozenset(x for x in d.ALL if x.kind == "u"), "integral": d.INTEGER,
          "real floating": d.REAL_FLOAT, "complex floating": d.COMPLEX, "numeric": d.NUMERIC}


class Info:
    """The inspection object of the standard (``xp.__array_namespace_info__()``)."""

    __module__ = "ember.array_api"

    def capabilities(self) -> dict[str, Any]:
        return {"boolean indexing": True, "data-dependent shapes": True, "max dimensions": 64}

    def default_device(self) -> Any:
        """The device of calls without ``device=`` (2025.12 allows None where that is unpredictable; it
        never is here: the innermost ``with dev:``, else ``set_default_device``, else ``local``)."""
        return resolve(None)

    def devices(self) -> tuple[Any, ...]:
        """The default device and every device arrays were created on in this process."""
        default = resolve(None)
        return (default,) + tuple(dev for dev in list(KNOWN) if dev is not default)

    def default_dtypes(self, *, device: Any = None) -> dict[str, d.DType]:
        if device is not None:
            resolve(device)
        return {"real floating": d.DEFAULT_FLOAT, "complex floating": d.DEFAULT_COMPLEX,
                "integral": d.DEFAULT_INT, "indexing": d.DEFAULT_INDEX}

    def dtypes(self, *, device: Any = None, kind: str | tuple[str, ...] | None = None) -> dict[str, d.DType]:
        """The dtypes ``device`` (default: the default device) offers, optionally of ``kind``."""
        names = dtype_names(resolve(device))
        out = {n: d.BY_NAME[n] for n in names if n in d.BY_NAME}
        if kind is None:
            return out
        kinds = kind if isinstance(kind, tuple) else (kind,)
        for k in kinds:
            if k not in _KINDS:
                raise ValueError(f"unknown dtype kind {k!r}; expected one of {sorted(_KINDS)}")
        return {n: t for n, t in out.items() if any(t in _KINDS[k] for k in kinds)}


_INFO = Info()


def __array_namespace_info__() -> Info:
    return _INFO
