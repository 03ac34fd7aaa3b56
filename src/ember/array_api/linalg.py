"""The ``linalg`` extension of the Array API standard (``xp.linalg``).

Every function computes its result shapes and dtypes here; ops travel as ``linalg.<name>``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from . import _dtypes as d
from . import _validate as V
from ._array import RemoteArray, broadcast_shapes, emit, emit_multi, real_dtype, same_device
from ._linalg import matmul, matrix_transpose, tensordot, vecdot
from ._statistical import accumulate_dtype, normalize_axis, reduced_shape

__all__ = ["cholesky", "cross", "det", "diagonal", "eig", "eigh", "eigvals", "eigvalsh", "inv", "matmul", "matrix_norm",
           "matrix_power", "matrix_rank", "matrix_transpose", "outer", "pinv", "qr", "slogdet", "solve", "svd",
           "svdvals", "tensordot", "trace", "vecdot", "vector_norm"]


class EigResult(NamedTuple):
    eigenvalues: RemoteArray
    eigenvectors: RemoteArray


class EighResult(NamedTuple):
    eigenvalues: RemoteArray
    eigenvectors: RemoteArray


class QRResult(NamedTuple):
    Q: RemoteArray
    R: RemoteArray


class SlogdetResult(NamedTuple):
    sign: RemoteArray
    logabsdet: RemoteArray


class SVDResult(NamedTuple):
    U: RemoteArray
    S: RemoteArray
    Vh: RemoteArray


def _arr(name: str, x: Any, allowed: frozenset[d.DType] = d.FLOAT, min_ndim: int = 2) -> RemoteArray:
    if type(x) is not RemoteArray:
        raise TypeError(f"linalg.{name} expects an ember array, got {type(x).__name__}")
    if x.dtype not in allowed:
        raise TypeError(f"linalg.{name} does not accept {x.dtype} inputs")
    if x.ndim < min_ndim:
        raise ValueError(f"linalg.{name} needs at least {min_ndim} dims, got {x.ndim}")
    return x


def _square(name: str, x: Any) -> RemoteArray:
    _arr(name, x)
    if x.shape[-1] != x.shape[-2]:
        raise ValueError(f"linalg.{name} needs square matrices, got shape {x.shape}")
    return x


def _op(name: str, x: RemoteArray, shape: tuple[int, ...], dt: d.DType, **kw: Any) -> RemoteArray:
    return emit("linalg." + name, [x], 0, kw or None, shape, dt)


def cholesky(x: RemoteArray, /, *, upper: bool = False) -> RemoteArray:
    return _op("cholesky", _square("cholesky", x), x.shape, x.dtype, upper=V.flag("upper", upper))


def cross(x1: RemoteArray, x2: RemoteArray, /, *, axis: int = -1) -> RemoteArray:
    _arr("cross", x1, d.NUMERIC, 1), _arr("cross", x2, d.NUMERIC, 1)
    same_device(x1, x2)
    dt = d.promote(x1.dtype, x2.dtype)
    axis = V.integer("axis", axis)
    if not min(-1, -x1.ndim, -x2.ndim) <= axis < 0:
        raise ValueError(f"linalg.cross: axis must be negative and within both arrays' dims, got {axis}")
    if x1.shape[axis] != 3 or x2.shape[axis] != 3:
        raise ValueError("linalg.cross: the axis must have size 3 in both arrays")
    return emit("linalg.cross", [x1, x2], 0, {"axis": axis}, broadcast_shapes(x1.shape, x2.shape), dt)


def det(x: RemoteArray, /) -> RemoteArray:
    return _op("det", _square("det", x), x.shape[:-2], x.dtype)


def diagonal(x: RemoteArray, /, *, offset: int = 0) -> RemoteArray:
    _arr("diagonal", x, d.ANY)
    m, n = x.shape[-2:]
    offset = V.clamp(V.integer("offset", offset), -m, n)  # beyond the matrix: an empty diagonal either way
    k = max(0, min(m, n - offset) if offset >= 0 else min(m + offset, n))
    return _op("diagonal", x, x.shape[:-2] + (k,), x.dtype, offset=offset)


def _complex_of(dt: d.DType) -> d.DType:
    return d.complex64 if dt in (d.float32, d.complex64) else d.complex128


def eig(x: RemoteArray, /) -> EigResult:
    """Eigenvalues and eigenvectors of a general square matrix (2025.12): complex, whatever x's dtype."""
    _square("eig", x)
    c = _complex_of(x.dtype)
    return EigResult(*emit_multi("linalg.eig", [x], None, [(x.shape[:-1], c), (x.shape, c)]))


def eigvals(x: RemoteArray, /) -> RemoteArray:
    """Eigenvalues of a general square matrix (2025.12): complex, whatever x's dtype."""
    return _op("eigvals", _square("eigvals", x), x.shape[:-1], _complex_of(x.dtype))


def eigh(x: RemoteArray, /) -> EighResult:
    _square("eigh", x)
    specs = [(x.shape[:-1], real_dtype(x.dtype)), (x.shape, x.dtype)]
    return EighResult(*emit_multi("linalg.eigh", [x], None, specs))


def eigvalsh(x: RemoteArray, /) -> RemoteArray:
    return _op("eigvalsh", _square("eigvalsh", x), x.shape[:-1], real_dtype(x.dtype))


def inv(x: RemoteArray, /) -> RemoteArray:
    return _op("inv", _square("inv", x), x.shape, x.dtype)


_MATRIX_ORDS = (1, -1, 2, -2, float("inf"), float("-inf"))


def matrix_norm(x: RemoteArray, /, *, keepdims: bool = False, ord: int | float | str | None = "fro") -> RemoteArray:
    _arr("matrix_norm", x)
    keepdims = V.flag("keepdims", keepdims)
    if ord is None or isinstance(ord, str):
        ord = "fro" if ord is None else V.choice("ord", ord, ("fro", "nuc"))
    elif V.real("ord", ord) not in _MATRIX_ORDS:
        raise ValueError(f"linalg.matrix_norm: ord must be 'fro', 'nuc', ±1, ±2 or ±inf, got {ord!r}")
    shape = x.shape[:-2] + ((1, 1) if keepdims else ())
    return _op("matrix_norm", x, shape, real_dtype(x.dtype), keepdims=keepdims, ord=ord)


def matrix_power(x: RemoteArray, n: int, /) -> RemoteArray:
    _square("matrix_power", x)
    return emit("linalg.matrix_power", [x, V.integer("n", n)], 2, None, x.shape, x.dtype)


def _rtol(name: str, x: RemoteArray, rtol: Any) -> tuple[list[Any], int]:
    """``rtol`` travels as an array input or a scalar literal (bit 1 of smask)."""
    if type(rtol) is RemoteArray:
        same_device(x, rtol)
        if rtol.dtype not in d.REAL_FLOAT:
            raise TypeError(f"linalg.{name}: rtol must be a real floating-point array")
        return [x, rtol], 0
    if rtol is not None:
        rtol = V.real("rtol", rtol)
    return [x, rtol], 2


def matrix_rank(x: RemoteArray, /, *, rtol: float | RemoteArray | None = None) -> RemoteArray:
    args, smask = _rtol("matrix_rank", _arr("matrix_rank", x), rtol)
    return emit("linalg.matrix_rank", args, smask, None, x.shape[:-2], d.DEFAULT_INT)


def outer(x1: RemoteArray, x2: RemoteArray, /) -> RemoteArray:
    _arr("outer", x1, d.NUMERIC, 1), _arr("outer", x2, d.NUMERIC, 1)
    same_device(x1, x2)
    if x1.ndim != 1 or x2.ndim != 1:
        raise ValueError("linalg.outer needs one-dimensional arrays")
    return emit("linalg.outer", [x1, x2], 0, None, x1.shape + x2.shape, d.promote(x1.dtype, x2.dtype))


def pinv(x: RemoteArray, /, *, rtol: float | RemoteArray | None = None) -> RemoteArray:
    args, smask = _rtol("pinv", _arr("pinv", x), rtol)
    return emit("linalg.pinv", args, smask, None, x.shape[:-2] + x.shape[:-3:-1], x.dtype)


def qr(x: RemoteArray, /, *, mode: str = "reduced") -> QRResult:
    _arr("qr", x)
    V.choice("mode", mode, ("reduced", "complete"))
    m, n = x.shape[-2:]
    k = min(m, n) if mode == "reduced" else m
    b = x.shape[:-2]
    specs = [(b + (m, k), x.dtype), (b + (k, n), x.dtype)]
    return QRResult(*emit_multi("linalg.qr", [x], {"mode": mode}, specs))


def slogdet(x: RemoteArray, /) -> SlogdetResult:
    _square("slogdet", x)
    specs = [(x.shape[:-2], x.dtype), (x.shape[:-2], real_dtype(x.dtype))]
    return SlogdetResult(*emit_multi("linalg.slogdet", [x], None, specs))


def solve(x1: RemoteArray, x2: RemoteArray, /) -> RemoteArray:
    _square("solve", x1), _arr("solve", x2, d.FLOAT, 1)
    same_device(x1, x2)
    dt = d.promote(x1.dtype, x2.dtype)
    m = x1.shape[-1]
    if x2.ndim == 1:
        if x2.shape[0] != m:
            raise ValueError(f"linalg.solve: shapes {x1.shape} and {x2.shape} do not fit")
        shape = x1.shape[:-1]
    else:
        if x2.shape[-2] != m:
            raise ValueError(f"linalg.solve: shapes {x1.shape} and {x2.shape} do not fit")
        shape = broadcast_shapes(x1.shape[:-2], x2.shape[:-2]) + x2.shape[-2:]
    return emit("linalg.solve", [x1, x2], 0, None, shape, dt)


def svd(x: RemoteArray, /, *, full_matrices: bool = True) -> SVDResult:
    _arr("svd", x)
    m, n = x.shape[-2:]
    k = min(m, n)
    b = x.shape[:-2]
    u, v = (m, n) if full_matrices else (k, k)
    specs = [(b + (m, u), x.dtype), (b + (k,), real_dtype(x.dtype)), (b + (v, n), x.dtype)]
    return SVDResult(*emit_multi("linalg.svd", [x], {"full_matrices": V.flag("full_matrices", full_matrices)}, specs))


def svdvals(x: RemoteArray, /) -> RemoteArray:
    _arr("svdvals", x)
    return _op("svdvals", x, x.shape[:-2] + (min(x.shape[-2:]),), real_dtype(x.dtype))


def trace(x: RemoteArray, /, *, offset: int = 0, dtype: Any = None) -> RemoteArray:
    _arr("trace", x, d.NUMERIC)
    offset = V.clamp(V.integer("offset", offset), -x.shape[-2], x.shape[-1])  # beyond the matrix: 0 either way
    dt = accumulate_dtype(x, dtype)
    return _op("trace", x, x.shape[:-2], dt, offset=offset, dtype=dt.name)


def vector_norm(x: RemoteArray, /, *, axis: int | tuple[int, ...] | None = None, keepdims: bool = False,
                ord: int | float = 2) -> RemoteArray:
    _arr("vector_norm", x, d.FLOAT, 0)
    keepdims, ord = V.flag("keepdims", keepdims), V.real("ord", ord)
    axes = normalize_axis(axis, x.ndim)
    shape = reduced_shape(x.shape, axes, keepdims)
    wire = None if axis is None else list(axes)
    return _op("vector_norm", x, shape, real_dtype(x.dtype), axis=wire, keepdims=keepdims, ord=ord)
