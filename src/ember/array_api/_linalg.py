"""Linear algebra in the main namespace: matmul (more in the linalg extension)."""

from __future__ import annotations

from . import _dtypes as d
from ._array import RemoteArray, broadcast_shapes, emit, same_device

__all__ = ["matmul"]


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
    if type(x1) is not RemoteArray or type(x2) is not RemoteArray:
        raise TypeError("matmul expects two ember arrays")
    same_device(x1, x2)
    dt = d.promote(x1.dtype, x2.dtype)
    if dt not in d.NUMERIC:
        raise TypeError(f"matmul does not accept {dt} inputs")
    return emit("matmul", [x1, x2], 0, None, matmul_shape(x1.shape, x2.shape), dt)
