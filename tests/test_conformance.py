"""Conformance of ``ember.array_api`` against ``array-api-strict`` (the oracle), op by op.

Hypothesis draws shapes, dtypes and values; each example runs the same call on the
oracle and on an Ember peer (a NumPy device, and a ``torch:cpu`` device where torch is
installed) and compares the result's shape and dtype (both the client's inference and
the value that comes back) and values. Where the oracle refuses a call, Ember must
refuse it too. Every peer runs at the standard's 2025.12 revision (the oracle's flag and
``ember.array_api``) and at 2024.12 (the oracle's flag and the namespace that
``x.__array_namespace__(api_version="2024.12")`` returns). This module holds the harness
(imported by the other ``test_conformance_*`` modules) and the elementwise functions and
operators.
"""

from __future__ import annotations

import math
import operator
import os
from typing import Any, Callable, Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import ember
import ember.array_api as xp
from ember.array_api import _dtypes as D
from ember.array_api._array import RULES
from ember.array_api._elementwise import BINARY, UNARY
from ember.server import Server
import special_values

xs = pytest.importorskip("array_api_strict")

#: The revisions of the standard every peer is checked at (the oracle and Ember both switched).
VERSIONS = ["2025.12", "2024.12"]

pytestmark = [pytest.mark.filterwarnings("ignore::RuntimeWarning"), pytest.mark.timeout(300)]  # JAX compiles

#: More examples locally with EMBER_CONFORMANCE_EXAMPLES=200 (and a random seed with EMBER_CONFORMANCE_RANDOM=1).
SETTINGS = settings(max_examples=int(os.environ.get("EMBER_CONFORMANCE_EXAMPLES", "15")), deadline=None,
                    derandomize=not os.environ.get("EMBER_CONFORMANCE_RANDOM"), database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])

#: NumPy and torch:cpu always (torch skips where absent); JAX with EMBER_TEST_JAX=1 (it compiles every
#: op for every shape: minutes, so not by default).
PEERS = ["cpu", "torch:cpu"] + (["jax:cpu"] if os.environ.get("EMBER_TEST_JAX") else [])


class Peer:
    """One Ember device at one revision of the standard, plus what the tests need to know about it."""

    def __init__(self, spec: str, dev: ember.Device, version: str) -> None:
        self.spec = spec
        self.dev = dev
        self.version = version
        self.ns = xp.ones(1, device=dev).__array_namespace__(api_version=version)
        assert self.ns.__array_api_version__ == version
        self.dtypes = [D.BY_NAME[n] for n in dev.dtypes]
        self.torch = spec.startswith("torch")
        self.jax = spec.startswith("jax")

    def oracle(self) -> Any:
        """array-api-strict at this peer's revision (a process-wide flag: set before every use)."""
        if xs.get_array_api_strict_flags()["api_version"] != self.version:
            xs.set_array_api_strict_flags(api_version=self.version)
        return xs


def _peer(spec: str, version: str = VERSIONS[0]) -> Iterator[Peer]:
    if spec.startswith("torch"):
        pytest.importorskip("torch")
    srv = Server([spec])
    srv.listen_websocket("127.0.0.1", 0)
    srv.start_in_thread()
    dev = ember.connect(srv.addresses[0])
    try:
        yield Peer(spec, dev, version)
    finally:
        dev.close()
        srv.close()


@pytest.fixture(scope="module", params=[(s, v) for v in VERSIONS for s in PEERS], ids=lambda p: f"{p[0]}@{p[1]}")
def peer(request: pytest.FixtureRequest) -> Iterator[Peer]:
    yield from _peer(*request.param)


# ---- strategies ---------------------------------------------------------------------

def shapes(min_dims: int = 0, max_dims: int = 3, min_side: int = 0, max_side: int = 4) -> st.SearchStrategy:
    return hnp.array_shapes(min_dims=min_dims, max_dims=max_dims, min_side=min_side, max_side=max_side)


def dtypes(peer: Peer, allowed: frozenset | None = None) -> st.SearchStrategy:
    names = [t for t in peer.dtypes if allowed is None or t in allowed]
    return st.sampled_from(names)


def elements(dt: D.DType, special: bool = True, lo: float | None = None, hi: float | None = None) -> st.SearchStrategy:
    """Values of dtype ``dt``; floats include nan, ±inf and signed zeros unless ``special`` is False."""
    if dt.kind == "b":
        return st.booleans()
    if dt.kind in "iu":
        info = np.iinfo(dt.np)
        return st.integers(int(info.min if lo is None else max(lo, info.min)),
                           int(info.max if hi is None else min(hi, info.max)))
    width = dt.itemsize * 8
    if dt.kind == "f":
        return st.floats(min_value=lo, max_value=hi, allow_nan=special and lo is None,
                         allow_infinity=special and lo is None, width=width, allow_subnormal=False)
    mag = None if special else (hi or 1e3)
    return st.complex_numbers(max_magnitude=mag, allow_nan=special, allow_infinity=special, width=width,
                              allow_subnormal=False)


def arrays(dt: D.DType, shape: Any, **kw: Any) -> st.SearchStrategy:
    return hnp.arrays(dt.np, shape, elements=elements(dt, **kw))


def plain(dt: D.DType, shape: Any, lo: float = -100, hi: float = 100) -> st.SearchStrategy:
    """Arrays of ordinary values: finite, within [lo, hi] (complex: magnitude <= hi)."""
    if dt.kind == "b":
        return arrays(dt, shape)
    return arrays(dt, shape, special=False, lo=lo, hi=hi)


def scalar(dt: D.DType, **kw: Any) -> st.SearchStrategy:
    """A Python scalar that the standard lets combine with an array of ``dt``."""
    if dt.kind == "b":
        return st.booleans()
    if dt.kind in "iu":
        return elements(dt, **kw).map(int)
    if dt.kind == "f":
        return st.one_of(elements(dt, **kw).map(float), st.integers(-100, 100))
    return st.one_of(elements(dt, **kw).map(complex), elements(D.float64, special=False, lo=-1e3, hi=1e3))


# ---- running and comparing ----------------------------------------------------------------

class Ctx:
    """What a test's call sees: the namespace, and ``device=`` kwargs for creation functions."""

    def __init__(self, ns: Any, dev: Any) -> None:
        self.ns = ns
        self.dev = {} if dev is None else {"device": dev}

    def dtype(self, dt: D.DType | str) -> Any:
        return getattr(self.ns, dt if isinstance(dt, str) else dt.name)

    def asarray(self, a: np.ndarray) -> Any:
        return self.ns.asarray(a, **self.dev)


def _host(r: Any) -> Any:
    """An array result as a NumPy array; sequences and scalars kept as such."""
    if isinstance(r, (tuple, list)):
        return type(r)(_host(v) for v in r) if not hasattr(r, "_fields") else tuple(_host(v) for v in r)
    if isinstance(r, (bool, int, float, complex, str)) or r is None:
        return r
    if isinstance(r, xp.Array):
        got = r.to_numpy()
        assert got.shape == r.shape, f"peer returned shape {got.shape}, the client inferred {r.shape}"
        assert got.dtype.name == r.dtype.name, f"peer returned {got.dtype}, the client inferred {r.dtype.name}"
        return got
    if hasattr(r, "dtype") and hasattr(r, "shape"):  # an array-api-strict array
        return np.asarray(r)
    return r


def _same_float(got: np.ndarray, exp: np.ndarray, rtol: float, atol: float, what: str,
                signed_zeros: bool = False) -> None:
    g, e = got.astype(np.float64), exp.astype(np.float64)
    both_nan = np.isnan(g) & np.isnan(e)
    inf_e = np.isinf(e)
    assert np.array_equal(np.isnan(g), np.isnan(e)), f"{what}: nan positions differ\n{got}\n{exp}"
    assert np.array_equal(g[inf_e], e[inf_e]), f"{what}: infinities differ\n{got}\n{exp}"
    fin = ~(both_nan | inf_e)
    np.testing.assert_allclose(g[fin], e[fin], rtol=rtol, atol=atol, err_msg=what)
    if signed_zeros:  # the standard's special cases distinguish +0 and -0
        zero = (e == 0) & (g == 0)
        assert np.array_equal(np.signbit(g[zero]), np.signbit(e[zero])), f"{what}: signed zeros differ\n{got}\n{exp}"


def compare(got: Any, exp: Any, rtol: float | None = None, atol: float = 0.0, what: str = "result",
            signed_zeros: bool = False) -> None:
    """Equal shapes and dtypes; values equal (integers) or close (floats: nan, ±inf exactly, and
    the sign of zeros where ``signed_zeros``, as the standard's special cases specify)."""
    if isinstance(exp, (tuple, list)):
        assert isinstance(got, (tuple, list)) and len(got) == len(exp), f"{what}: {got!r} vs {exp!r}"
        assert type(got) is type(exp), f"{what}: a {type(got).__name__}, the oracle gives a {type(exp).__name__}"
        for i, (g, e) in enumerate(zip(got, exp)):
            compare(g, e, rtol, atol, f"{what}[{i}]", signed_zeros)
        return
    if not isinstance(exp, np.ndarray):
        assert got == exp or (isinstance(exp, float) and math.isnan(exp) and math.isnan(got)), f"{what}: {got} != {exp}"
        return
    assert got.shape == exp.shape, f"{what}: shape {got.shape} != {exp.shape}"
    assert got.dtype == exp.dtype, f"{what}: dtype {got.dtype} != {exp.dtype}"
    if exp.dtype.kind in "fc":
        tol = rtol if rtol is not None else (2e-5 if exp.dtype in (np.float32, np.complex64) else 1e-11)
        a = atol or tol
        if exp.dtype.kind == "c":  # complex results: absolute error scales with the largest magnitude
            finite = np.abs(exp[np.isfinite(exp)])
            a = max(a, tol * float(finite.max())) if finite.size else a
            _same_float(got.real, exp.real, tol, a, what + ".real", False)
            _same_float(got.imag, exp.imag, tol, a, what + ".imag", False)
        else:
            _same_float(got, exp, tol, a, what, signed_zeros)
    else:
        np.testing.assert_array_equal(got, exp, err_msg=what)


def dtype_name(dt: Any) -> str:
    """``float32`` for an Ember, array-api-strict or NumPy dtype."""
    return str(getattr(dt, "name", None) or dt).rsplit(".", 1)[-1].strip("'>)")


def _dtypes_of(r: Any) -> list[str]:
    if isinstance(r, (tuple, list)):
        return [n for v in r for n in _dtypes_of(v)]
    return [str(r.dtype).rsplit(".", 1)[-1]] if hasattr(r, "dtype") else []


def check(peer: Peer, fn: Callable[..., Any], *inputs: Any, rtol: float | None = None, atol: float = 0.0,
          post: Callable[[Any], Any] | None = None, signed_zeros: bool = False,
          fix: Callable[[Any], Any] | None = None) -> Any:
    """Run ``fn(ctx, *arrays)`` on the oracle and on Ember; compare (or check both refuse).

    ``inputs`` are NumPy arrays (uploaded to each side) or other values passed as they are.
    ``post`` maps each side's host result before comparing (e.g. to drop an ambiguous part);
    ``fix`` maps the oracle's result only, where the oracle is wrong (the standard's special cases
    NumPy gets wrong, array-api-strict bugs).
    """
    def run(ctx: Ctx) -> Any:
        args = [ctx.asarray(a.copy()) if isinstance(a, np.ndarray) else a for a in inputs]  # the oracle may write
        return _host(fn(ctx, *args))

    try:
        exp = run(Ctx(peer.oracle(), None))
    except Exception as e:  # the oracle refuses: so must Ember
        with pytest.raises(Exception):
            run(Ctx(peer.ns, peer.dev))
        return e
    missing = [n for n in _dtypes_of(exp) if n not in peer.dev.dtypes]
    if missing:  # a dtype this backend lacks: refused on the client, before anything is sent
        with pytest.raises(TypeError, match="has no"):
            run(Ctx(peer.ns, peer.dev))
        return None
    if fix is not None:
        exp = fix(exp)
    got = run(Ctx(peer.ns, peer.dev))
    if post is not None:
        got, exp = post(got), post(exp)
    compare(got, exp, rtol, atol, signed_zeros=signed_zeros)
    return got


def given_data(f: Callable[..., Any]) -> Callable[..., Any]:
    """``@given(data=st.data())`` with this suite's settings."""
    return SETTINGS(given(data=st.data())(f))


# ---- elementwise functions ----------------------------------------------------------------

#: Inputs that the standard leaves unspecified (or NumPy rejects): keep them out of the draws.
INT_NONZERO_DIVISOR = {"floor_divide", "remainder"}
SHIFTS = {"bitwise_left_shift", "bitwise_right_shift"}
COMPLEX_LOOSE = {"acos", "acosh", "asin", "asinh", "atan", "atanh", "cos", "cosh", "exp", "expm1", "log", "log1p",
                 "log2", "log10", "sin", "sinh", "sqrt", "tan", "tanh", "pow", "divide", "reciprocal", "sign",
                 "square", "multiply"}


def _special_ok(peer: Peer, name: str, dt: D.DType) -> bool:
    """Whether to draw nan/inf/signed zeros for ``name`` on ``dt`` (complex specials stay out)."""
    if dt.kind == "c" and (name in COMPLEX_LOOSE or peer.torch or peer.jax):
        return False  # complex inf/nan components: backends differ (e.g. torch: reciprocal(0j), 0 - infj)
    return True


TORCH_COMPLEX_ZERO = {"reciprocal", "divide", "pow"}


def _nonzero_complex(peer: Peer, name: str, a: np.ndarray) -> np.ndarray:
    """torch and JAX divide by complex zero differently (reciprocal(0j) is nan+nanj, NumPy's inf+nanj).

    JAX (XLA on CPU) also flushes subnormal numbers to zero: its inputs keep clear of that range.
    """
    if peer.jax and a.dtype.kind in "cf":
        a = np.asarray(np.where(np.abs(a) < 1e-30, np.zeros_like(a), a))
    if (peer.torch or peer.jax) and name in TORCH_COMPLEX_ZERO and a.dtype.kind in "cf":
        return np.asarray(np.where(a == 0, np.ones_like(a), a))
    return a


def _fix_int_args(name: str, dt: D.DType, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if dt.kind in "iu":
        if name in INT_NONZERO_DIVISOR:
            b = np.where(b == 0, np.ones_like(b), b)
        if name in SHIFTS:
            b = np.asarray(np.abs(b.astype(np.int64)) % (dt.itemsize * 8)).astype(b.dtype)
        if name == "pow":
            b = np.asarray(np.abs(b.astype(np.int64)) % 4).astype(b.dtype)
    return np.asarray(a), np.asarray(b)


@pytest.mark.parametrize("name", UNARY)
@given_data
def test_unary(peer: Peer, name: str, data: st.DataObject) -> None:
    dt = data.draw(dtypes(peer, RULES[name][0]), "dtype")
    x = _nonzero_complex(peer, name, data.draw(arrays(dt, shapes(), special=_special_ok(peer, name, dt),
                                                      **_range(name, dt)), "x"))
    check(peer, lambda c, a: getattr(c.ns, name)(a), x, rtol=_rtol(peer, name, dt), signed_zeros=True)


def _range(name: str, dt: D.DType) -> dict[str, Any]:
    if dt.kind == "c" and name in COMPLEX_LOOSE:
        return {"lo": -20.0, "hi": 20.0}  # (a float partner of a complex array too: pow overflows differ)
    if dt.kind == "f" and name in ("exp", "expm1", "cosh", "sinh", "pow", "tan", "sin", "cos"):
        return {"lo": -50.0, "hi": 50.0}
    return {}


def _rtol(peer: Peer, name: str, dt: D.DType) -> float | None:
    if dt.kind == "c" and name in COMPLEX_LOOSE:
        return 1e-3 if dt is D.complex64 else 1e-9
    if peer.torch and dt.kind in "fc":
        return 1e-4 if dt.itemsize <= 8 and dt.kind == "f" or dt is D.complex64 else 1e-9
    return None


def _pair_dtypes(peer: Peer, data: st.DataObject, allowed: frozenset) -> tuple[D.DType, D.DType]:
    dt1 = data.draw(dtypes(peer, allowed), "dtype1")
    partners = [t for t in peer.dtypes if t in allowed and (dt1, t) in D.PROMOTION]
    return dt1, data.draw(st.sampled_from(partners), "dtype2")


@pytest.mark.parametrize("name", BINARY)
@given_data
def test_binary(peer: Peer, name: str, data: st.DataObject) -> None:
    dt1, dt2 = _pair_dtypes(peer, data, RULES[name][0])
    s1, s2 = data.draw(hnp.mutually_broadcastable_shapes(num_shapes=2, max_dims=3, max_side=4), "shapes").input_shapes
    sp = _special_ok(peer, name, dt1) and _special_ok(peer, name, dt2)
    rng = _range(name, D.promote(dt1, dt2))
    a = data.draw(arrays(dt1, s1, special=sp, **rng), "x1")
    b = data.draw(arrays(dt2, s2, special=sp, **rng), "x2")
    a, b = _fix_int_args(name, D.promote(dt1, dt2), a, b)
    a, b = _nonzero_complex(peer, name, a), _nonzero_complex(peer, name, b)
    check(peer, lambda c, x, y: getattr(c.ns, name)(x, y), a, b, rtol=_rtol(peer, name, D.promote(dt1, dt2)),
          signed_zeros=True, fix=_fix(name, a, b))


def _fix(name: str, a: Any, b: Any) -> Callable[[Any], Any] | None:
    """NumPy's (so the oracle's) ``floor_divide`` misses special cases of the standard: put them right."""
    return special_values.fix_floor_divide(a, b) if name == "floor_divide" else None


@pytest.mark.parametrize("name", BINARY)
@given_data
def test_binary_scalar(peer: Peer, name: str, data: st.DataObject) -> None:
    """2024.12: a Python scalar on either side, promoted by the array's dtype."""
    dt = data.draw(dtypes(peer, RULES[name][0]), "dtype")
    sp = _special_ok(peer, name, dt)
    a = data.draw(arrays(dt, shapes(), special=sp, **_range(name, dt)), "x")
    s = data.draw(scalar(dt, special=sp, **_range(name, dt)), "scalar")
    if dt.kind in "iu" and (name in INT_NONZERO_DIVISOR | SHIFTS or name == "pow"):
        s = (abs(s) % 3) + 1
    a = _nonzero_complex(peer, name, a)
    if (peer.torch or peer.jax) and name in TORCH_COMPLEX_ZERO and s == 0:
        s = type(s)(1)
    if peer.jax and type(s) in (float, complex) and abs(s) < 1e-30:
        s = type(s)(0)
    if data.draw(st.booleans(), "scalar first") and name not in SHIFTS | {"pow"}:
        if dt.kind in "iu" and name in INT_NONZERO_DIVISOR:
            a = np.asarray(np.where(a == 0, np.ones_like(a), a))
        check(peer, lambda c, x: getattr(c.ns, name)(s, x), a, rtol=_rtol(peer, name, dt), signed_zeros=True,
              fix=_fix(name, s, a))
    else:
        check(peer, lambda c, x: getattr(c.ns, name)(x, s), a, rtol=_rtol(peer, name, dt), signed_zeros=True,
              fix=_fix(name, a, s))


@given_data
def test_binary_any_dtypes(peer: Peer, data: st.DataObject) -> None:
    """Any two dtypes: the result dtype follows the standard's table, or both sides refuse."""
    name = data.draw(st.sampled_from(["add", "multiply", "equal", "less", "maximum", "logical_and",
                                      "bitwise_or", "divide", "atan2"]), "function")
    dt1, dt2 = data.draw(dtypes(peer), "dtype1"), data.draw(dtypes(peer), "dtype2")
    a = data.draw(plain(dt1, (3,), lo=-5, hi=5), "x1")
    b = data.draw(plain(dt2, (3,), lo=1, hi=5), "x2")
    check(peer, lambda c, x, y: getattr(c.ns, name)(x, y), a, b)


@given_data
def test_clip(peer: Peer, data: st.DataObject) -> None:
    dt = data.draw(dtypes(peer, D.REAL_NUMERIC), "dtype")
    x = data.draw(arrays(dt, shapes()), "x")
    kind = data.draw(st.sampled_from(["scalar", "array", "none"]), "bounds")
    if kind == "array":
        lo = data.draw(arrays(dt, x.shape[-1:] if x.ndim else (), special=False), "min")
        check(peer, lambda c, a, m: c.ns.clip(a, m, None), x, lo)
        return
    if kind == "none":
        check(peer, lambda c, a: c.ns.clip(a), x)
        return
    v = sorted(data.draw(st.lists(st.integers(0 if dt.kind == "u" else -50, 50), min_size=2, max_size=2), "bounds"))
    if dt.kind == "f":
        v = [float(t) for t in v]
    check(peer, lambda c, a: c.ns.clip(a, v[0], v[1]), x)


# ---- operators --------------------------------------------------------------------------------

OPERATORS = {"__add__": "add", "__sub__": "subtract", "__mul__": "multiply", "__truediv__": "divide",
             "__floordiv__": "floor_divide", "__mod__": "remainder", "__pow__": "pow", "__and__": "bitwise_and",
             "__or__": "bitwise_or", "__xor__": "bitwise_xor", "__lshift__": "bitwise_left_shift",
             "__rshift__": "bitwise_right_shift", "__eq__": "equal", "__ne__": "not_equal", "__lt__": "less",
             "__le__": "less_equal", "__gt__": "greater", "__ge__": "greater_equal"}


@pytest.mark.parametrize("dunder", sorted(OPERATORS))
@given_data
def test_operator(peer: Peer, dunder: str, data: st.DataObject) -> None:
    name = OPERATORS[dunder]
    dt1, dt2 = _pair_dtypes(peer, data, RULES[name][0])
    s1, s2 = data.draw(hnp.mutually_broadcastable_shapes(num_shapes=2, max_dims=2, max_side=3), "shapes").input_shapes
    a = data.draw(plain(dt1, s1), "x1")
    b = data.draw(plain(dt2, s2), "x2")
    a, b = _fix_int_args(name, D.promote(dt1, dt2), a, b)
    a, b = _nonzero_complex(peer, name, a), _nonzero_complex(peer, name, b)
    rtol = 1e-4 if peer.torch else None
    check(peer, lambda c, x, y: getattr(x, dunder)(y), a, b, rtol=rtol)
    reflected = "__r" + dunder[2:]
    if hasattr(xp.Array, reflected):
        check(peer, lambda c, x, y: getattr(y, reflected)(x), a, b, rtol=rtol)


@pytest.mark.parametrize("dunder", [d for d in sorted(OPERATORS) if d not in
                                    ("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__")])
@given_data
def test_inplace_operator(peer: Peer, dunder: str, data: st.DataObject) -> None:
    """``x op= y`` keeps x's identity, dtype and shape; its value is replaced."""
    name = OPERATORS[dunder]
    dt1, dt2 = _pair_dtypes(peer, data, RULES[name][0])
    s = data.draw(shapes(max_dims=2, max_side=3), "shape")
    a = data.draw(plain(dt1, s), "x1")
    b = data.draw(plain(dt2, s[1:]), "x2")
    a, b = _fix_int_args(name, D.promote(dt1, dt2), a, b)
    a, b = _nonzero_complex(peer, name, a), _nonzero_complex(peer, name, b)
    inplace = "__i" + dunder[2:]

    def f(c: Ctx, x: Any, y: Any) -> Any:
        before = x
        x = getattr(operator, inplace)(x, y)
        assert x is before, "an in-place operator must keep the array object"
        return x

    check(peer, f, a, b, rtol=1e-4 if peer.torch else None)


@given_data
def test_unary_operators(peer: Peer, data: st.DataObject) -> None:
    dt = data.draw(dtypes(peer), "dtype")
    x = data.draw(plain(dt, shapes()), "x")
    for op in (operator.neg, operator.pos, operator.abs, operator.invert):
        check(peer, lambda c, a: op(a), x)


def test_promotion_table(peer: Peer) -> None:
    """Every pair of the device's dtypes: result_type and add agree with the oracle (or both refuse)."""
    for t1 in peer.dtypes:
        for t2 in peer.dtypes:
            a, b = np.zeros(2, dtype=t1.np), np.ones(2, dtype=t2.np)
            check(peer, lambda c, x, y: dtype_name(c.ns.result_type(x, y)), a, b)
            check(peer, lambda c, x, y: c.ns.add(x, y) if t1 is not D.bool else c.ns.logical_or(x, y), a, b)
