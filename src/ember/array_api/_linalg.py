"""Linear algebra functions of the main namespace: matmul, matrix_transpose, tensordot, vecdot."""

from __future__ import annotations

from typing import Any, Sequence

from . import _dtypes as d
from . import _validate as V
from ._array import RemoteArray, broadcast_shapes, emit, same_device

__all__ = ["matmul", "matrix_transpose", "tensordot", "vecdot"]


def _pair(name: str, x1: Any, x2: Any) -> d.DType:
    """Check two same-device numeric arrays; return their promoted dtype."""
    if type(x1) is not RemoteArray or type(x2) is not RemoteArray:
        raise TypeError(f"{name} expects two ember arrays")
    same_device(x1, x2)
    if x1.dtype not in d.NUMERIC or x2.dtype not in d.NUMERIC:
        raise TypeError(f"{name} needs numeric arrays, got {x1.dtype} and {x2.dtype}")
    return d.promote(x1.dtype, x2.dtype)


def matmul_shape(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    if not a or not b:
        raise ValueError("matmul does not accept 0-d arrays")
    a2 = (1,) + a if len(a) == 1 else a
    b2 = b + (1,) if len(b) == 1 else b
    if a2[-1] != b2[-2]:
        raise ValueError(f"matmul: shapes {a} and {b} are not aligned ({a2[-1]} != {b2[-2]})")
    out = broadcast_shapes(a2[:-2], b2[:-2]) + (a2[-2], b2[-1])
    if len(a) == 1:
        out = out[:-2] + out[-1:]
    if len(b) == 1:
        out = out[:-1]
    return out


def matmul(x1: RemoteArray, x2: RemoteArray, /) -> RemoteArray:
    dt = _pair("matmul", x1, x2)
    return emit("matmul", [x1, x2], 0, None, matmul_shape(x1.shape, x2.shape), dt)


def matrix_transpose(x: RemoteArray, /) -> RemoteArray:
    if type(x) is not RemoteArray:
        raise TypeError(f"matrix_transpose expects an ember array, got {type(x).__name__}")
    if x.ndim < 2:
        raise ValueError(f"matrix_transpose needs at least 2 dims, got {x.ndim}")
    return emit("matrix_transpose", [x], 0, None, x.shape[:-2] + x.shape[:-3:-1], x.dtype)


def _tensordot_axes(s1: tuple[int, ...], s2: tuple[int, ...],
                    axes: int | tuple[Sequence[int], Sequence[int]]) -> tuple[list[int], list[int]]:
    if not isinstance(axes, (tuple, list)):
        axes = V.integer("axes", axes)
        if not 0 <= axes <= min(len(s1), len(s2)):
            raise ValueError(f"tensordot: axes={axes} does not fit shapes {s1} and {s2}")
        return list(range(len(s1) - axes, len(s1))), list(range(axes))
    if len(axes) != 2:
        raise ValueError(f"tensordot: axes must be an int or a pair of axis sequences, got {len(axes)} entries")
    a1, a2 = (list(V.integers(f"axes[{i}]", ax, limit=V.MAX_DIMS)) for i, ax in enumerate(axes))
    if len(a1) != len(a2):
        raise ValueError("tensordot: both axes sequences need the same length")
    for a, n in ((a1, len(s1)), (a2, len(s2))):
        if any(not -n <= i < n for i in a):
            raise ValueError(f"tensordot: axes {a} out of range for {n} dims")
    return [i % len(s1) for i in a1], [i % len(s2) for i in a2]


def tensordot(x1: RemoteArray, x2: RemoteArray, /, *,
              axes: int | tuple[Sequence[int], Sequence[int]] = 2) -> RemoteArray:
    dt = _pair("tensordot", x1, x2)
    a1, a2 = _tensordot_axes(x1.shape, x2.shape, axes)
    for i, j in zip(a1, a2):
        if x1.shape[i] != x2.shape[j]:
            raise ValueError(f"tensordot: contracted dims differ ({x1.shape[i]} != {x2.shape[j]})")
    shape = tuple(n for i, n in enumerate(x1.shape) if i not in a1) + \
        tuple(n for i, n in enumerate(x2.shape) if i not in a2)
    wire = axes if type(axes) is int else [a1, a2]
    return emit("tensordot", [x1, x2], 0, {"axes": wire}, shape, dt)


def vecdot(x1: RemoteArray, x2: RemoteArray, /, *, axis: int = -1) -> RemoteArray:
    dt = _pair("vecdot", x1, x2)
    axis = V.integer("axis", axis)
    n = max(x1.ndim, x2.ndim)
    if not -n <= axis < 0 and not (0 <= axis < min(x1.ndim, x2.ndim) and x1.ndim == x2.ndim):
        raise ValueError(f"vecdot: axis {axis} out of range (use a negative axis)")
    a = axis if axis < 0 else axis - n
    s1 = (1,) * (n - x1.ndim) + x1.shape
    s2 = (1,) * (n - x2.ndim) + x2.shape
    if s1[a] != s2[a]:
        raise ValueError(f"vecdot: sizes along axis {axis} differ ({s1[a]} != {s2[a]})")
    full = broadcast_shapes(s1, s2)
    shape = full[:n + a] + full[n + a + 1:]
    return emit("vecdot", [x1, x2], 0, {"axis": a}, shape, dt)


def _matmul_op(self: RemoteArray, other: Any) -> Any:
    return matmul(self, other) if type(other) is RemoteArray else NotImplemented


def _rmatmul_op(self: RemoteArray, other: Any) -> Any:
    return matmul(other, self) if type(other) is RemoteArray else NotImplemented


def _imatmul_op(self: RemoteArray, other: Any) -> RemoteArray:
    self._adopt(matmul(self, other))
    return self


RemoteArray.__matmul__ = _matmul_op  # type: ignore[attr-defined]
RemoteArray.__rmatmul__ = _rmatmul_op  # type: ignore[attr-defined]
RemoteArray.__imatmul__ = _imatmul_op  # type: ignore[attr-defined]
