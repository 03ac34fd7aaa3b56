"""Searching functions: argmax, argmin, count_nonzero, nonzero, searchsorted, where."""

from __future__ import annotations

from typing import Any

from . import _dtypes as d
from . import _validate as V
from ._array import RemoteArray, broadcast_shapes, emit, emit_dynamic_multi, same_device, scalar_array
from ._statistical import normalize_axis, reduced_shape

__all__ = ["argmax", "argmin", "count_nonzero", "nonzero", "searchsorted", "where"]

_PY_SCALARS = (bool, int, float, complex)


def _arr(name: str, x: Any) -> RemoteArray:
    if type(x) is not RemoteArray:
        raise TypeError(f"{name} expects an ember array, got {type(x).__name__}")
    return x


def _arg(name: str, x: RemoteArray, axis: int | None, keepdims: bool) -> RemoteArray:
    if _arr(name, x).dtype not in d.REAL_NUMERIC:
        raise TypeError(f"{name} does not accept {x.dtype} inputs")
    if x.size == 0:
        raise ValueError(f"{name} of an empty array")
    keepdims = V.flag("keepdims", keepdims)
    axes = normalize_axis(axis, x.ndim)
    a = None if axis is None else axes[0]
    return emit(name, [x], 0, {"axis": a, "keepdims": keepdims}, reduced_shape(x.shape, axes, keepdims),
                d.DEFAULT_INDEX)


def argmax(x: RemoteArray, /, *, axis: int | None = None, keepdims: bool = False) -> RemoteArray:
    return _arg("argmax", x, axis, keepdims)


def argmin(x: RemoteArray, /, *, axis: int | None = None, keepdims: bool = False) -> RemoteArray:
    return _arg("argmin", x, axis, keepdims)


def count_nonzero(x: RemoteArray, /, *, axis: int | tuple[int, ...] | None = None,
                  keepdims: bool = False) -> RemoteArray:
    axes = normalize_axis(axis, _arr("count_nonzero", x).ndim)
    keepdims = V.flag("keepdims", keepdims)
    kwargs = {"axis": list(axes) if axis is not None else None, "keepdims": keepdims}
    return emit("count_nonzero", [x], 0, kwargs, reduced_shape(x.shape, axes, keepdims), d.DEFAULT_INT)


def nonzero(x: RemoteArray, /) -> tuple[RemoteArray, ...]:
    """Indices of the non-zero elements: one round trip to learn how many there are."""
    if _arr("nonzero", x).ndim == 0:
        raise ValueError("nonzero of a 0-d array is not allowed; use x[None] or reshape first")
    return emit_dynamic_multi("nonzero", [x], None, [(None, d.DEFAULT_INDEX)] * x.ndim)


def searchsorted(x1: RemoteArray, x2: RemoteArray | int | float, /, *, side: str = "left",
                 sorter: RemoteArray | None = None) -> RemoteArray:
    """Insertion indices of ``x2`` in sorted ``x1``; 2025.12: ``x2`` may be a Python scalar (a 0-d result)."""
    _arr("searchsorted", x1)
    if x1.ndim != 1:
        raise ValueError(f"searchsorted: x1 must be one-dimensional, got {x1.ndim} dims")
    V.choice("side", side, ("left", "right"))
    scalar = type(x2) is not RemoteArray
    if scalar:
        if type(x2) not in (int, float):
            raise TypeError(f"searchsorted: x2 must be an ember array, an int or a float, got {type(x2).__name__}")
        x2 = V.literal(x2, d.scalar_ok(x1.dtype, x2))
    if x1.dtype not in d.REAL_NUMERIC or not scalar and x2.dtype not in d.REAL_NUMERIC:
        raise TypeError(f"searchsorted needs real numeric inputs, got {x1.dtype} and "
                        f"{type(x2).__name__ if scalar else x2.dtype}")
    if not scalar:
        d.promote(x1.dtype, x2.dtype)
    others = [a for a in (x2, sorter) if type(a) is RemoteArray]
    same_device(x1, *others)
    if sorter is not None and (type(sorter) is not RemoteArray or sorter.dtype not in d.INTEGER
                               or sorter.shape != x1.shape):
        raise TypeError("searchsorted: sorter must be an integer ember array of x1's shape")
    smask = (2 if scalar else 0) | (4 if sorter is None else 0)
    shape = () if scalar else x2.shape
    return emit("searchsorted", [x1, x2, sorter], smask, {"side": side}, shape, d.DEFAULT_INDEX)


def where(condition: RemoteArray, x1: Any, x2: Any, /) -> RemoteArray:
    if _arr("where", condition).dtype is not d.bool:
        raise TypeError(f"where: condition must be bool, got {condition.dtype}")
    a1, a2 = type(x1) is RemoteArray, type(x2) is RemoteArray
    if not (a1 or a2):
        raise TypeError("where: at least one of x1, x2 must be an ember array")
    for v, isarr in ((x1, a1), (x2, a2)):
        if not isarr and type(v) not in _PY_SCALARS:
            raise TypeError(f"where: x1 and x2 must be ember arrays or Python scalars, got {type(v).__name__}")
    if a1 and a2:
        same_device(condition, x1, x2)
        dt = d.promote(x1.dtype, x2.dtype)
        shape = broadcast_shapes(condition.shape, x1.shape, x2.shape)
    else:
        arr, sc = (x1, x2) if a1 else (x2, x1)
        same_device(condition, arr)
        dt = d.scalar_ok(arr.dtype, sc)
        shape = broadcast_shapes(condition.shape, arr.shape)
        if type(sc) is int:  # (an int beyond 64 bits travels as a float, with a floating array)
            x1, x2 = (x1, V.literal(sc, dt)) if a1 else (V.literal(sc, dt), x2)
        if type(sc) is complex:  # no complex literals on the wire
            if a1:
                x2, a2 = scalar_array(sc, dt, arr), True
            else:
                x1, a1 = scalar_array(sc, dt, arr), True
    smask = (0 if a1 else 2) | (0 if a2 else 4)
    return emit("where", [condition, x1, x2], smask, None, shape, dt)
