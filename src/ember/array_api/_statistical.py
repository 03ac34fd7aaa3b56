"""Reductions: sum, prod, mean, min, max, std, var, all, any."""

from __future__ import annotations

import builtins
from typing import Any

from . import _dtypes as d
from ._array import RemoteArray, emit
from ._dtypes import DType, to_dtype

__all__ = ["sum", "prod", "mean", "min", "max", "std", "var", "all", "any", "normalize_axis", "reduced_shape"]


def normalize_axis(axis: int | tuple[int, ...] | None, ndim: int) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(ndim))
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    out = []
    for a in axes:
        if not -ndim <= a < builtins.max(ndim, 1):
            raise IndexError(f"axis {a} is out of bounds for an array of {ndim} dims")
        out.append(a % ndim if ndim else 0)
    if len(set(out)) != len(out):
        raise ValueError(f"repeated axis in {axis}")
    return tuple(out)


def reduced_shape(shape: tuple[int, ...], axes: tuple[int, ...], keepdims: bool) -> tuple[int, ...]:
    if keepdims:
        return tuple(1 if i in axes else n for i, n in enumerate(shape))
    return tuple(n for i, n in enumerate(shape) if i not in axes)


def _reduce(name: str, x: RemoteArray, axis: Any, keepdims: bool, dt: DType, **kw: Any) -> RemoteArray:
    if type(x) is not RemoteArray:
        raise TypeError(f"{name} expects an ember array, got {type(x).__name__}")
    axes = normalize_axis(axis, x.ndim)
    kwargs: dict[str, Any] = {"axis": list(axes) if axis is not None else None, "keepdims": keepdims, **kw}
    return emit(name, [x], 0, kwargs, reduced_shape(x.shape, axes, keepdims), dt)


def _accumulate_dtype(x: RemoteArray, dtype: Any) -> DType:
    if dtype is not None:
        return to_dtype(dtype)
    k = x.dtype.kind
    if k == "b" or k == "i":
        return d.int64
    if k == "u":
        return d.uint64
    return x.dtype


def _numeric(name: str, x: RemoteArray, allowed: frozenset[DType]) -> None:
    if x.dtype not in allowed:
        raise TypeError(f"{name} does not accept {x.dtype} inputs")


def sum(x: RemoteArray, /, *, axis: Any = None, dtype: Any = None, keepdims: bool = False) -> RemoteArray:
    _numeric("sum", x, d.NUMERIC)
    dt = _accumulate_dtype(x, dtype)
    return _reduce("sum", x, axis, keepdims, dt, dtype=dt.name)


def prod(x: RemoteArray, /, *, axis: Any = None, dtype: Any = None, keepdims: bool = False) -> RemoteArray:
    _numeric("prod", x, d.NUMERIC)
    dt = _accumulate_dtype(x, dtype)
    return _reduce("prod", x, axis, keepdims, dt, dtype=dt.name)


def mean(x: RemoteArray, /, *, axis: Any = None, keepdims: bool = False) -> RemoteArray:
    _numeric("mean", x, d.FLOAT)
    return _reduce("mean", x, axis, keepdims, x.dtype)


def min(x: RemoteArray, /, *, axis: Any = None, keepdims: bool = False) -> RemoteArray:
    _numeric("min", x, d.REAL_NUMERIC)
    return _reduce("min", x, axis, keepdims, x.dtype)


def max(x: RemoteArray, /, *, axis: Any = None, keepdims: bool = False) -> RemoteArray:
    _numeric("max", x, d.REAL_NUMERIC)
    return _reduce("max", x, axis, keepdims, x.dtype)


def std(x: RemoteArray, /, *, axis: Any = None, correction: int | float = 0.0,
        keepdims: bool = False) -> RemoteArray:
    _numeric("std", x, d.REAL_FLOAT)
    return _reduce("std", x, axis, keepdims, x.dtype, correction=correction)


def var(x: RemoteArray, /, *, axis: Any = None, correction: int | float = 0.0,
        keepdims: bool = False) -> RemoteArray:
    _numeric("var", x, d.REAL_FLOAT)
    return _reduce("var", x, axis, keepdims, x.dtype, correction=correction)


def all(x: RemoteArray, /, *, axis: Any = None, keepdims: bool = False) -> RemoteArray:
    return _reduce("all", x, axis, keepdims, d.bool)


def any(x: RemoteArray, /, *, axis: Any = None, keepdims: bool = False) -> RemoteArray:
    return _reduce("any", x, axis, keepdims, d.bool)
