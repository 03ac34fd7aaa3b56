"""Per-op adapters: make every backend compute exactly what the client inferred.

The client computes each result's shape and dtype from the standard's rules. Most
backend functions (through array-api-compat) already agree; the few that differ in
calling convention or result are wrapped here, once per device, so the hot path
stays a dictionary lookup and a call.

* Wire conventions: the standard's positional-only scalars (``arange``'s bounds,
  ``eye``'s sizes, ``astype``'s dtype...) and array-valued keyword parameters
  (``diff``'s prepend/append, ``searchsorted``'s sorter, ``rtol`` arrays) travel as
  positional op arguments; adapters put them back where the backend wants them.
* Results: multi-output ops with one output return the array itself; ``clip`` keeps
  ``x``'s dtype; ``arange`` has exactly the length the client computed.
* Backend gaps (PyTorch: negative slice steps, float ``correction``, ``unique_all``/
  ``unique_counts``/``unique_inverse``; JAX: immutable arrays for ``x[key] = v``).
* Special cases of the standard that backends miss (``floor_divide`` with infinite operands,
  complex ``expm1``, ``tanh`` and ``sqrt`` at infinite or NaN parts), fixed for every backend.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as _np

from ...protocol import codec

Fn = Callable[..., Any]
MULTI = ("meshgrid", "broadcast_arrays", "unstack", "nonzero")
"""Ops returning a sequence that may hold a single array."""


def _unwrap(f: Fn) -> Fn:
    def g(*a: Any, **k: Any) -> Any:
        r = f(*a, **k)
        return r[0] if len(r) == 1 else r
    return g


def common(xp: Any, dev: Any, table: dict[str, Fn]) -> None:
    """Adapters every backend needs (wire conventions and result shapes)."""
    numpy_backend = xp.__name__ == "array_api_compat.numpy"
    def arange(start: Any, stop: Any, step: Any, *, num: int, dtype: Any) -> Any:
        r = xp.arange(start, stop, step, dtype=dtype, device=dev)
        if r.shape[0] != num:  # float rounding may disagree with the client's count by one
            r = xp.arange(num, dtype=dtype, device=dev) * step + start
        return r

    def clip(x: Any, lo: Any, hi: Any) -> Any:
        if lo is None and hi is None:
            return xp.asarray(x, copy=True)
        r = _np.clip(x, lo, hi) if numpy_backend else xp.clip(x, lo, hi)  # compat's NumPy clip writes to bounds
        return r if r.dtype == x.dtype else xp.astype(r, x.dtype)

    def diff(x: Any, prepend: Any, append: Any, **k: Any) -> Any:
        if prepend is not None:
            k["prepend"] = prepend
        if append is not None:
            k["append"] = append
        return xp.diff(x, **k)

    def with_rtol(f: Fn) -> Fn:
        return lambda x, rtol: f(x) if rtol is None else f(x, rtol=rtol)

    def isin(a: Any, b: Any, **k: Any) -> Any:
        """A scalar operand as a 0-d array of the other's dtype; both arrays of one dtype (torch wants that)."""
        if not hasattr(a, "dtype"):
            a = xp.asarray(a, dtype=b.dtype, device=dev)
        elif not hasattr(b, "dtype"):
            b = xp.asarray(b, dtype=a.dtype, device=dev)
        elif a.dtype != b.dtype:
            t = xp.result_type(a, b)
            a, b = xp.astype(a, t), xp.astype(b, t)
        return xp.asarray(xp.isin(a, b, **k))

    def complex_eig(f: Fn, pair: bool) -> Fn:
        """Eigen-decompositions of 2025.12 are complex whatever the input (NumPy's may be real)."""
        def g(x: Any) -> Any:
            r = f(x)
            t = xp.complex64 if x.dtype in (xp.float32, xp.complex64) else xp.complex128
            parts = tuple(p if p.dtype == t else xp.astype(p, t) for p in (r if pair else (r,)))
            return parts if pair else parts[0]
        return g

    def expand_dims(x: Any, *, axis: Any) -> Any:
        """Several axes (2025.12; the client sends them normalized, ascending) as one reshape."""
        if type(axis) is int:
            return xp.expand_dims(x, axis=axis)
        shape = list(x.shape)
        for a in sorted(axis):
            shape.insert(a, 1)
        return xp.reshape(x, tuple(shape))

    table.update({
        "arange": arange,
        "eye": lambda n, m, **k: xp.eye(n, m, device=dev, **k),
        "linspace": lambda a, b, **k: xp.linspace(a, b, device=dev, **k),
        "fft.fftfreq": lambda n, **k: xp.fft.fftfreq(n, device=dev, **k),
        "fft.rfftfreq": lambda n, **k: xp.fft.rfftfreq(n, device=dev, **k),
        "astype": lambda x, dtype, **k: xp.astype(x, dtype, **k),  # dtype is positional-only there
        "clip": clip,
        "diff": diff,
        "searchsorted": lambda a, v, sorter, **k: xp.asarray(xp.searchsorted(a, v, sorter=sorter, **k)),
        "count_nonzero": lambda x, **k: xp.asarray(xp.count_nonzero(x, **k)),
        "isin": isin,
        "expand_dims": expand_dims,
        "linalg.matrix_rank": with_rtol(xp.linalg.matrix_rank),
        "linalg.pinv": with_rtol(xp.linalg.pinv),
    })
    for name, pair in (("eig", True), ("eigvals", False)):
        f = getattr(xp.linalg, name, None)
        if f is not None:
            table["linalg." + name] = complex_eig(f, pair)
    for name in MULTI:
        if name in table:
            table[name] = _unwrap(table[name])
    table["floor_divide"] = floor_divide_special_cases(xp, dev, table["floor_divide"])
    table["expm1"] = expm1_special_cases(xp, dev, table["expm1"])
    table["tanh"] = tanh_special_cases(xp, dev, table["tanh"])
    table["sqrt"] = sqrt_special_cases(xp, dev, table["sqrt"])


def promoted_setitem(xp: Any, f: Fn) -> Fn:
    """2025.12: an array ``value`` is promoted to ``x``'s dtype (PyTorch's masked assignment wants equal dtypes)."""
    def g(x: Any, value: Any, *arrays: Any, key: list[Any]) -> Any:
        if hasattr(value, "dtype") and value.dtype != x.dtype:
            value = xp.astype(value, x.dtype)
        return f(x, value, *arrays, key=key)
    return g


# ---- special cases of the standard ---------------------------------------------------------

def floor_divide_special_cases(xp: Any, dev: Any, f: Fn) -> Fn:
    """The standard's real floating-point special cases: ``±inf // finite`` is ±infinity (NumPy and
    PyTorch give NaN), ``finite // ±inf`` a signed zero (they give -1 for operands of different
    signs), and every zero quotient is negative exactly when the operands' signs differ (JAX gives
    -0 for ``-1 // -inf``)."""
    def g(a: Any, b: Any) -> Any:
        r = f(a, b)
        if not xp.isdtype(r.dtype, "real floating"):
            return r
        a = xp.asarray(a, dtype=r.dtype, device=dev)
        b = xp.asarray(b, dtype=r.dtype, device=dev)
        r = xp.where(xp.isinf(a) & xp.isfinite(b) & (b != 0), a / b, r)
        zero = xp.zeros_like(r)
        r = xp.where(xp.isfinite(a) & xp.isinf(b), zero, r)
        one = xp.ones_like(r)
        return xp.where(r == 0, xp.copysign(zero, xp.copysign(one, a) * xp.copysign(one, b)), r)
    return g


def _complex(xp: Any, re: Any, neg_zero: Any) -> Any:
    """``re + 0j``, the zero negative where ``neg_zero``: no complex arithmetic (``1j * inf`` is NaN)."""
    z = xp.astype(re, xp.complex64 if re.dtype == xp.float32 else xp.complex128)
    return xp.where(neg_zero, xp.conj(z), z)


def expm1_special_cases(xp: Any, dev: Any, f: Fn) -> Fn:
    """Complex ``expm1`` where the real part is ±infinity or NaN and the imaginary part 0, infinite or
    NaN (NumPy and PyTorch give NaN + NaN j for most of these); other imaginary parts follow from
    conjugate symmetry."""
    def g(x: Any) -> Any:
        r = f(x)
        if not xp.isdtype(r.dtype, "complex floating"):
            return r
        a, b = xp.real(x), xp.imag(x)
        pinf, ninf, anan = a == math.inf, a == -math.inf, xp.isnan(a)
        bzero, bnan = b == 0, xp.isnan(b)
        bbad = xp.isinf(b) | bnan
        r = xp.where((ninf & bbad) | ((pinf | anan) & bzero),  # -1 + 0j, +inf ± 0j, NaN ± 0j
                     _complex(xp, xp.where(ninf, xp.full_like(a, -1.0), a), xp.signbit(b) & ~bnan), r)
        return xp.where(pinf & bbad, _const(xp, dev, complex(math.inf, math.nan), r.dtype), r)  # (not by adding:
        # PyTorch's complex addition makes inf + nan j NaN + NaN j)
    return g


def tanh_special_cases(xp: Any, dev: Any, f: Fn) -> Fn:
    """Complex ``tanh`` at real part ±infinity with a finite imaginary part b: ``±1 + 0j`` with the
    zero's sign that of b (NumPy and PyTorch give -0 where sin(2b) < 0); at real part ±0 with b
    infinite or NaN: ``±0 + NaN j`` (XLA gives NaN + NaN j)."""
    def g(x: Any) -> Any:
        r = f(x)
        if not xp.isdtype(r.dtype, "complex floating"):
            return r
        a, b = xp.real(x), xp.imag(x)
        r = xp.where(xp.isinf(a) & xp.isfinite(b), _complex(xp, xp.copysign(xp.ones_like(a), a), xp.signbit(b)), r)
        zero_nan = xp.where(xp.signbit(a), _const(xp, dev, complex(-0.0, math.nan), r.dtype),
                            _const(xp, dev, complex(0.0, math.nan), r.dtype))
        return xp.where((a == 0) & ~xp.isfinite(b), zero_nan, r)
    return g


def sqrt_special_cases(xp: Any, dev: Any, f: Fn) -> Fn:
    """Complex ``sqrt`` with an infinite imaginary part (``+inf ± inf j`` whatever the real part) or a
    NaN imaginary and infinite real part (XLA gives NaN + NaN j for these)."""
    def g(x: Any) -> Any:
        r = f(x)
        if not xp.isdtype(r.dtype, "complex floating"):
            return r
        a, b = xp.real(x), xp.imag(x)
        c = lambda v: _const(xp, dev, v, r.dtype)  # noqa: E731
        r = xp.where(xp.isinf(b), xp.where(b > 0, c(complex(math.inf, math.inf)), c(complex(math.inf, -math.inf))), r)
        bnan = xp.isnan(b)
        r = xp.where(bnan & (a == math.inf), c(complex(math.inf, math.nan)), r)
        return xp.where(bnan & (a == -math.inf), c(complex(math.nan, math.inf)), r)
    return g


def _const(xp: Any, dev: Any, v: complex, dt: Any) -> Any:
    return xp.asarray(v, dtype=dt, device=dev)


def signed_remainder(xp: Any, f: Fn) -> Fn:
    """The standard's (and NumPy's) rule where a backend misses it: a zero remainder takes the divisor's sign."""
    def g(a: Any, b: Any) -> Any:
        r = f(a, b)
        if xp.isdtype(r.dtype, "real floating"):
            r = xp.where(r == 0, xp.copysign(xp.zeros_like(r), xp.asarray(b, dtype=r.dtype)), r)
        return r
    return g


# ---- PyTorch ---------------------------------------------------------------------------

def _positive_steps(x: Any, key: tuple[Any, ...], is_mask: Callable[[Any], bool]) -> tuple[list[int], tuple]:
    """Rewrite negative-step slices (which PyTorch refuses) as positive ones on flipped dims."""
    used = sum(0 if k is None or k is Ellipsis else (k.ndim if is_mask(k) else 1) for k in key)
    dim, flips, out = 0, [], []
    for k in key:
        out.append(k)
        if k is None:
            continue
        if k is Ellipsis:
            dim += x.ndim - used
            continue
        if is_mask(k):
            dim += k.ndim
            continue
        if type(k) is slice and k.step is not None and k.step < 0:
            n = x.shape[dim]
            r = range(*k.indices(n))
            if len(r):
                flips.append(dim)
                out[-1] = slice(n - 1 - r[0], n - r[-1], -k.step)
            else:
                out[-1] = slice(0, 0)
        dim += 1
    return flips, tuple(out)


def torch_ops(xp: Any, dev: Any, table: dict[str, Fn]) -> None:
    import torch

    def is_mask(k: Any) -> bool:
        return isinstance(k, torch.Tensor) and k.dtype == torch.bool

    def has_negative_step(key: tuple[Any, ...]) -> bool:
        return any(type(k) is slice and k.step is not None and k.step < 0 for k in key)

    def getitem(x: Any, *arrays: Any, key: list[Any]) -> Any:
        k = codec.decode_key(key, list(arrays))
        if has_negative_step(k):
            flips, k = _positive_steps(x, k, is_mask)
            if flips:
                x = torch.flip(x, flips)
        return x[k]

    def setitem(x: Any, value: Any, *arrays: Any, key: list[Any]) -> Any:
        k = codec.decode_key(key, list(arrays))
        flips: list[int] = []
        if has_negative_step(k):
            flips, k = _positive_steps(x, k, is_mask)
        y = torch.flip(x, flips) if flips else x.clone()
        y[k] = value
        return torch.flip(y, flips) if flips else y

    def moments(f: Fn, square_root: bool) -> Fn:
        def g(x: Any, *, axis: Any = None, correction: float = 0.0, keepdims: bool = False) -> Any:
            if float(correction).is_integer() and axis != ():  # torch reads axis=() as "all dims"
                return f(x, axis=axis, correction=int(correction), keepdims=keepdims)
            dims = tuple(range(x.ndim)) if axis is None else tuple(axis)
            if not dims:  # nothing reduced: every deviation is zero
                v = (x - x) / (1 - correction)
            else:
                n = 1
                for a in dims:
                    n *= x.shape[a]
                dev_ = x - torch.mean(x, dim=dims, keepdim=True)
                v = torch.sum(dev_ * dev_, dim=dims, keepdim=keepdims) / (n - correction)
            return torch.sqrt(v) if square_root else v
        return g

    def unique_all(x: Any) -> Any:
        flat = x.reshape(-1)
        values, inverse, counts = torch.unique(flat, sorted=True, return_inverse=True, return_counts=True)
        first = torch.full(values.shape, flat.numel(), dtype=torch.int64, device=x.device)
        first = first.scatter_reduce(0, inverse, torch.arange(flat.numel(), device=x.device), reduce="amin")
        return values, first, inverse.reshape(x.shape), counts

    def unique_inverse(x: Any) -> Any:
        values, inverse = torch.unique(x.reshape(-1), sorted=True, return_inverse=True)
        return values, inverse.reshape(x.shape)

    def unique_counts(x: Any) -> Any:
        return torch.unique(x.reshape(-1), sorted=True, return_counts=True)

    def count_nonzero(x: Any, *, axis: Any = None, keepdims: bool = False) -> Any:
        if axis == ():  # torch reads an empty dim list as "all dims"
            return (x != 0).to(torch.int64)
        return xp.count_nonzero(x, axis=axis, keepdims=keepdims)

    table.update({
        "getitem": getitem, "setitem": setitem, "count_nonzero": count_nonzero,
        "remainder": signed_remainder(xp, xp.remainder),  # compat's: it fixes torch's 0-d promotion
        "std": moments(xp.std, True), "var": moments(xp.var, False),
        "unique_all": unique_all, "unique_inverse": unique_inverse, "unique_counts": unique_counts,
    })


# ---- JAX -----------------------------------------------------------------------------------

def jax_ops(xp: Any, dev: Any, table: dict[str, Fn]) -> None:
    from ...protocol import ops

    def setitem(x: Any, value: Any, *arrays: Any, key: list[Any]) -> Any:
        return x.at[codec.decode_key(key, list(arrays))].set(value)

    def big_ints(f: Fn) -> Fn:
        """JAX cannot take a Python int beyond int64 (a uint64 operand): pass it as a 0-d array."""
        def g(a: Any, b: Any) -> Any:
            if type(b) is int and not -(1 << 63) <= b < 1 << 63:
                b = xp.asarray(b, dtype=a.dtype)
            elif type(a) is int and not -(1 << 63) <= a < 1 << 63:
                a = xp.asarray(a, dtype=b.dtype)
            return f(a, b)
        return g

    def pow_(a: Any, b: Any) -> Any:  # jnp.power keeps x1's dtype for integer arrays
        if hasattr(a, "dtype") and hasattr(b, "dtype") and a.dtype != b.dtype:
            t = xp.result_type(a, b)
            a, b = xp.astype(a, t), xp.astype(b, t)
        return xp.pow(a, b)

    def index_dtype(f: Fn) -> Fn:
        """Index results as int64 (JAX returns int32 from some, e.g. searchsorted)."""
        def g(*a: Any, **k: Any) -> Any:
            r = f(*a, **k)
            return r if r.dtype == xp.int64 else xp.astype(r, xp.int64)
        return g

    def conj_symmetric(f: Fn) -> Fn:
        """``f(conj(x)) = conj(f(x))``, as the standard states for these: XLA drops the sign of a zero
        imaginary part (``sqrt(0 - 0j)`` is ``0 + 0j`` there)."""
        def g(x: Any) -> Any:
            if not xp.isdtype(x.dtype, "complex floating"):
                return f(x)
            lower = xp.signbit(xp.imag(x))
            y = f(xp.where(lower, xp.conj(x), x))  # f once, on the upper half plane
            return xp.where(lower, xp.conj(y), y)
        return g

    for name in ops.ELEMENTWISE:
        if name in table and name in _BINARY:
            table[name] = big_ints(table[name])
    for name in ("expm1", "tanh", "sqrt"):
        table[name] = conj_symmetric(table[name])

    def nonzero_complex(f: Fn) -> Fn:
        """``all`` / ``any`` of complex values (XLA's complex64 reduction looks at the real part only)."""
        return lambda x, **k: f(x != 0, **k) if xp.isdtype(x.dtype, "complex floating") else f(x, **k)

    table["all"], table["any"] = nonzero_complex(table["all"]), nonzero_complex(table["any"])
    table["pow"] = big_ints(pow_)
    table["remainder"] = signed_remainder(xp, table["remainder"])
    for name in ("searchsorted", "argmax", "argmin", "argsort", "count_nonzero", "linalg.matrix_rank"):
        if name in table:
            table[name] = index_dtype(table[name])
    table["setitem"] = setitem


_BINARY = frozenset("""add atan2 bitwise_and bitwise_left_shift bitwise_or bitwise_right_shift bitwise_xor copysign
divide equal floor_divide greater greater_equal hypot less less_equal logaddexp logical_and logical_or logical_xor
maximum minimum multiply nextafter not_equal pow remainder subtract""".split())


BY_KIND: dict[str, Callable[[Any, Any, dict[str, Fn]], None]] = {"torch": torch_ops, "jax": jax_ops}


def adapt(kind: str, xp: Any, dev: Any, table: dict[str, Fn]) -> None:
    """Install the adapters of backend ``kind`` into ``table`` (in place)."""
    common(xp, dev, table)
    extra = BY_KIND.get(kind)
    if extra is not None:
        extra(xp, dev, table)
    table["setitem"] = promoted_setitem(xp, table["setitem"])
