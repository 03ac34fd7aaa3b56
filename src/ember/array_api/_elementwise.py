"""Elementwise functions: every name in ``_array.RULES``, one or two arguments."""

from __future__ import annotations

from typing import Any

from ._array import RULES, RemoteArray, binary, unary

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
