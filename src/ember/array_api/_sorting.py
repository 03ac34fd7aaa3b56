"""Sorting functions: argsort, sort."""

from __future__ import annotations

from typing import Any

from . import _dtypes as d
from . import _validate as V
from ._array import RemoteArray, emit
from ._statistical import normalize_axis

__all__ = ["argsort", "sort"]


def _sort(name: str, x: Any, axis: int, descending: bool, stable: bool, dt: d.DType | None) -> RemoteArray:
    if type(x) is not RemoteArray:
        raise TypeError(f"{name} expects an ember array, got {type(x).__name__}")
    if x.dtype not in d.REAL_NUMERIC:
        raise TypeError(f"{name} does not accept {x.dtype} inputs")
    if x.ndim == 0:
        raise ValueError(f"{name} needs an array of at least one dim")
    a = normalize_axis(axis, x.ndim)[0]
    kw = {"axis": a, "descending": V.flag("descending", descending), "stable": V.flag("stable", stable)}
    return emit(name, [x], 0, kw, x.shape, dt or x.dtype)


def argsort(x: RemoteArray, /, *, axis: int = -1, descending: bool = False, stable: bool = True) -> RemoteArray:
    return _sort("argsort", x, axis, descending, stable, d.DEFAULT_INDEX)


def sort(x: RemoteArray, /, *, axis: int = -1, descending: bool = False, stable: bool = True) -> RemoteArray:
    return _sort("sort", x, axis, descending, stable, None)
