"""``x[key]`` and ``x[key] = v``: basic slicing, integer arrays and boolean masks."""

from __future__ import annotations

from typing import Any

from . import _dtypes as d
from ._array import RemoteArray, emit, emit_dynamic, same_device
from ..protocol import codec


def _basic_shape(shape: tuple[int, ...], key: tuple[Any, ...]) -> tuple[int, ...] | None:
    """Result shape of basic indexing; None when arrays make it not basic."""
    if any(isinstance(k, RemoteArray) for k in key):
        return None
    n_real = sum(1 for k in key if k is not None and k is not Ellipsis)
    if n_real > len(shape):
        raise IndexError(f"too many indices ({n_real}) for an array of {len(shape)} dims")
    if sum(1 for k in key if k is Ellipsis) > 1:
        raise IndexError("an index can only have a single ellipsis")
    if Ellipsis not in key:
        key = key + (Ellipsis,)
    out: list[int] = []
    dim = 0
    for k in key:
        if k is Ellipsis:
            take = len(shape) - n_real
            out.extend(shape[dim:dim + take])
            dim += take
        elif k is None:
            out.append(1)
        elif isinstance(k, slice):
            out.append(len(range(*k.indices(shape[dim]))))
            dim += 1
        elif isinstance(k, int) and not isinstance(k, bool):
            if not -shape[dim] <= k < shape[dim]:
                raise IndexError(f"index {k} is out of bounds for axis {dim} with size {shape[dim]}")
            dim += 1
        else:
            raise IndexError(f"unsupported index {k!r}: use ints, slices, None, ..., or ember arrays")
    return tuple(out)


def getitem(x: RemoteArray, key: Any) -> RemoteArray:
    tkey = key if isinstance(key, tuple) else (key,)
    extra: list[int] = []
    enc = codec.encode_key(key, extra, RemoteArray)
    arrays = [k for k in tkey if isinstance(k, RemoteArray)]
    if arrays:
        same_device(x, *arrays)
    shape = _basic_shape(x.shape, tkey)
    if shape is not None:
        return emit("getitem", [x], 0, {"key": enc}, shape, x.dtype)
    args = [x, *arrays]
    if any(a.dtype is d.bool for a in arrays):
        return emit_dynamic("getitem", args, {"key": enc}, x.dtype)
    if len(arrays) == 1 and len(tkey) == 1 and arrays[0].dtype in d.INTEGER:
        return emit("getitem", args, 0, {"key": enc}, arrays[0].shape + x.shape[1:], x.dtype)
    return emit_dynamic("getitem", args, {"key": enc}, x.dtype)


def setitem(x: RemoteArray, key: Any, value: Any) -> None:
    tkey = key if isinstance(key, tuple) else (key,)
    extra: list[int] = []
    enc = codec.encode_key(key, extra, RemoteArray)
    arrays = [k for k in tkey if isinstance(k, RemoteArray)]
    if isinstance(value, RemoteArray):
        same_device(x, value, *arrays)
        if d.PROMOTION.get((value.dtype, x.dtype)) is not x.dtype:
            raise TypeError(f"cannot assign {value.dtype} values into a {x.dtype} array")
        smask = 0
    else:
        d.scalar_ok(x.dtype, value)
        smask = 2
    new = emit("setitem", [x, value, *arrays], smask, {"key": enc}, x.shape, x.dtype)
    x._adopt(new)
