"""``x[key]``, ``x[key] = v``, ``take`` and ``take_along_axis``.

Result shapes are computed here for basic indexing and for integer-array indexing
whose array indices sit next to each other (NumPy's rule, the standard's case). A
boolean mask, or arrays mixed with ``None`` or split by slices, make the shape
depend on data or on backend conventions: those cost one round trip to learn it.
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

from . import _dtypes as d
from . import _validate as V
from ._array import RemoteArray, broadcast_shapes, emit, emit_dynamic, same_device, scalar_array
from ..protocol import codec
from ..protocol import messages as m

__all__ = ["take", "take_along_axis"]


def _items(key: Any) -> tuple[Any, ...]:
    """The key as a tuple of ints, slices, None, Ellipsis and ember arrays."""
    tkey = key if type(key) is tuple else (key,)
    out = []
    for k in tkey:
        if k is None or k is Ellipsis or type(k) is RemoteArray or type(k) is int:
            out.append(k)
        elif type(k) is slice:
            b = (k.start, k.stop, k.step)
            if any(v is not None and type(v) is not int for v in b):  # e.g. x[:n] with n a 0-d array
                k = slice(*(None if v is None else _index(v) for v in b))
            out.append(k)
        elif isinstance(k, bool) or not hasattr(k, "__index__"):
            raise IndexError(f"unsupported index {k!r:.60}: use ints, slices, None, ..., or ember arrays")
        else:
            out.append(_index(k))
    return tuple(out)


def _index(v: Any) -> int:
    """``operator.index``, with whatever a foreign ``__index__`` raises as an IndexError."""
    try:
        return operator.index(v)
    except Exception:
        raise IndexError(f"unsupported index {v!r:.60}: slice bounds and indices must be integers") from None


_BIG = 1 << 62


def _slice_wire(a: Any, b: Any, c: Any, n: int) -> list[Any]:
    """A slice for the wire: bounds beyond the axis (any Python int is a valid bound) brought to
    ``±(n + 1)``, a step beyond it to ``±n``: the same elements, and always within 64 bits."""
    if (a is None or -_BIG < a < _BIG) and (b is None or -_BIG < b < _BIG) and (c is None or -_BIG < c < _BIG):
        return [_S, a, b, c]
    m = n + 1
    a = None if a is None else V.clamp(a, -m, m)
    b = None if b is None else V.clamp(b, -m, m)
    c = None if c is None else V.clamp(c, -max(n, 1), max(n, 1))
    return [_S, a, b, c]


def _wire_items(shape: tuple[int, ...], items: tuple[Any, ...]) -> tuple[Any, ...]:
    """``items`` (already checked against ``shape``) with huge slice bounds clamped (``_slice_wire``)."""
    if not any(type(k) is slice and any(v is not None and not -_BIG < v < _BIG for v in (k.start, k.stop, k.step))
               for k in items):
        return items
    used = sum(_consumed(k) for k in items)
    out, dim = [], 0
    for k in items:
        if k is Ellipsis:
            dim += len(shape) - used
        elif type(k) is slice:
            k = slice(*_slice_wire(k.start, k.stop, k.step, shape[dim])[1:])
        out.append(k)
        dim += _consumed(k) if k is not Ellipsis else 0
    return tuple(out)


def _consumed(k: Any) -> int:
    if k is None or k is Ellipsis:
        return 0
    if type(k) is RemoteArray and k.dtype is d.bool:
        return k.ndim
    return 1


def _expand(shape: tuple[int, ...], key: tuple[Any, ...]) -> list[Any]:
    """Replace the ellipsis (explicit or implied at the end) by full slices; check the dim count."""
    n_ell = sum(1 for k in key if k is Ellipsis)
    if n_ell > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    used = sum(_consumed(k) for k in key)
    if used > len(shape):
        raise IndexError(f"too many indices for an array of {len(shape)} dims: the index uses {used}")
    fill = [slice(None)] * (len(shape) - used)
    if not n_ell:
        return list(key) + fill
    i = key.index(Ellipsis)
    return list(key[:i]) + fill + list(key[i + 1:])


def _index_shape(shape: tuple[int, ...], items: list[Any]) -> tuple[int, ...] | None:
    """Result shape of ``x[items]``; None when it must be learnt from the peer."""
    out: list[Any] = []
    adv: list[tuple[int, ...]] = []   # shapes of the advanced indices (arrays, and ints next to arrays)
    adv_at: list[int] = []            # their positions in ``out``
    has_array = any(type(k) is RemoteArray for k in items)
    dim = 0
    for k in items:
        if k is None:
            if has_array:
                return None
            out.append(1)
            continue
        if type(k) is RemoteArray:
            if k.dtype is d.bool:
                if k.shape != shape[dim:dim + k.ndim]:
                    raise IndexError(f"boolean index of shape {k.shape} does not match the indexed dims "
                                     f"{shape[dim:dim + k.ndim]}")
                return None
            if k.dtype not in d.INTEGER:
                raise IndexError(f"array indices must be integer or bool, got {k.dtype}")
            adv.append(k.shape)
            adv_at.append(len(out))
        elif type(k) is slice:
            out.append(len(range(*k.indices(shape[dim]))))
        else:
            n = shape[dim]
            if not -n <= k < n:
                raise IndexError(f"index {k} is out of bounds for axis {dim} with size {n}")
            if has_array:
                adv.append(())
                adv_at.append(len(out))
        dim += 1
    if not adv:
        return tuple(out)
    if adv_at[-1] != adv_at[0]:
        return None  # advanced indices split by slices: the layout is a backend convention
    at = adv_at[0]
    return tuple(out[:at]) + broadcast_shapes(*adv) + tuple(out[at:])


_S, _N, _E = m.KEY_SLICE, m.KEY_NONE, m.KEY_ELLIPSIS


def _basic(shape: tuple[int, ...], key: Any) -> tuple[tuple[int, ...], list[Any]] | None:
    """One pass over a key of plain ints, slices, None and one ellipsis: (result shape, wire key).

    None for anything else (arrays, NumPy ints, ...): the general path handles those.
    """
    items = key if type(key) is tuple else (key,)
    used = 0
    for k in items:
        t = type(k)
        if t is int or t is slice:
            used += 1
        elif k is not None and k is not Ellipsis:
            return None
    nd = len(shape)
    if used > nd:
        raise IndexError(f"too many indices for an array of {nd} dims: the index uses {used}")
    out: list[int] = []
    enc: list[Any] = []
    dim = 0
    ell = False
    for k in items:
        t = type(k)
        if t is slice:
            a, b, c = k.start, k.stop, k.step
            if not ((a is None or type(a) is int) and (b is None or type(b) is int) and (c is None or type(c) is int)):
                return None
            out.append(len(range(*k.indices(shape[dim]))))
            enc.append(_slice_wire(a, b, c, shape[dim]))
            dim += 1
        elif t is int:
            n = shape[dim]
            if not -n <= k < n:
                raise IndexError(f"index {k} is out of bounds for axis {dim} with size {n}")
            enc.append(k)
            dim += 1
        elif k is None:
            out.append(1)
            enc.append([_N])
        else:
            if ell:
                raise IndexError("an index can only have a single ellipsis ('...')")
            ell = True
            take = nd - used
            out.extend(shape[dim:dim + take])
            dim += take
            enc.append([_E])
    out.extend(shape[dim:])
    return tuple(out), enc


def getitem(x: RemoteArray, key: Any) -> RemoteArray:
    plan = _basic(x._shape, key)
    if plan is not None:  # the common case: no arrays in the key, no round trip, one pass
        return emit("getitem", [x], 0, {"key": plan[1]}, plan[0], x._dtype)
    items = _items(key)
    arrays = [k for k in items if type(k) is RemoteArray]
    if arrays:
        same_device(x, *arrays)
    shape = _index_shape(x.shape, _expand(x.shape, items))
    extra: list[int] = []
    enc = codec.encode_key(_wire_items(x.shape, items), extra, RemoteArray)
    if shape is None:
        return emit_dynamic("getitem", [x, *arrays], {"key": enc}, x.dtype)
    return emit("getitem", [x, *arrays], 0, {"key": enc}, shape, x.dtype)


def setitem(x: RemoteArray, key: Any, value: Any) -> None:
    items = _items(key)
    arrays = [k for k in items if type(k) is RemoteArray]
    target = _index_shape(x.shape, _expand(x.shape, items))
    if type(value) is RemoteArray:
        same_device(x, value, *arrays)
        if d.PROMOTION.get((value.dtype, x.dtype)) is not x.dtype:
            raise TypeError(f"cannot assign {value.dtype} values into a {x.dtype} array")
        if target is not None and broadcast_shapes(value.shape, target) != target:
            raise ValueError(f"cannot assign an array of shape {value.shape} to a selection of shape {target}")
        smask = 0
    else:
        if arrays:
            same_device(x, *arrays)
        if isinstance(value, np.generic) and value.dtype.kind in "biufc":
            value = value.item()  # a NumPy scalar, as the Python scalar it holds
        if d.scalar_ok(x.dtype, value) is not x.dtype:
            raise TypeError(f"cannot assign a Python {type(value).__name__} into a {x.dtype} array")
        value = V.literal(value, x.dtype)
        smask = 2
        if type(value) is complex:  # no complex literals on the wire
            value, smask = scalar_array(value, x.dtype, x), 0
    extra: list[int] = []
    enc = codec.encode_key(_wire_items(x.shape, items), extra, RemoteArray)
    new = emit("setitem", [x, value, *arrays], smask, {"key": enc}, x.shape, x.dtype)
    x._adopt(new)


def take(x: RemoteArray, indices: RemoteArray, /, *, axis: int | None = None) -> RemoteArray:
    if type(x) is not RemoteArray or type(indices) is not RemoteArray:
        raise TypeError("take expects ember arrays")
    same_device(x, indices)
    if indices.dtype not in d.INTEGER:
        raise TypeError(f"take: indices must have an integer dtype, got {indices.dtype}")
    if indices.ndim != 1:
        raise ValueError(f"take: indices must be one-dimensional, got {indices.ndim} dims")
    if axis is None:
        if x.ndim != 1:
            raise ValueError("take: axis is required for arrays of more than one dim")
        axis = 0
    a = V.axes("axis", V.integer("axis", axis), x.ndim)[0]
    shape = x.shape[:a] + indices.shape + x.shape[a + 1:]
    return emit("take", [x, indices], 0, {"axis": a}, shape, x.dtype)


def take_along_axis(x: RemoteArray, indices: RemoteArray, /, *, axis: int = -1) -> RemoteArray:
    if type(x) is not RemoteArray or type(indices) is not RemoteArray:
        raise TypeError("take_along_axis expects ember arrays")
    same_device(x, indices)
    if indices.dtype not in d.INTEGER:
        raise TypeError(f"take_along_axis: indices must have an integer dtype, got {indices.dtype}")
    if indices.ndim != x.ndim or x.ndim == 0:
        raise ValueError(f"take_along_axis: x and indices need the same number (>= 1) of dims, "
                         f"got {x.ndim} and {indices.ndim}")
    a = V.axes("axis", V.integer("axis", axis), x.ndim)[0]
    rest = broadcast_shapes(x.shape[:a] + x.shape[a + 1:], indices.shape[:a] + indices.shape[a + 1:])
    shape = rest[:a] + (indices.shape[a],) + rest[a:]
    return emit("take_along_axis", [x, indices], 0, {"axis": a}, shape, x.dtype)


# ``x[key]`` / ``x[key] = v`` call these directly (no per-call import in RemoteArray's methods).
RemoteArray.__getitem__ = getitem  # type: ignore[method-assign]
RemoteArray.__setitem__ = setitem  # type: ignore[method-assign]
