"""Elementwise functions: every name in ``_array.RULES``, one or two arguments."""

from __future__ import annotations

from typing import Any

from . import _dtypes as d
from ._validate import literal
from ._array import RULES, RemoteArray, binary, broadcast_shapes, emit, same_device, unary

UNARY = ("abs acos acosh asin asinh atan atanh bitwise_invert ceil conj cos cosh exp expm1 floor imag isfinite "
         "isinf isnan log log1p log2 log10 logical_not negative positive real reciprocal round sign signbit sin "
         "sinh square sqrt tan tanh trunc").split()
BINARY = sorted(set(RULES) - set(UNARY))


def _make_unary(name: str) -> Any:
    def f(x: RemoteArray, /) -> RemoteArray:
        return unary(name, x)
    f.__name__ = f.__qualname__ = name
    return f


def _make_binary(name: str) -> Any:
    def f(x1: Any, x2: Any, /) -> RemoteArray:
        out = binary(name, x1, x2)
        if out is NotImplemented:
            raise TypeError(f"{name}: unsupported operand types {type(x1).__name__} and {type(x2).__name__}")
        return out
    f.__name__ = f.__qualname__ = name
    return f


for _n in UNARY:
    globals()[_n] = _make_unary(_n)
for _n in BINARY:
    globals()[_n] = _make_binary(_n)

__all__ = UNARY + BINARY


def clip(x: RemoteArray, /, min: int | float | RemoteArray | None = None,
         max: int | float | RemoteArray | None = None) -> RemoteArray:
    """Clamp to [min, max]; the result keeps x's dtype and broadcasts with array bounds."""
    if type(x) is not RemoteArray:
        raise TypeError(f"clip expects an ember array, got {type(x).__name__}")
    if x.dtype not in d.REAL_NUMERIC:
        raise TypeError(f"clip does not accept {x.dtype} inputs")
    shapes = [x.shape]
    smask = 0
    bounds = []
    for i, b in enumerate((min, max), 1):
        if type(b) is RemoteArray:
            same_device(x, b)
            if b.dtype not in d.REAL_NUMERIC or (b.dtype.kind == "f") != (x.dtype.kind == "f"):
                raise TypeError(f"clip: bound of dtype {b.dtype} does not fit an array of {x.dtype}")
            shapes.append(b.shape)
        elif b is None:
            smask |= 1 << i
        elif type(b) in (int, float):
            if type(b) is float and x.dtype.kind != "f":
                raise TypeError("clip: float bounds need a floating-point array")
            if type(b) is int and x.dtype.kind in "iu":
                lo, hi = d.INT_RANGE[x.dtype]
                if b < lo if i == 2 else b > hi:
                    raise OverflowError(f"clip: bound {b} is out of range for {x.dtype}")
                b = None if (b <= lo if i == 1 else b >= hi) else b
            elif type(b) is int and x.dtype.kind == "f":
                b = literal(b, x.dtype)  # (an int beyond 64 bits travels as a float)
            smask |= 1 << i
        else:
            raise TypeError(f"clip: bounds must be None, int, float or ember arrays, got {type(b).__name__}")
        bounds.append(b)
    shape = broadcast_shapes(*shapes) if len(shapes) > 1 else x.shape
    return emit("clip", [x, *bounds], smask, None, shape, x.dtype)


__all__.append("clip")
