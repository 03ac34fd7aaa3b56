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
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as _np

from ..protocol import codec

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

    table.update({
        "arange": arange,
        "eye": lambda n, m, **k: xp.eye(n, m, device=dev, **k),
        "linspace": lambda a, b, **k: xp.linspace(a, b, device=dev, **k),
        "fft.fftfreq": lambda n, **k: xp.fft.fftfreq(n, device=dev, **k),
        "fft.rfftfreq": lambda n, **k: xp.fft.rfftfreq(n, device=dev, **k),
        "astype": lambda x, dtype, **k: xp.astype(x, dtype, **k),  # dtype is positional-only there
        "clip": clip,
        "diff": diff,
        "searchsorted": lambda a, v, sorter, **k: xp.searchsorted(a, v, sorter=sorter, **k),
        "count_nonzero": lambda x, **k: xp.asarray(xp.count_nonzero(x, **k)),
        "linalg.matrix_rank": with_rtol(xp.linalg.matrix_rank),
        "linalg.pinv": with_rtol(xp.linalg.pinv),
    })
    for name in MULTI:
        if name in table:
            table[name] = _unwrap(table[name])


def signed_remainder(xp: Any, f: Fn) -> Fn:
    """The standard's (and NumPy's) rule where a backend misses it: a zero remainder takes the divisor's sign."""
    def g(a: Any, b: Any) -> Any:
        r = f(a, b)
        if xp.isdtype(r.dtype, "real floating"):
            r = xp.where(r == 0, xp.copysign(xp.zeros_like(r), xp.asarray(b, dtype=r.dtype)), r)
        return r
    return g


def signed_floor_divide(xp: Any, f: Fn) -> Fn:
    """A zero quotient is negative exactly when the operands' signs differ (JAX gives -0 for -1 // -inf)."""
    def g(a: Any, b: Any) -> Any:
        r = f(a, b)
        if xp.isdtype(r.dtype, "real floating"):
            one = xp.ones_like(r)
            sign = xp.copysign(one, xp.asarray(a, dtype=r.dtype)) * xp.copysign(one, xp.asarray(b, dtype=r.dtype))
            r = xp.where(r == 0, xp.copysign(xp.zeros_like(r), sign), r)
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
    from ..protocol import ops

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

    for name in ops.ELEMENTWISE:
        if name in table and name in _BINARY:
            table[name] = big_ints(table[name])
    table["pow"] = big_ints(pow_)
    table["remainder"] = signed_remainder(xp, table["remainder"])
    table["floor_divide"] = signed_floor_divide(xp, table["floor_divide"])
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
