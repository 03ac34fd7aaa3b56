"""Searching: where."""

from __future__ import annotations

from typing import Any

from . import _dtypes as d
from ._array import RemoteArray, broadcast_shapes, emit, same_device

__all__ = ["where"]


def where(condition: RemoteArray, x1: Any, x2: Any, /) -> RemoteArray:
    if condition.dtype is not d.bool:
        raise TypeError(f"where: condition must be bool, got {condition.dtype}")
    arrays = [a for a in (x1, x2) if isinstance(a, RemoteArray)]
    if not arrays:
        raise TypeError("where: at least one of x1, x2 must be an ember array")
    same_device(condition, *arrays)
    if len(arrays) == 2:
        dt = d.promote(x1.dtype, x2.dtype)
    else:
        dt = d.scalar_ok(arrays[0].dtype, x2 if arrays[0] is x1 else x1)
    smask = (0 if isinstance(x1, RemoteArray) else 2) | (0 if isinstance(x2, RemoteArray) else 4)
    shape = broadcast_shapes(condition.shape, *(a.shape for a in arrays))
    return emit("where", [condition, x1, x2], smask, None, shape, dt)
