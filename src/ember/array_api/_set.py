"""Set functions: isin, unique_all, unique_counts, unique_inverse, unique_values.

The number of unique values depends on the data: each ``unique_*`` costs one round trip (a
SHAPE request for the first output sizes every output). ``isin`` has ``x1``'s shape: no round trip.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from . import _dtypes as d
from . import _validate as V
from ._array import RemoteArray, emit, emit_dynamic, emit_dynamic_multi, same_device

__all__ = ["isin", "unique_all", "unique_counts", "unique_inverse", "unique_values"]

_I = d.DEFAULT_INDEX


class UniqueAllResult(NamedTuple):
    values: RemoteArray
    indices: RemoteArray
    inverse_indices: RemoteArray
    counts: RemoteArray


class UniqueCountsResult(NamedTuple):
    values: RemoteArray
    counts: RemoteArray


class UniqueInverseResult(NamedTuple):
    values: RemoteArray
    inverse_indices: RemoteArray


def _arr(name: str, x: Any) -> RemoteArray:
    if type(x) is not RemoteArray:
        raise TypeError(f"{name} expects an ember array, got {type(x).__name__}")
    return x


def isin(x1: RemoteArray | int, x2: RemoteArray | int, /, *, invert: bool = False) -> RemoteArray:
    """Whether each element of ``x1`` is in ``x2`` (2025.12); bool, of ``x1``'s shape (0-d for a scalar x1).

    Integer arrays as the standard says, and real floating-point ones too; bool and complex are refused
    (PyTorch has no isin for them). A scalar follows the rules for mixing scalars and arrays.
    """
    a1, a2 = type(x1) is RemoteArray, type(x2) is RemoteArray
    if not (a1 or a2):
        raise TypeError(f"isin: at least one of x1 and x2 must be an ember array, got {type(x1).__name__} "
                        f"and {type(x2).__name__}")
    invert = V.flag("invert", invert)
    for v, is_arr, other in ((x1, a1, x2), (x2, a2, x1)):
        if is_arr:
            if v.dtype not in d.REAL_NUMERIC:
                raise TypeError(f"isin does not accept {v.dtype} inputs (integer or real floating-point only)")
        elif type(v) not in (int, float):
            raise TypeError(f"isin: x1 and x2 must be ember arrays, ints or floats, got {type(v).__name__}")
        else:
            d.scalar_ok(other.dtype, v)
    if not a1:
        x1 = V.literal(x1, x2.dtype)
    elif not a2:
        x2 = V.literal(x2, x1.dtype)
    if a1 and a2:
        same_device(x1, x2)
        d.promote(x1.dtype, x2.dtype)
    smask = (0 if a1 else 1) | (0 if a2 else 2)
    return emit("isin", [x1, x2], smask, {"invert": True} if invert else None, x1.shape if a1 else (), d.bool)


def unique_all(x: RemoteArray, /) -> UniqueAllResult:
    _arr("unique_all", x)
    return UniqueAllResult(*emit_dynamic_multi("unique_all", [x], None,
                                               [(None, x.dtype), (None, _I), (x.shape, _I), (None, _I)]))


def unique_counts(x: RemoteArray, /) -> UniqueCountsResult:
    _arr("unique_counts", x)
    return UniqueCountsResult(*emit_dynamic_multi("unique_counts", [x], None, [(None, x.dtype), (None, _I)]))


def unique_inverse(x: RemoteArray, /) -> UniqueInverseResult:
    _arr("unique_inverse", x)
    return UniqueInverseResult(*emit_dynamic_multi("unique_inverse", [x], None, [(None, x.dtype), (x.shape, _I)]))


def unique_values(x: RemoteArray, /) -> RemoteArray:
    return emit_dynamic("unique_values", [_arr("unique_values", x)], None, x.dtype)
