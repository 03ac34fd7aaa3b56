"""Output sizes the server can predict before an op runs (to charge memory first).

The client computes every output's shape, but a hostile client may lie, so the
server predicts for itself where that is cheap: creation functions from their
shape / count arguments, and every op whose output can be much larger than its
inputs (broadcasting, ``matmul``, ``tensordot``, ``outer``, ``tile``,
``repeat``, ``take``, indexing with arrays, ``meshgrid``, ``concat``,
``nonzero``, FFTs with ``n=`` / ``s=``, full SVD / QR, and any op materialising
a broadcast view). :func:`predict` returns an upper bound in bytes (0 when it
cannot tell: the op then raises on its own, or is charged after it ran); the
interpreter reserves it only when it exceeds what the op's inputs already hold
(see :mod:`ember.server.guard.memory`). Every predictor is bounded by the message's
own size and never raises.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from ...errors import LimitExceeded, ProtocolError
from ...protocol import aten
from ...protocol import messages as m
from ...protocol import ops
from ...protocol.codec import safe_repr

#: Outputs smaller than this are never reserved (charged right after the op instead).
THRESHOLD = 1 << 20

_HUGE = 1 << 80  # "more than any budget": products stop growing here

ITEMSIZE = {"bool": 1, "int8": 1, "uint8": 1, "int16": 2, "uint16": 2, "int32": 4, "uint32": 4,
            "int64": 8, "uint64": 8, "float16": 2, "float32": 4, "float64": 8, "complex64": 8,
            "complex128": 16}

#: Elementwise ops that give floats even for integer inputs in some backends (NumPy: int8 / int8 -> float64).
_FLOATING = frozenset("""acos acosh asin asinh atan atan2 atanh cos cosh divide exp expm1 hypot log log1p
log2 log10 logaddexp sin sinh sqrt tan tanh""".split())


def _prod(shape: Any) -> int:
    n = 1
    for d in shape:
        if type(d) is not int or d < 0:
            raise ValueError("not a shape")
        n *= d
        if n > _HUGE:
            return _HUGE
    return n


def _isz(dt: Any) -> int:
    if isinstance(dt, str):
        return ITEMSIZE.get(dt, 16)
    n = getattr(dt, "itemsize", None)
    if type(n) is int:
        return n
    name = str(dt).rsplit(".", 1)[-1].strip("'>")
    return ITEMSIZE.get(name, 16)


def _arrays(vals: Sequence[Any]) -> list[Any]:
    return [v for v in vals if getattr(v, "shape", None) is not None]


def _broadcast(shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    n = max((len(s) for s in shapes), default=0)
    out = []
    for i in range(-n, 0):
        dim = 1
        for s in shapes:
            if len(s) >= -i and s[i] != 1:
                dim = s[i]
        out.append(dim)
    return tuple(out)


def _kw_isz(kw: dict[str, Any], default: int) -> int:
    dt = kw.get("dtype")
    return default if dt is None else _isz(dt)


# ---- predictors: (vals, kwargs, xp) -> bytes --------------------------------------------

def _elementwise_for(name: str) -> Callable[..., int]:
    floating = name in _FLOATING

    def f(vals: Sequence[Any], kw: dict[str, Any], xp: Any) -> int:
        arrays = _arrays(vals)
        if not arrays:
            return 0
        isz = max(_isz(a.dtype) for a in arrays)
        if floating and isz < 8:
            isz = 8
        shape = arrays[0].shape
        if any(a.shape != shape for a in arrays[1:]):
            shape = _broadcast([tuple(a.shape) for a in arrays])
        return _prod(shape) * isz
    return f


def _creation(vals: Sequence[Any], kw: dict[str, Any], xp: Any) -> int:
    return _prod(kw["shape"]) * _kw_isz(kw, 8)


def _arange(vals: Sequence[Any], kw: dict[str, Any], xp: Any) -> int:
    start, stop, step = (float(v) for v in vals[:3])
    count = (stop - start) / step if step else 0.0
    n = max(int(min(count, 2.0 ** 80)) + 1, int(kw.get("num", 0)), 0)
    return n * _kw_isz(kw, 8)


def _linspace(vals: Sequence[Any], kw: dict[str, Any], xp: Any) -> int:
    return int(kw["num"]) * _kw_isz(kw, 8)


def _eye(vals: Sequence[Any], kw: dict[str, Any], xp: Any) -> int:
    n, k = vals[0], vals[1] if len(vals) > 1 and vals[1] is not None else vals[0]
    return _prod([n, k]) * _kw_isz(kw, 8)


def _freq(vals: Sequence[Any], kw: dict[str, Any], xp: Any) -> int:
    return _prod([vals[0]]) * _kw_isz(kw, 8)


def _like(vals: Sequence[Any], kw: dict[str, Any], xp: Any) -> int:
    x = vals[0]
    return _prod(x.shape) * _kw_isz(kw, _isz(x.dtype))


def _same(vals: Sequence[Any], kw: dict[str, Any], xp: Any) -> int:
    """A new array of the input's (nominal) size: copies, and materialising a broadcast view."""
    x = vals[0]
    return _prod(x.shape) * _isz(x.dtype)


def _matmul(vals: Sequence[Any], kw: dict[str, Any], xp: Any) -> int:
    a, b = vals[0].shape, vals[1].shape
    n = a[-2] if len(a) >= 2 else 1
    k = b[-1] if len(b) >= 2 else 1
    batch = _broadcast([tuple(a[:-2]), tuple(b[:-2])])
    return _prod(batch) * n * k * max(_isz(vals[0].dtype), _isz(vals[1].dtype))


def _tensordot(vals: Sequence[Any], kw: dict[str, Any], xp: Any) -> int:
    a, b = tuple(vals[0].shape), tuple(vals[1].shape)
    axes = kw.get("axes", 2)
    if type(axes) is int:
        shape = a[:len(a) - axes] + b[axes:]
    else:
        a1, a2 = {i % len(a) for i in axes[0]}, {i % len(b) for i in axes[1]}
        shape = tuple(n for i, n in enumerate(a) if i not in a1) + tuple(n for i, n in enumerate(b) if i not in a2)
    return _prod(shape) * max(_isz(vals[0].dtype), _isz(vals[1].dtype))


def _outer(vals: Sequence[Any], kw: dict[str, Any], xp: Any) -> int:
    return _prod(vals[0].shape) * _prod(vals[1].shape) * max(_isz(vals[0].dtype), _isz(vals[1].dtype))


def _tile(vals: Sequence[Any], kw: dict[str, Any], xp: Any) -> int:
    x = vals[0]
    return _prod(x.shape) * _prod(vals[1]) * _isz(x.dtype)


def _repeat(vals: Sequence[Any], kw: dict[str, Any], xp: Any) -> int:
    x, r = vals[0], vals[1]
    axis = kw.get("axis")
    size = _prod(x.shape)
    if getattr(r, "shape", None) is not None:
        total = int(r.sum()) if _prod(r.shape) > 1 else int(r.reshape(-1)[0]) * (
            size if axis is None else x.shape[axis])
    else:
        total = int(r) * (size if axis is None else x.shape[axis])
    per = 1 if axis is None else size // max(x.shape[axis], 1)
    return max(total, 0) * per * _isz(x.dtype)


def _take(vals: Sequence[Any], kw: dict[str, Any], xp: Any) -> int:
    x, idx = vals[0], vals[1]
    axis = kw.get("axis")
    per = 1 if axis is None else _prod(x.shape) // max(x.shape[axis], 1)
    return _prod(idx.shape) * per * _isz(x.dtype)


def _meshgrid(vals: Sequence[Any], kw: dict[str, Any], xp: Any) -> int:
    arrays = _arrays(vals)
    return len(arrays) * _prod([_prod(a.shape) for a in arrays]) * max((_isz(a.dtype) for a in arrays), default=8)


def _joined(vals: Sequence[Any], kw: dict[str, Any], xp: Any) -> int:
    arrays = _arrays(vals)
    return sum(_prod(a.shape) for a in arrays) * max((_isz(a.dtype) for a in arrays), default=8)


def _nonzero(vals: Sequence[Any], kw: dict[str, Any], xp: Any) -> int:
    x = vals[0]
    return int(xp.count_nonzero(x)) * max(len(x.shape), 1) * 8


def _indices(vals: Sequence[Any], kw: dict[str, Any], xp: Any) -> int:
    """argsort, unique_*: int64 indices as long as the input (plus the values)."""
    x = vals[0]
    return _prod(x.shape) * (8 + _isz(x.dtype))


def _searchsorted(vals: Sequence[Any], kw: dict[str, Any], xp: Any) -> int:
    return _prod(vals[1].shape) * 8


def _getitem(vals: Sequence[Any], kw: dict[str, Any], xp: Any) -> int:
    """x[key] with index arrays: (elements left after the indexed dims) x (broadcast index shape)."""
    x, arrays, key = vals[0], list(vals[1:]), kw["key"]
    if not any(type(k) is list and k and k[0] == m.KEY_ARRAY for k in key):
        return 0  # basic indexing: a view
    ndim = len(x.shape)
    used = 0
    for k in key:
        if type(k) is list and k and k[0] == m.KEY_ARRAY and "bool" in str(arrays[k[1]].dtype):
            used += len(arrays[k[1]].shape)
        elif not (type(k) is list and k and k[0] in (m.KEY_NONE, m.KEY_ELLIPSIS)):
            used += 1
    dim, indexed, shapes = 0, 1, []
    for k in key:
        if type(k) is list and k and k[0] == m.KEY_ELLIPSIS:
            dim += max(ndim - used, 0)
        elif type(k) is list and k and k[0] == m.KEY_NONE:
            continue
        elif type(k) is list and k and k[0] == m.KEY_ARRAY:
            a = arrays[k[1]]
            if "bool" in str(a.dtype):
                dim += len(a.shape)
            else:
                indexed *= x.shape[dim] if dim < ndim else 1
                shapes.append(tuple(a.shape))
                dim += 1
        else:
            dim += 1
    if not shapes:
        return _prod(x.shape) * _isz(x.dtype)  # boolean masks: at most the input
    return _prod(x.shape) // max(indexed, 1) * _prod(_broadcast(shapes)) * _isz(x.dtype)


def _svd(vals: Sequence[Any], kw: dict[str, Any], xp: Any) -> int:
    x = vals[0]
    *batch, rows, cols = x.shape
    k = min(rows, cols)
    full = kw.get("full_matrices", True)
    per = rows * rows + cols * cols + k if full else rows * k + k * cols + k
    return _prod(batch) * per * _isz(x.dtype)


def _qr(vals: Sequence[Any], kw: dict[str, Any], xp: Any) -> int:
    x = vals[0]
    *batch, rows, cols = x.shape
    k = min(rows, cols)
    per = rows * rows + rows * cols if kw.get("mode") == "complete" else rows * k + k * cols
    return _prod(batch) * per * _isz(x.dtype)


def _fft1(vals: Sequence[Any], kw: dict[str, Any], xp: Any) -> int:
    x = vals[0]
    shape = list(x.shape)
    axis = kw.get("axis", -1)
    n = kw.get("n")
    if n is not None and shape:
        shape[axis] = n
    elif shape:
        shape[axis] = 2 * shape[axis]  # irfft / hfft default: 2 (m - 1) points
    return _prod(shape) * min(2 * _isz(x.dtype), 16)


def _fftn(vals: Sequence[Any], kw: dict[str, Any], xp: Any) -> int:
    x = vals[0]
    shape = list(x.shape)
    s, axes = kw.get("s"), kw.get("axes")
    if s is not None:
        for a, v in zip(axes if axes is not None else range(len(shape) - len(s), len(shape)), s):
            shape[a] = v
    elif shape:
        shape[-1] = 2 * shape[-1]
    return _prod(shape) * min(2 * _isz(x.dtype), 16)


def custom_outputs(specs: Any) -> int:
    """A custom op's declared outputs ``[[shape, dtype], ...]`` in bytes (0 if malformed)."""
    try:
        return sum(_prod(shape) * _isz(str(dtype)) for shape, dtype in specs)
    except Exception:  # noqa: BLE001 - malformed specs fail the op on their own
        return 0


def declared_outputs(kwargs: Any) -> int:
    """Bytes of the fresh outputs an ATen call's client declares (``kwargs["o"]``, see
    :mod:`ember.protocol.aten`): the peer stores them in storages of that size. 0 if none or malformed."""
    try:
        n = sum(s[5] for s in kwargs["o"] if type(s[5]) is int and s[5] > 0)
    except Exception:  # noqa: BLE001 - no specs (data-dependent outputs) or malformed: the op says what is wrong
        return 0
    return n if n >= THRESHOLD else 0


#: ATen ops whose kernels materialise their operands' broadcast while they run, whatever they return: a loss of an
#: ``(n, 1)`` input and a ``(1, n)`` target holds ``n * n`` elements and returns one. The value: how many broadcasts
#: (at the widest operand's itemsize) a call holds at most, measured on CPU torch 2.13 (``masked_select``: its mask
#: expanded, its indices and its result).
BROADCAST_INSIDE = {"mse_loss": 2, "mse_loss_backward": 2, "smooth_l1_loss": 2, "smooth_l1_loss_backward": 2,
                    "huber_loss": 2, "huber_loss_backward": 2, "soft_margin_loss": 2, "soft_margin_loss_backward": 2,
                    "binary_cross_entropy": 2, "binary_cross_entropy_backward": 2,
                    "binary_cross_entropy_with_logits": 2, "dist": 2, "masked_select": 6}


def inside_broadcast(name: str, kwargs: Any) -> int:
    """Bytes an ATen call of :data:`BROADCAST_INSIDE` holds while it runs, beyond its operands and declared outputs
    (0 for any other call, or operands that do not broadcast past the largest of them): charged before it runs,
    as its declared outputs are, so that a small message cannot make the peer allocate past the session's budget."""
    k = BROADCAST_INSIDE.get(name[5:name.find(".", 5)])
    if k is None:
        return 0
    try:
        lays = kwargs["l"]
        n = aten.broadcast_numel(lays)
        if n <= max(_prod(lay[0]) for lay in lays):
            return 0
        need = k * n * max(ITEMSIZE.get(lay[3], 16) for lay in lays)
    except Exception:  # noqa: BLE001 - malformed layouts: the kernel's own checks refuse the call
        return 0
    return need if need >= THRESHOLD else 0


def expanded(kwargs: Any, vals: list[Any]) -> int:
    """Bytes an ATen call's operands describe beyond the storages they view (a stride-0 layout of 2^28 floats over
    4 bytes): kernels that copy or sort an operand, or take a temporary of its size (``median``, ``mm``, ``unique``,
    ``count_nonzero``...), hold what it describes. Charged while the call runs (0 under :data:`THRESHOLD`)."""
    try:
        extra = 0
        for lay, buf in zip(kwargs["l"], vals):
            n = _prod(lay[0]) * ITEMSIZE.get(lay[3], 16) - getattr(buf, "nbytes", 0)
            if n > 0:
                extra += n
    except Exception:  # noqa: BLE001 - malformed layouts: the kernel's own checks refuse the call
        return 0
    return extra if extra >= THRESHOLD else 0


PREDICTORS: dict[str, Callable[..., int]] = {name: _elementwise_for(name) for name in ops.ELEMENTWISE}
PREDICTORS.update({
    "where": _elementwise_for("where"),
    "take_along_axis": _elementwise_for("take_along_axis"), "linalg.cross": _elementwise_for("cross"),
    "vecdot": _elementwise_for("vecdot"), "linalg.vecdot": _elementwise_for("vecdot"),
    "zeros": _creation, "ones": _creation, "empty": _creation, "full": _creation,
    "arange": _arange, "linspace": _linspace, "eye": _eye, "fft.fftfreq": _freq, "fft.rfftfreq": _freq,
    "zeros_like": _like, "ones_like": _like, "empty_like": _like, "full_like": _like, "astype": _like,
    "copy": _same, "setitem": _same, "reshape": _same, "tril": _same, "triu": _same, "roll": _same,
    "sort": _same, "cumulative_sum": _same, "cumulative_prod": _same,
    "matmul": _matmul, "linalg.matmul": _matmul, "tensordot": _tensordot, "linalg.tensordot": _tensordot,
    "linalg.outer": _outer, "tile": _tile, "repeat": _repeat, "take": _take, "meshgrid": _meshgrid,
    "concat": _joined, "stack": _joined, "nonzero": _nonzero, "argsort": _indices,
    "unique_all": _indices, "unique_inverse": _indices, "unique_counts": _indices, "unique_values": _indices,
    "searchsorted": _searchsorted, "getitem": _getitem, "linalg.svd": _svd, "linalg.qr": _qr,
    "linalg.eigh": _same, "linalg.inv": _same, "linalg.pinv": _same, "linalg.cholesky": _same,
    "linalg.matrix_power": _same, "linalg.solve": _elementwise_for("solve"),
})
PREDICTORS.update({  # ember.torch's own ops on torch devices (server/execute/aten.py): storages of n bytes
    "torch.alloc": lambda vals, kw, xp: int(kw["n"]), "torch.storage_of": _same})
for _name in ("fft", "ifft", "rfft", "irfft", "hfft", "ihfft"):
    PREDICTORS["fft." + _name] = _fft1
for _name in ("fftn", "ifftn", "rfftn", "irfftn"):
    PREDICTORS["fft." + _name] = _fftn


def upload_fault(backend: Any, dtype: Any, shape: Any, offset: Any, data: Any, total: Any,
                  max_tensor: int, n: int | None = None) -> Exception | None:
    """Why an Upload chunk's fields are unacceptable (None when they are fine); ``n``: the
    chunk's length when its bytes are not in ``data`` (a data frame's payload)."""
    if n is None:
        n = len(data) if isinstance(data, (bytes, bytearray, memoryview)) else -1
    if type(total) is not int or total < 0 or type(offset) is not int or offset < 0 or n < 0 \
            or offset + n > total:
        return ProtocolError(f"malformed Upload: offset {safe_repr(offset)} + {n if n >= 0 else '?'} bytes of "
                             f"data do not fit the declared total {safe_repr(total)}")
    if total > max_tensor:
        return LimitExceeded(f"upload of {total} bytes exceeds this peer's max_tensor of {max_tensor} bytes")
    if not isinstance(dtype, str) or dtype not in backend.dtypes:
        return ProtocolError(f"Upload dtype {safe_repr(dtype)} is not one of this device's dtypes "
                             f"({', '.join(backend.dtypes)})")
    if not isinstance(shape, list) or len(shape) > 64 or any(type(d) is not int or d < 0 for d in shape):
        return ProtocolError(f"Upload shape {safe_repr(shape)} is not a list of non-negative ints")
    n = 0 if 0 in shape else np.dtype(dtype).itemsize
    for d in shape:
        n *= d
        if n > total:  # (stops a product of 64 huge dims from growing without bound)
            break
    if n != total:
        return ProtocolError(f"Upload declares {total} bytes for shape {tuple(shape)} {dtype}")
    return None


PREDICTED = frozenset(PREDICTORS)
"""Ops :func:`predict` knows (the interpreter asks only for these)."""


def predict(name: str, vals: Sequence[Any], kwargs: dict[str, Any] | None, xp: Any) -> int:
    """Upper bound of the bytes op ``name`` allocates for its outputs; 0 when unknown or small."""
    f = PREDICTORS.get(name)
    if f is None:
        return 0
    try:
        n = f(vals, kwargs or {}, xp)
    except Exception:  # noqa: BLE001 - malformed arguments: the op itself will say what is wrong
        return 0
    return n if n >= THRESHOLD else 0


__all__ = ["predict", "upload_fault", "custom_outputs", "declared_outputs", "inside_broadcast", "expanded",
           "BROADCAST_INSIDE", "PREDICTORS", "PREDICTED", "THRESHOLD", "ITEMSIZE"]
