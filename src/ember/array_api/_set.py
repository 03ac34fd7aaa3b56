"""Set functions: unique_all, unique_counts, unique_inverse, unique_values.

The number of unique values depends on the data: each costs one round trip (a SHAPE
request for the first output sizes every output).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from . import _dtypes as d
from ._array import RemoteArray, emit_dynamic, emit_dynamic_multi

__all__ = ["unique_all", "unique_counts", "unique_inverse", "unique_values"]

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
