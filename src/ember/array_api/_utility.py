"""Utility functions: all, any, diff."""

from __future__ import annotations

import builtins
from typing import Any

from . import _dtypes as d
from . import _validate as V
from ._array import RemoteArray, emit, same_device
from ._statistical import normalize_axis, reduce_plan

__all__ = ["all", "any", "diff"]


def _logical(name: str, x: RemoteArray, axis: Any, keepdims: bool) -> RemoteArray:
    if type(x) is not RemoteArray:
        raise TypeError(f"{name} expects an ember array, got {type(x).__name__}")
    shape, kwargs = reduce_plan(x, axis, keepdims)
    return emit(name, [x], 0, kwargs, shape, d.bool)


def all(x: RemoteArray, /, *, axis: int | tuple[int, ...] | None = None, keepdims: bool = False) -> RemoteArray:
    return _logical("all", x, axis, keepdims)


def any(x: RemoteArray, /, *, axis: int | tuple[int, ...] | None = None, keepdims: bool = False) -> RemoteArray:
    return _logical("any", x, axis, keepdims)


def diff(x: RemoteArray, /, *, axis: int = -1, n: int = 1, prepend: RemoteArray | None = None,
         append: RemoteArray | None = None) -> RemoteArray:
    if type(x) is not RemoteArray:
        raise TypeError(f"diff expects an ember array, got {type(x).__name__}")
    if x.dtype not in d.NUMERIC:
        raise TypeError(f"diff does not accept {x.dtype} inputs")
    if x.ndim == 0:
        raise ValueError("diff needs an array of at least one dim")
    n = V.integer("n", n, lo=0)
    a = normalize_axis(axis, x.ndim)[0]
    extra = [e for e in (prepend, append) if e is not None]
    if builtins.any(type(e) is not RemoteArray for e in extra):
        raise TypeError("diff: prepend and append must be ember arrays or None")
    same_device(x, *extra)
    dt = x.dtype
    length = x.shape[a]
    for e in extra:
        if e.ndim != x.ndim or builtins.any(e.shape[i] != x.shape[i] for i in range(x.ndim) if i != a):
            raise ValueError(f"diff: prepend/append of shape {e.shape} does not fit {x.shape} off axis {a}")
        dt = d.promote(dt, e.dtype)
        length += e.shape[a]
    if n == 0:  # NumPy's rule (and the oracle's): nothing is differenced, prepend/append are ignored
        length, dt = x.shape[a], x.dtype
    n = min(n, length)  # differencing as often as there are elements leaves none: the same (empty) result
    shape = tuple(max(length - n, 0) if i == a else s for i, s in enumerate(x.shape))
    smask = (2 if prepend is None else 0) | (4 if append is None else 0)
    return emit("diff", [x, prepend, append], smask, {"axis": a, "n": n}, shape, dt)
