"""The op vocabulary: which names an ``Op`` message may carry.

The server resolves only these names (plus registered custom ops) against its
Array API namespace: a client can never make a peer run a function of its
choosing. Extension functions are named ``linalg.<f>`` and ``fft.<f>``.
"""

from __future__ import annotations

CREATION = frozenset({"arange", "empty", "eye", "full", "linspace", "ones", "zeros",
                      "fft.fftfreq", "fft.rfftfreq"})
"""Functions that take ``device=``; the server supplies its own device."""

ELEMENTWISE = frozenset("""
abs acos acosh add asin asinh atan atan2 atanh bitwise_and bitwise_left_shift bitwise_invert
bitwise_or bitwise_right_shift bitwise_xor ceil clip conj copysign cos cosh divide equal exp expm1
floor floor_divide greater greater_equal hypot imag isfinite isinf isnan less less_equal log log1p
log2 log10 logaddexp logical_and logical_not logical_or logical_xor maximum minimum multiply
negative nextafter not_equal positive pow real reciprocal remainder round sign signbit sin sinh
square sqrt subtract tan tanh trunc
""".split())

OTHER = frozenset("""
empty_like full_like ones_like zeros_like tril triu meshgrid astype
take take_along_axis matmul matrix_transpose tensordot vecdot
broadcast_arrays broadcast_to concat expand_dims flip moveaxis permute_dims repeat reshape roll
squeeze stack tile unstack argmax argmin count_nonzero nonzero searchsorted where
unique_all unique_counts unique_inverse unique_values isin argsort sort
cumulative_prod cumulative_sum max mean min prod std sum var all any diff
""".split())

LINALG = frozenset("linalg." + n for n in """
cholesky cross det diagonal eig eigh eigvals eigvalsh inv matmul matrix_norm matrix_power matrix_rank
matrix_transpose outer pinv qr slogdet solve svd svdvals tensordot trace vecdot vector_norm
""".split())

FFT = frozenset("fft." + n for n in """
fft ifft fftn ifftn rfft irfft rfftn irfftn hfft ihfft fftfreq rfftfreq fftshift ifftshift
""".split())

INTERNAL = frozenset({"getitem", "setitem", "copy"})
"""Ember's own ops: ``x[key]``, functional ``x[key] = v`` and a device-local copy."""

SEQUENCE_ARG = frozenset({"concat", "stack"})
"""Functions whose first parameter is a sequence of arrays (sent as varargs)."""

ALL = CREATION | ELEMENTWISE | OTHER | LINALG | FFT | INTERNAL


def writes(name: str) -> bool | None:
    """Does op ``name`` write one of its arguments? False for every op of this vocabulary (``setitem`` makes a
    new array); None (unknown: it may) for any other name. ``ClientSession.op_writes`` for the Array API: a
    value read inside a held op group is answered before the group's ops that cannot change it."""
    return False if name in ALL else None

