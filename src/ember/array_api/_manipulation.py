"""Shape manipulation: reshape, permute_dims, expand_dims, squeeze, concat, stack, flip."""

from __future__ import annotations

import math
from typing import Any, Sequence

from . import _dtypes as d
from ._array import RemoteArray, emit, same_device
from ._statistical import normalize_axis

__all__ = ["reshape", "permute_dims", "expand_dims", "squeeze", "concat", "stack", "flip"]


def reshape(x: RemoteArray, /, shape: Sequence[int], *, copy: bool | None = None) -> RemoteArray:
    shape = tuple(int(n) for n in shape)
    if shape.count(-1) > 1:
        raise ValueError("reshape: at most one -1 in the new shape")
    known = math.prod(n for n in shape if n != -1)
    if -1 in shape:
        if known == 0 or x.size % known:
            raise ValueError(f"cannot reshape an array of size {x.size} into shape {shape}")
        shape = tuple(x.size // known if n == -1 else n for n in shape)
    elif known != x.size:
        raise ValueError(f"cannot reshape an array of size {x.size} into shape {shape}")
    kw: dict[str, Any] = {"shape": list(shape)}
    if copy is not None:
        kw["copy"] = copy
    return emit("reshape", [x], 0, kw, shape, x.dtype)


def permute_dims(x: RemoteArray, /, axes: Sequence[int]) -> RemoteArray:
    axes = normalize_axis(tuple(axes), x.ndim)
    if len(axes) != x.ndim:
        raise ValueError(f"permute_dims needs {x.ndim} axes, got {len(axes)}")
    return emit("permute_dims", [x], 0, {"axes": list(axes)}, tuple(x.shape[a] for a in axes), x.dtype)


def expand_dims(x: RemoteArray, /, axis: int = 0) -> RemoteArray:
    n = x.ndim + 1
    if not -n <= axis < n:
        raise IndexError(f"expand_dims axis {axis} out of range for {x.ndim} dims")
    a = axis % n
    shape = x.shape[:a] + (1,) + x.shape[a:]
    return emit("expand_dims", [x], 0, {"axis": a}, shape, x.dtype)


def squeeze(x: RemoteArray, /, axis: int | tuple[int, ...]) -> RemoteArray:
    axes = normalize_axis(axis, x.ndim)
    for a in axes:
        if x.shape[a] != 1:
            raise ValueError(f"cannot squeeze axis {a} of size {x.shape[a]}")
    shape = tuple(n for i, n in enumerate(x.shape) if i not in axes)
    return emit("squeeze", [x], 0, {"axis": list(axes)}, shape, x.dtype)


def _promote_all(arrays: Sequence[RemoteArray]) -> d.DType:
    dt = arrays[0].dtype
    for a in arrays[1:]:
        dt = d.promote(dt, a.dtype)
    return dt


def concat(arrays: Sequence[RemoteArray], /, *, axis: int | None = 0) -> RemoteArray:
    arrays = list(arrays)
    if not arrays:
        raise ValueError("concat needs at least one array")
    same_device(*arrays)
    dt = _promote_all(arrays)
    if axis is None:
        shape: tuple[int, ...] = (sum(a.size for a in arrays),)
    else:
        nd = arrays[0].ndim
        ax = normalize_axis(axis, nd)[0]
        for a in arrays:
            if a.ndim != nd or any(a.shape[i] != arrays[0].shape[i] for i in range(nd) if i != ax):
                raise ValueError(f"concat: shapes {[x.shape for x in arrays]} differ off axis {axis}")
        shape = tuple(sum(a.shape[ax] for a in arrays) if i == ax else n for i, n in enumerate(arrays[0].shape))
    return emit("concat", arrays, 0, {"axis": axis}, shape, dt)


def stack(arrays: Sequence[RemoteArray], /, *, axis: int = 0) -> RemoteArray:
    arrays = list(arrays)
    if not arrays:
        raise ValueError("stack needs at least one array")
    same_device(*arrays)
    if any(a.shape != arrays[0].shape for a in arrays):
        raise ValueError(f"stack: all shapes must match, got {[a.shape for a in arrays]}")
    n = arrays[0].ndim + 1
    if not -n <= axis < n:
        raise IndexError(f"stack axis {axis} out of range")
    a = axis % n
    s = arrays[0].shape
    return emit("stack", arrays, 0, {"axis": a}, s[:a] + (len(arrays),) + s[a:], _promote_all(arrays))


def flip(x: RemoteArray, /, *, axis: int | tuple[int, ...] | None = None) -> RemoteArray:
    axes = normalize_axis(axis, x.ndim)
    return emit("flip", [x], 0, {"axis": list(axes) if axis is not None else None}, x.shape, x.dtype)
