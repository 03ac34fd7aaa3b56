"""Conformance against array-api-strict: what 2025.12 adds or changes, and the special cases of the
standard that NumPy's own results would leak through (the harness lives in ``test_conformance``).

At 2024.12 the same tests run against the oracle at that revision: the additions must be refused
there (they are absent from Ember's 2024.12 namespace) and the sequences must be lists.
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import special_values as sv
from ember.array_api import _dtypes as D
from test_conformance import Peer, check, dtypes, given_data, peer, plain, shapes  # noqa: F401

pytestmark = [pytest.mark.filterwarnings("ignore::RuntimeWarning"), pytest.mark.timeout(300)]  # JAX compiles


# ---- special cases ------------------------------------------------------------------------------

@pytest.mark.parametrize("dt", [D.float64, D.float32])
def test_floor_divide_special_cases(peer: Peer, dt: D.DType) -> None:
    """``//`` with infinite, zero and NaN operands as the standard says, however it is spelt."""
    x1, x2 = sv.real_pairs(dt.np)
    a, b = peer.ns.asarray(x1, device=peer.dev), peer.ns.asarray(x2, device=peer.dev)
    where = f"{peer.spec} {dt}"
    n = sv.check_floor_divide(x1, x2, peer.ns.floor_divide(a, b).to_numpy(), where)
    assert n == len(x1) - 4 * 4, "every pair but finite nonzero over finite nonzero is a special case"
    sv.check_floor_divide(x1, x2, (a // b).to_numpy(), where + " a // b")
    c = peer.ns.asarray(x1, device=peer.dev)
    c //= b
    sv.check_floor_divide(x1, x2, c.to_numpy(), where + " a //= b")
    for s in (np.inf, -np.inf, 2.0, -0.0):
        sv.check_floor_divide(x1, np.asarray(s), (a // s).to_numpy(), f"{where} a // {s}")
        sv.check_floor_divide(np.asarray(s), x2, (s // b).to_numpy(), f"{where} {s} // b")


@pytest.mark.parametrize("name", ["expm1", "tanh", "sqrt"])
@pytest.mark.parametrize("dt", [D.complex128, D.complex64])
def test_complex_special_cases(peer: Peer, name: str, dt: D.DType) -> None:
    """Complex ``expm1`` / ``tanh`` at infinite and NaN real parts, and ``sqrt`` (corrected in 2025.12)."""
    z = sv.complex_grid(dt.np)
    got = getattr(peer.ns, name)(peer.ns.asarray(z, device=peer.dev)).to_numpy()
    assert got.dtype == dt.np
    assert sv.check_complex(name, z, got, f"{peer.spec} {dt}") > 20


@given_data
def test_floor_divide_specials_in_broadcasts(peer: Peer, data: st.DataObject) -> None:
    """Drawn arrays with special values: the oracle's NumPy result, put right by the standard's cases."""
    dt = data.draw(dtypes(peer, D.REAL_FLOAT), "dtype")
    elems = st.sampled_from(sv.REALS) | st.floats(-4, 4, width=dt.itemsize * 8)
    s1, s2 = data.draw(hnp.mutually_broadcastable_shapes(num_shapes=2, max_dims=2, max_side=3), "shapes").input_shapes
    a = data.draw(hnp.arrays(dt.np, s1, elements=elems), "x1")
    b = data.draw(hnp.arrays(dt.np, s2, elements=elems), "x2")
    check(peer, lambda c, x, y: c.ns.floor_divide(x, y), a, b, fix=sv.fix_floor_divide(a, b), signed_zeros=True)


# ---- additions -----------------------------------------------------------------------------------

@given_data
def test_isin(peer: Peer, data: st.DataObject) -> None:
    dt = data.draw(dtypes(peer, D.INTEGER), "dtype")
    x1 = data.draw(plain(dt, shapes(), lo=0, hi=6), "x1")
    x2 = data.draw(plain(dt, shapes(max_dims=2), lo=0, hi=6), "x2")
    invert = data.draw(st.booleans(), "invert")
    fix = np.logical_not if invert else None  # array-api-strict 2.6 ignores invert=
    check(peer, lambda c, a, b: c.ns.isin(a, b, invert=invert), x1, x2, fix=fix)
    s = data.draw(st.integers(0, 6), "scalar")
    check(peer, lambda c, a: c.ns.isin(a, s, invert=invert), x1, fix=fix)
    check(peer, lambda c, b: c.ns.isin(s, b), x2)


def test_isin_floats_and_refusals(peer: Peer) -> None:
    """Beyond the standard's integers: real floating-point arrays too (as NumPy); bool and complex refused."""
    if peer.version < "2025.12":
        assert not hasattr(peer.ns, "isin")
        return
    a = np.array([0.5, np.nan, 2.0, -0.0])
    got = peer.ns.isin(peer.ns.asarray(a, device=peer.dev), peer.ns.asarray(np.array([0.0, 2.0]), device=peer.dev))
    np.testing.assert_array_equal(got.to_numpy(), np.isin(a, [0.0, 2.0]))
    for bad in (np.array([True]), np.array([1j])):
        with pytest.raises(TypeError):
            peer.ns.isin(peer.ns.asarray(bad, device=peer.dev), 1)
    with pytest.raises(TypeError):
        peer.ns.isin(1, 2)


@given_data
def test_broadcast_shapes(peer: Peer, data: st.DataObject) -> None:
    n = data.draw(st.integers(0, 3), "count")
    bs = data.draw(hnp.mutually_broadcastable_shapes(num_shapes=max(n, 1), max_dims=3, max_side=3), "shapes")
    shapes_ = bs.input_shapes[:n]
    check(peer, lambda c: c.ns.broadcast_shapes(*shapes_))
    check(peer, lambda c: c.ns.broadcast_shapes((2, 3), (4, 1, 1), (3,)))
    check(peer, lambda c: c.ns.broadcast_shapes((2, 3), (3, 1)))  # both refuse


@given_data
def test_eig_eigvals(peer: Peer, data: st.DataObject) -> None:
    """Complex results whatever the input; eigenvalues compared sorted, eigenvectors through A v = w v."""
    dt = data.draw(dtypes(peer, D.FLOAT), "dtype")
    batch = data.draw(st.sampled_from([(), (2,)]), "batch")
    n = data.draw(st.integers(1, 4), "n")
    a = data.draw(plain(dt, batch + (n, n), lo=-2, hi=2), "x")
    tol = {"rtol": 2e-3, "atol": 2e-3} if dt in (D.float32, D.complex64) else {"rtol": 1e-6, "atol": 1e-6}

    def values(w: Any) -> Any:
        return np.sort_complex(np.round(w.astype(np.complex128), 4)) if isinstance(w, np.ndarray) else w

    def residual(r: Any) -> Any:
        if not isinstance(r, tuple):
            return r
        w, v = r
        res = a.astype(np.complex128) @ v - v * w[..., None, :]
        return (values(w), np.asarray(np.abs(res).max() < 1e-2), w.dtype.name, v.dtype.name)

    check(peer, lambda c, x: c.ns.linalg.eigvals(x), a, post=values, **tol)
    check(peer, lambda c, x: tuple(c.ns.linalg.eig(x)), a, post=residual, **tol)


# ---- changes ---------------------------------------------------------------------------------------

@given_data
def test_expand_dims_tuple_permute_dims_negative(peer: Peer, data: st.DataObject) -> None:
    dt = data.draw(dtypes(peer), "dtype")
    x = data.draw(plain(dt, shapes(max_side=3)), "x")
    k = data.draw(st.integers(0, 3), "new axes")
    m = x.ndim + k
    axes = tuple(data.draw(st.lists(st.integers(-m, m - 1) if m else st.nothing(), min_size=k, max_size=k), "axes"))
    check(peer, lambda c, a: c.ns.expand_dims(a, axis=axes), x)
    check(peer, lambda c, a: c.ns.expand_dims(a, axis=(0, -m - 1)), x)  # out of range: both refuse
    perm = [p - x.ndim if data.draw(st.booleans()) else p for p in data.draw(st.permutations(range(x.ndim)), "perm")]
    check(peer, lambda c, a: c.ns.permute_dims(a, tuple(perm)), x)


@given_data
def test_searchsorted_scalar(peer: Peer, data: st.DataObject) -> None:
    """2025.12: a Python scalar ``x2`` is a 0-d array of the mixing rules' dtype (2024.12 refuses it)."""
    dt = data.draw(dtypes(peer, D.REAL_NUMERIC), "dtype")
    x1 = np.sort(data.draw(plain(dt, (data.draw(st.integers(0, 6)),), lo=-5, hi=5), "x1"))
    v = data.draw(st.integers(-6, 6) | (st.floats(-6, 6) if dt.kind == "f" else st.nothing()), "x2")
    side = data.draw(st.sampled_from(["left", "right"]), "side")
    check(peer, lambda c, a: c.ns.searchsorted(a, v, side=side), x1)


@given_data
def test_setitem_promotes_array_values(peer: Peer, data: st.DataObject) -> None:
    """2025.12: an array value is promoted to the target's dtype; one it cannot promote to is refused."""
    dt = data.draw(dtypes(peer), "dtype")
    vdt = data.draw(dtypes(peer), "value dtype")
    x = data.draw(plain(dt, (3, 2), lo=0, hi=50), "x")
    v = data.draw(plain(vdt, (2,), lo=0, hi=50), "value")
    mask = data.draw(hnp.arrays(np.bool_, (3, 2)), "mask")

    def assign(c: Any, a: Any, val: Any, m: Any) -> Any:
        a[1, :] = val
        a[m] = val[1]
        a[0:2, 1] = val[0]
        return a

    check(peer, assign, x, v, mask)


@given_data
def test_clip_scalar_bounds_promote(peer: Peer, data: st.DataObject) -> None:
    """Scalar bounds follow the rules for mixing scalars and arrays: ints clip floats, floats do not clip ints."""
    dt = data.draw(dtypes(peer, D.REAL_NUMERIC), "dtype")
    x = data.draw(plain(dt, shapes(), lo=0 if dt.kind == "u" else -60, hi=60), "x")
    lo, hi = sorted(data.draw(st.lists(st.integers(0 if dt.kind == "u" else -50, 50), min_size=2, max_size=2)))
    check(peer, lambda c, a: c.ns.clip(a, lo, hi), x)
    check(peer, lambda c, a: c.ns.clip(a, max=hi), x)
    check(peer, lambda c, a: c.ns.clip(a, float(lo), None), x)  # refused for integer arrays


def test_sequence_types_follow_the_revision(peer: Peer) -> None:
    """Tuples at 2025.12, lists at 2024.12: meshgrid, broadcast_arrays, the info object's devices()."""
    seq = tuple if peer.version >= "2025.12" else list
    a = peer.ns.asarray(np.arange(3.0), device=peer.dev)
    assert type(peer.ns.meshgrid(a, a)) is seq and type(peer.ns.broadcast_arrays(a, a[:1])) is seq
    devices = peer.ns.__array_namespace_info__().devices()
    assert type(devices) is seq and peer.dev in devices
    assert type(peer.oracle().__array_namespace_info__().devices()) is seq
    assert peer.ns.__array_namespace_info__().default_device() in devices
