"""Manipulation functions: shapes computed here, one op each."""

from __future__ import annotations

import math
from typing import Any, Sequence

from . import _dtypes as d
from . import _array
from . import _validate as V
from ._validate import I64_MAX as _I64_MAX, I64_MIN as _I64_MIN
from ._array import RemoteArray, emit, emit_dynamic, emit_multi, same_device
from ._statistical import normalize_axis

__all__ = ["broadcast_arrays", "broadcast_shapes", "broadcast_to", "concat", "expand_dims", "flip", "moveaxis",
           "permute_dims", "repeat", "reshape", "roll", "squeeze", "stack", "tile", "unstack"]


def _arr(name: str, x: Any) -> RemoteArray:
    if type(x) is not RemoteArray:
        raise TypeError(f"{name} expects an ember array, got {type(x).__name__}")
    return x


def _promote_all(arrays: Sequence[RemoteArray]) -> d.DType:
    dt = arrays[0].dtype
    for a in arrays[1:]:
        dt = d.promote(dt, a.dtype)
    return dt


def broadcast_shapes(*shapes: tuple[int, ...]) -> tuple[int, ...]:
    """The shape ``shapes`` broadcast to (2025.12); no shapes give ``()``. Computed here, no round trip."""
    return _array.broadcast_shapes(*(V.shape(f"shapes[{i}]", s) for i, s in enumerate(shapes)))


def broadcast_arrays(*arrays: RemoteArray) -> tuple[RemoteArray, ...]:
    if not arrays:
        return ()
    arrays = tuple(_arr("broadcast_arrays", a) for a in arrays)
    same_device(*arrays)
    shape = _array.broadcast_shapes(*(a.shape for a in arrays))
    V.fits("broadcast_arrays", shape, arrays[0].dtype, arrays[0]._session)
    return emit_multi("broadcast_arrays", list(arrays), None, [(shape, a.dtype) for a in arrays])


def broadcast_to(x: RemoteArray, /, shape: Sequence[int]) -> RemoteArray:
    shape = V.shape("shape", shape)
    if len(shape) < _arr("broadcast_to", x).ndim or _array.broadcast_shapes(x.shape, shape) != shape:
        raise ValueError(f"cannot broadcast an array of shape {x.shape} to {shape}")
    V.fits("broadcast_to", shape, x.dtype, x._session)
    return emit("broadcast_to", [x], 0, {"shape": list(shape)}, shape, x.dtype)


def reshape(x: RemoteArray, /, shape: Sequence[int], *, copy: bool | None = None) -> RemoteArray:
    shape = V.shape("shape", shape, unknown=True)
    size = _arr("reshape", x).size
    if copy is not None:
        copy = V.flag("copy", copy)
    if shape.count(-1) > 1:
        raise ValueError("reshape: at most one -1 in the new shape")
    known = math.prod(n for n in shape if n != -1)
    if -1 in shape:
        if known == 0 or size % known:
            raise ValueError(f"cannot reshape an array of size {size} into shape {shape}")
        shape = tuple(size // known if n == -1 else n for n in shape)
    elif known != size or any(n < 0 for n in shape):
        raise ValueError(f"cannot reshape an array of size {size} into shape {shape}")
    kw: dict[str, Any] = {"shape": list(shape)}
    if copy:
        kw["copy"] = True
    return emit("reshape", [x], 0, kw, shape, x.dtype)


def permute_dims(x: RemoteArray, /, axes: Sequence[int]) -> RemoteArray:
    axes = normalize_axis(V.integers("axes", axes), _arr("permute_dims", x).ndim, "axes")
    if len(axes) != x.ndim:
        raise ValueError(f"permute_dims needs {x.ndim} axes, got {len(axes)}")
    return emit("permute_dims", [x], 0, {"axes": list(axes)}, tuple(x.shape[a] for a in axes), x.dtype)


def moveaxis(x: RemoteArray, source: int | Sequence[int], destination: int | Sequence[int], /) -> RemoteArray:
    src = normalize_axis(source, _arr("moveaxis", x).ndim, "source")
    dst = normalize_axis(destination, x.ndim, "destination")
    if len(src) != len(dst):
        raise ValueError("moveaxis: source and destination need the same number of axes")
    order = [a for a in range(x.ndim) if a not in src]
    for s_, t in sorted(zip(dst, src)):
        order.insert(s_, t)
    return emit("permute_dims", [x], 0, {"axes": order}, tuple(x.shape[a] for a in order), x.dtype)


def expand_dims(x: RemoteArray, /, axis: int | tuple[int, ...] = 0) -> RemoteArray:
    """Insert singleton dims at ``axis`` (2025.12: or at each of a tuple of positions in the result)."""
    _arr("expand_dims", x)
    several = type(axis) is tuple
    if several:
        axis = V.integers("axis", axis, limit=V.MAX_DIMS)
    axes = normalize_axis(axis, x.ndim + (len(axis) if several else 1))
    shape = list(x.shape)
    for a in sorted(axes):
        shape.insert(a, 1)
    return emit("expand_dims", [x], 0, {"axis": sorted(axes) if several else axes[0]}, tuple(shape), x.dtype)


def squeeze(x: RemoteArray, /, axis: int | tuple[int, ...]) -> RemoteArray:
    if axis is None:
        raise ValueError("squeeze needs an explicit axis")
    axes = normalize_axis(axis, _arr("squeeze", x).ndim)
    for a in axes:
        if x.shape[a] != 1:
            raise ValueError(f"cannot squeeze axis {a} of size {x.shape[a]}")
    shape = tuple(n for i, n in enumerate(x.shape) if i not in axes)
    return emit("squeeze", [x], 0, {"axis": list(axes)}, shape, x.dtype)


def concat(arrays: Sequence[RemoteArray], /, *, axis: int | None = 0) -> RemoteArray:
    if not isinstance(arrays, (list, tuple)):
        raise TypeError(f"concat expects a tuple or list of ember arrays, got {type(arrays).__name__}")
    arrays = [_arr("concat", a) for a in arrays]
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
        axis = ax
    return emit("concat", arrays, 0, {"axis": axis}, shape, dt)


def stack(arrays: Sequence[RemoteArray], /, *, axis: int = 0) -> RemoteArray:
    if not isinstance(arrays, (list, tuple)):
        raise TypeError(f"stack expects a tuple or list of ember arrays, got {type(arrays).__name__}")
    arrays = [_arr("stack", a) for a in arrays]
    if not arrays:
        raise ValueError("stack needs at least one array")
    same_device(*arrays)
    if any(a.shape != arrays[0].shape for a in arrays):
        raise ValueError(f"stack: all shapes must match, got {[a.shape for a in arrays]}")
    a = normalize_axis(V.integer("axis", axis), arrays[0].ndim + 1)[0]
    s = arrays[0].shape
    return emit("stack", arrays, 0, {"axis": a}, s[:a] + (len(arrays),) + s[a:], _promote_all(arrays))


def flip(x: RemoteArray, /, *, axis: int | tuple[int, ...] | None = None) -> RemoteArray:
    axes = normalize_axis(axis, _arr("flip", x).ndim)
    return emit("flip", [x], 0, {"axis": list(axes)}, x.shape, x.dtype)


def roll(x: RemoteArray, /, shift: int | tuple[int, ...], *, axis: int | tuple[int, ...] | None = None) -> RemoteArray:
    _arr("roll", x)
    if type(shift) is int and axis is None and _I64_MIN <= shift <= _I64_MAX:  # the common case
        n = x.size
        return emit("roll", [x], 0, {"shift": shift % n if n else 0, "axis": None}, x.shape, x.dtype)
    several = isinstance(shift, (tuple, list))
    shifts: Any = list(V.integers("shift", shift)) if several else V.integer("shift", shift)
    axes = None if axis is None else list(normalize_axis(axis, x.ndim))
    if several and (axes is None or len(axes) != len(shifts)):
        raise ValueError("roll: shift and axis need the same length")
    if not several and axes is not None and len(axes) > 1:
        shifts = [shifts] * len(axes)
    # a shift is a shift modulo the length it rolls along: the same result, and small on the wire
    if axes is None:
        shifts = shifts % x.size if x.size else 0
    else:
        lengths = [x.shape[a] for a in axes]
        shifts = [s % n if n else 0 for s, n in zip(shifts, lengths)] if isinstance(shifts, list) \
            else (shifts % lengths[0] if lengths[0] else 0)
    return emit("roll", [x], 0, {"shift": shifts, "axis": axes}, x.shape, x.dtype)


def repeat(x: RemoteArray, repeats: int | RemoteArray, /, *, axis: int | None = None) -> RemoteArray:
    _arr("repeat", x)
    a = None if axis is None else normalize_axis(axis, x.ndim)[0]
    if type(repeats) is RemoteArray:
        same_device(x, repeats)
        if repeats.dtype not in d.INTEGER:
            raise TypeError(f"repeat: repeats must have an integer dtype, got {repeats.dtype}")
        if repeats.ndim > 1:
            raise ValueError("repeat: repeats must be 0-d or 1-d")
        return emit_dynamic("repeat", [x, repeats], {"axis": a}, x.dtype)
    if isinstance(repeats, bool):
        raise TypeError("repeat: repeats must be a non-negative int or an integer array, got a bool")
    repeats = V.integer("repeats", repeats, lo=0)
    if a is None:
        shape: tuple[int, ...] = (x.size * repeats,)
    else:
        shape = tuple(n * repeats if i == a else n for i, n in enumerate(x.shape))
    V.fits("repeat", shape, x.dtype, x._session)
    return emit("repeat", [x, repeats], 2, {"axis": a}, shape, x.dtype)


def tile(x: RemoteArray, repetitions: Sequence[int], /) -> RemoteArray:
    reps = V.shape("repetitions", repetitions)
    n = max(len(reps), _arr("tile", x).ndim)
    r = (1,) * (n - len(reps)) + reps
    s = (1,) * (n - x.ndim) + x.shape
    shape = tuple(a * b for a, b in zip(s, r))
    V.fits("tile", shape, x.dtype, x._session)
    return emit("tile", [x, list(reps)], 2, None, shape, x.dtype)


def unstack(x: RemoteArray, /, *, axis: int = 0) -> tuple[RemoteArray, ...]:
    a = normalize_axis(V.integer("axis", axis), _arr("unstack", x).ndim)[0]
    n = x.shape[a]
    if n == 0:
        return ()
    spec = (x.shape[:a] + x.shape[a + 1:], x.dtype)
    return emit_multi("unstack", [x], {"axis": a}, [spec] * n)
