"""The standard's special cases (2025.12 text) for the functions whose NumPy results leak through.

Each reference returns, for one element, the value the standard specifies, or None where the
standard lists no special case (there the oracle's result stands). Complex results come as
``(real, imag, imag_sign_specified, real_sign_specified)``; the conformance tests compare NaN
positions and infinities exactly and zero signs where the standard fixes them.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

inf, nan = math.inf, math.nan

#: Values that exercise every special case: signed zeros, finite of both signs, infinities, NaN.
REALS = [0.0, -0.0, 1.5, -1.5, 2.0, -2.0, inf, -inf, nan]


def floor_divide(x1: float, x2: float) -> float | None:
    """``x1 // x2`` for real floating-point operands, where a special case applies."""
    if math.isnan(x1) or math.isnan(x2):
        return nan
    if math.isinf(x1) and math.isinf(x2):
        return nan
    if x1 == 0 and x2 == 0:
        return nan
    sign = math.copysign(1.0, x1) * math.copysign(1.0, x2)
    if x1 == 0:  # +-0 over a nonzero divisor (finite or infinite)
        return math.copysign(0.0, sign)
    if x2 == 0:  # nonzero over +-0
        return math.copysign(inf, sign)
    if math.isinf(x1):  # +-inf over a nonzero finite divisor
        return math.copysign(inf, sign)
    if math.isinf(x2):  # nonzero finite over +-inf
        return math.copysign(0.0, sign)
    return None


Complex = tuple[float, float, bool, bool]


def _c(re: float, im: float, im_sign: bool = True, re_sign: bool = True) -> Complex:
    return (re, im, im_sign, re_sign)


def _conj(r: Complex | None) -> Complex | None:
    return None if r is None else (r[0], -r[1], r[2], r[3])


def _neg(r: Complex | None) -> Complex | None:
    return None if r is None else (-r[0], -r[1], r[2], r[3])


def _upper(f: Callable[[float, float], Complex | None]) -> Callable[[complex], Complex | None]:
    """Extend cases stated for ``b >= +0`` to the lower half plane by conjugate symmetry."""
    def g(z: complex) -> Complex | None:
        a, b = z.real, z.imag
        if not math.isnan(b) and math.copysign(1.0, b) < 0:
            return _conj(f(a, -b))
        return f(a, b)
    return g


@_upper
def expm1(a: float, b: float) -> Complex | None:
    finite_a = math.isfinite(a)
    if a == 0 and b == 0:
        return _c(0.0, 0.0, re_sign=False)
    if finite_a and (b == inf or math.isnan(b)):
        return _c(nan, nan)
    if a == inf and b == 0:
        return _c(inf, 0.0)
    if a == -inf and math.isfinite(b):
        return _c(-1.0, 0.0 * math.sin(b), im_sign=False)
    if a == inf and math.isfinite(b):  # b nonzero: +inf * cis(b) - 1
        return _c(math.copysign(inf, math.cos(b)), math.copysign(inf, math.sin(b)))
    if a == -inf and (b == inf or math.isnan(b)):
        return _c(-1.0, 0.0, im_sign=False)
    if a == inf and (b == inf or math.isnan(b)):
        return _c(inf, nan, re_sign=False)
    if math.isnan(a):
        return _c(nan, 0.0) if b == 0 else _c(nan, nan)
    return None


def _tanh_right(a: float, b: float) -> Complex | None:
    """The cases the standard states (``a >= +0`` or NaN, ``b >= +0``)."""
    if a == 0 and b == 0:
        return _c(0.0, 0.0)
    if math.isfinite(a) and a != 0 and (b == inf or math.isnan(b)):
        return _c(nan, nan)
    if a == 0 and (b == inf or math.isnan(b)):
        return _c(0.0, nan)
    if a == inf and math.isfinite(b):
        return _c(1.0, 0.0)
    if a == inf:  # b +inf or NaN
        return _c(1.0, 0.0, im_sign=False)
    if math.isnan(a):
        return _c(nan, 0.0) if b == 0 else _c(nan, nan)
    return None


@_upper
def tanh(a: float, b: float) -> Complex | None:
    if not math.isnan(a) and math.copysign(1.0, a) < 0:  # odd: tanh(a + bj) = -tanh(-a - bj) = -conj(tanh(-a + bj))
        return _neg(_conj(_tanh_right(-a, b)))
    return _tanh_right(a, b)


@_upper
def sqrt(a: float, b: float) -> Complex | None:
    if a == 0 and b == 0:
        return _c(0.0, 0.0)
    if b == inf:
        return _c(inf, inf)
    if math.isfinite(a) and math.isnan(b):
        return _c(nan, nan)
    if a == -inf and math.isfinite(b) and b > 0:
        return _c(0.0, inf)
    if a == inf and math.isfinite(b) and b > 0:
        return _c(inf, 0.0)
    if a == -inf and math.isnan(b):
        return _c(nan, inf, im_sign=False)
    if a == inf and math.isnan(b):
        return _c(inf, nan)
    if math.isnan(a):
        return _c(nan, nan)
    return None


COMPLEX = {"expm1": expm1, "tanh": tanh, "sqrt": sqrt}


def complex_grid(dtype: Any = np.complex128) -> np.ndarray:
    """Every (real, imag) pair of ``REALS``: the complex special-value inputs."""
    return np.array([complex(a, b) for a in REALS for b in REALS], dtype=dtype)


def real_pairs(dtype: Any = np.float64) -> tuple[np.ndarray, np.ndarray]:
    """Every (x1, x2) pair of ``REALS``."""
    x1 = np.array([a for a in REALS for _ in REALS], dtype=dtype)
    x2 = np.array([b for _ in REALS for b in REALS], dtype=dtype)
    return x1, x2


def _same(got: float, exp: float, sign: bool, what: str) -> None:
    if math.isnan(exp):
        assert math.isnan(got), f"{what}: {got} where the standard says NaN"
    elif math.isinf(exp) or exp == 0:
        if sign:
            assert got == exp and math.copysign(1, got) == math.copysign(1, exp), f"{what}: {got!r}, standard {exp!r}"
        else:
            assert abs(got) == abs(exp), f"{what}: {got!r}, standard ±{abs(exp)!r}"
    else:
        assert math.isclose(got, exp, rel_tol=1e-6), f"{what}: {got!r}, standard {exp!r}"


def check_complex(name: str, z: np.ndarray, got: np.ndarray, where: str) -> int:
    """Compare ``got = name(z)`` with the standard at every special case; return how many were checked."""
    ref = COMPLEX[name]
    n = 0
    for zi, gi in zip(z.tolist(), got.tolist()):
        r = ref(zi)
        if r is None:
            continue
        re, im, im_sign, re_sign = r
        what = f"{where}: {name}({zi!r}) = {gi!r}"
        _same(gi.real, re, re_sign, what + " (real part)")
        _same(gi.imag, im, im_sign, what + " (imaginary part)")
        n += 1
    return n


def check_floor_divide(x1: np.ndarray, x2: np.ndarray, got: np.ndarray, where: str) -> int:
    n = 0
    for a, b, g in zip(np.broadcast_to(x1, got.shape).ravel().tolist(), np.broadcast_to(x2, got.shape).ravel().tolist(),
                       got.ravel().tolist()):
        r = floor_divide(a, b)
        if r is not None:
            _same(g, r, True, f"{where}: {a!r} // {b!r} = {g!r}")
            n += 1
    return n


def fix_floor_divide(x1: Any, x2: Any) -> Callable[[np.ndarray], np.ndarray]:
    """The oracle's ``x1 // x2`` (NumPy's) put right where the standard has a special case."""
    def fix(exp: np.ndarray) -> np.ndarray:
        if exp.dtype.kind != "f":
            return exp
        a, b = (np.broadcast_to(np.asarray(v, dtype=exp.dtype), exp.shape) for v in (x1, x2))
        out = exp.copy()
        for i in np.ndindex(exp.shape):
            r = floor_divide(float(a[i]), float(b[i]))
            if r is not None:
                out[i] = r
        return out
    return fix

