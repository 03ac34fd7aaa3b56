"""Data type functions: astype, can_cast, finfo, iinfo, isdtype, result_type."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _dtypes as d
from ._array import RemoteArray, emit, real_dtype
from ._device import check_dtype
from ._dtypes import DType, to_dtype

__all__ = ["astype", "can_cast", "finfo", "iinfo", "isdtype", "result_type"]


def astype(x: RemoteArray, dtype: Any, /, *, copy: bool = True, device: Any = None) -> RemoteArray:
    if type(x) is not RemoteArray:
        raise TypeError(f"astype expects an ember array, got {type(x).__name__}")
    dt = to_dtype(dtype)
    if device is not None and device is not x.device:
        x = x.to_device(device)
        copy = False  # the move made a new array already
    if dt is x.dtype and not copy:
        return x
    if x.dtype.kind == "c" and dt.kind != "c":
        raise TypeError(f"casting {x.dtype} to {dt} is not permitted by the standard; take real() or abs() first")
    check_dtype(x.device, dt)
    return emit("astype", [x], 0, {"dtype": dt.name}, x.shape, dt)


def can_cast(from_: DType | RemoteArray, to: DType, /) -> bool:
    f = from_.dtype if isinstance(from_, RemoteArray) else to_dtype(from_)
    t = to_dtype(to)
    return d.PROMOTION.get((f, t)) is t


@dataclass(frozen=True)
class finfo_object:
    bits: int
    eps: float
    max: float
    min: float
    smallest_normal: float
    dtype: DType


@dataclass(frozen=True)
class iinfo_object:
    bits: int
    max: int
    min: int
    dtype: DType


def finfo(type: DType | RemoteArray, /) -> finfo_object:
    dt = type.dtype if isinstance(type, RemoteArray) else to_dtype(type)
    if dt not in d.FLOAT:
        raise TypeError(f"finfo needs a floating-point dtype, got {dt}")
    f = np.finfo(dt.np)
    return finfo_object(int(f.bits), float(f.eps), float(f.max), float(f.min), float(f.smallest_normal),
                        real_dtype(dt))


def iinfo(type: DType | RemoteArray, /) -> iinfo_object:
    dt = type.dtype if isinstance(type, RemoteArray) else to_dtype(type)
    if dt not in d.INTEGER:
        raise TypeError(f"iinfo needs an integer dtype, got {dt}")
    i = np.iinfo(dt.np)
    return iinfo_object(int(i.bits), int(i.max), int(i.min), dt)


_KINDS = {"bool": d.BOOL, "signed integer": frozenset(x for x in d.ALL if x.kind == "i"),
          "unsigned integer": frozenset(x for x in d.ALL if x.kind == "u"), "integral": d.INTEGER,
          "real floating": d.REAL_FLOAT, "complex floating": d.COMPLEX, "numeric": d.NUMERIC}


def isdtype(dtype: DType, kind: Any) -> bool:
    dt = to_dtype(dtype)
    if isinstance(kind, tuple):
        return any(isdtype(dt, k) for k in kind)
    if isinstance(kind, str):
        if kind not in _KINDS:
            raise ValueError(f"unknown dtype kind {kind!r}")
        return dt in _KINDS[kind]
    return dt is to_dtype(kind)


def result_type(*arrays_and_dtypes: Any) -> DType:
    """Promote arrays, dtypes and (since 2024.12) Python scalars; at least one array or dtype."""
    out: DType | None = None
    scalars = []
    for a in arrays_and_dtypes:
        if type(a) in (bool, int, float, complex):
            scalars.append(a)
            continue
        t = a.dtype if isinstance(a, RemoteArray) else to_dtype(a)
        out = t if out is None else d.promote(out, t)
    if out is None:
        raise ValueError("result_type needs at least one array or dtype")
    for sc in scalars:
        out = d.scalar_ok(out, sc)
    return out
