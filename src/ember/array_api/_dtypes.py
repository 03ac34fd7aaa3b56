"""The standard's dtypes and its type-promotion table, precomputed at import."""

from __future__ import annotations

from typing import Any

import numpy as np


class DType:
    """An Array API dtype. Singletons: compare with ``==`` or ``is``."""

    __slots__ = ("name", "kind", "itemsize", "np")

    def __init__(self, name: str, kind: str) -> None:
        self.name = name
        self.kind = kind                   # "b" bool, "i" signed, "u" unsigned, "f" real float, "c" complex
        self.np = np.dtype(name)
        self.itemsize = self.np.itemsize

    def __repr__(self) -> str:
        return f"ember.{self.name}"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return self is other

    __hash__ = object.__hash__  # singletons compared by identity: a C-level hash keeps set lookups cheap

    def __reduce__(self) -> Any:
        return (from_name, (self.name,))


bool = DType("bool", "b")  # noqa: A001 - the standard's name
int8, int16, int32, int64 = (DType(n, "i") for n in ("int8", "int16", "int32", "int64"))
uint8, uint16, uint32, uint64 = (DType(n, "u") for n in ("uint8", "uint16", "uint32", "uint64"))
float32, float64 = DType("float32", "f"), DType("float64", "f")
complex64, complex128 = DType("complex64", "c"), DType("complex128", "c")

ALL = (bool, int8, int16, int32, int64, uint8, uint16, uint32, uint64, float32, float64, complex64, complex128)
BY_NAME = {d.name: d for d in ALL}
INTEGER = frozenset(d for d in ALL if d.kind in "iu")
REAL_FLOAT = frozenset((float32, float64))
COMPLEX = frozenset((complex64, complex128))
FLOAT = REAL_FLOAT | COMPLEX
NUMERIC = INTEGER | FLOAT
REAL_NUMERIC = INTEGER | REAL_FLOAT
BOOL = frozenset((bool,))
ANY = frozenset(ALL)

DEFAULT_FLOAT, DEFAULT_INT, DEFAULT_COMPLEX, DEFAULT_INDEX = float64, int64, complex128, int64

CATEGORIES = {"any": ANY, "bool": BOOL, "integer": INTEGER, "integer_or_bool": INTEGER | BOOL,
              "numeric": NUMERIC, "real numeric": REAL_NUMERIC, "floating-point": FLOAT,
              "real floating-point": REAL_FLOAT, "complex floating-point": COMPLEX}


def from_name(name: str) -> DType:
    return BY_NAME[name]


def _group(d: DType) -> str:
    return "b" if d.kind == "b" else ("int" if d.kind in "iu" else "float")


def _build_promotion() -> dict[tuple[DType, DType], DType]:
    table: dict[tuple[DType, DType], DType] = {}
    for a in ALL:
        for b in ALL:
            if _group(a) != _group(b):
                continue  # the standard defines no promotion across kinds
            if {a.kind, b.kind} == {"i", "u"} and uint64 in (a, b):
                continue  # uint64 with a signed int has no standard result
            table[a, b] = BY_NAME[np.promote_types(a.np, b.np).name]
    return table


PROMOTION = _build_promotion()


def promote(a: DType, b: DType) -> DType:
    try:
        return PROMOTION[a, b]
    except KeyError:
        raise TypeError(f"{a} and {b} cannot be promoted together (the Array API standard defines no "
                        f"promotion between these kinds); convert one with astype first") from None


def scalar_ok(dt: DType, value: Any) -> DType:
    """Check a Python scalar may combine with an array of dtype ``dt``; return the result dtype.

    The standard's rules: bool with bool arrays, int with numeric arrays (within an integer
    dtype's range), float with floating arrays, complex with floating arrays (a real array
    becomes complex).
    """
    t = type(value)
    k = dt.kind
    if t is float:
        if k in "fc":
            return dt
    elif t is int:
        if k in "fc":
            return dt
        if k in "iu":
            lo, hi = INT_RANGE[dt]
            if not lo <= value <= hi:
                raise OverflowError(f"Python int {value} is out of range for {dt}")
            return dt
    elif t is builtins_bool:
        if k == "b":
            return dt
    elif t is complex:
        if k == "c":
            return dt
        if k == "f":
            return complex64 if dt is float32 else complex128
    else:
        raise TypeError(f"unsupported operand type {t.__name__} for an array of {dt}")
    raise TypeError(f"a Python {t.__name__} cannot be combined with an array of {dt} under the Array API "
                    f"standard; use an array of the intended dtype or astype first")


INT_RANGE = {d: (int(np.iinfo(d.np).min), int(np.iinfo(d.np).max)) for d in ALL if d.kind in "iu"}


import builtins  # noqa: E402

builtins_bool = builtins.bool


def to_dtype(d: Any) -> DType:
    """Accept an Ember dtype, a NumPy dtype, or a dtype name."""
    if isinstance(d, DType):
        return d
    try:
        return BY_NAME[np.dtype(d).name]
    except (TypeError, KeyError):
        raise TypeError(f"{d!r} is not a dtype of the Array API standard") from None
