"""Conformance against array-api-strict: creation, data types, manipulation, searching, sets,
sorting, statistics and utilities (the harness lives in ``test_conformance``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ember.array_api import _dtypes as D
from test_conformance import (Ctx, Peer, arrays, check, dtype_name, dtypes, given_data, peer, plain,  # noqa: F401
                              shapes)

pytestmark = [pytest.mark.filterwarnings("ignore::RuntimeWarning"), pytest.mark.timeout(300)]  # JAX compiles


def axis_of(ndim: int) -> st.SearchStrategy:
    return st.integers(-ndim, ndim - 1) if ndim else st.nothing()


def axes_of(ndim: int) -> st.SearchStrategy:
    """None, one axis, or a tuple of distinct axes."""
    if not ndim:
        return st.just(None)
    return st.one_of(st.none(), axis_of(ndim),
                     st.lists(st.integers(0, ndim - 1), unique=True, max_size=ndim).map(tuple))


def tol(peer: Peer, dt: D.DType) -> dict[str, float]:
    """Reductions: summation order differs between backends."""
    if dt in (D.float32, D.complex64):
        return {"rtol": 1e-4, "atol": 1e-2}
    if dt.kind in "fc":
        return {"rtol": 1e-9, "atol": 1e-8}
    return {}


# ---- creation -------------------------------------------------------------------------------

@given_data
def test_arange(peer: Peer, data: st.DataObject) -> None:
    if data.draw(st.booleans(), "float"):
        start, stop = data.draw(st.floats(-20, 20)), data.draw(st.floats(-20, 20))
        step = data.draw(st.sampled_from([0.5, 1.0, -0.75, 2.5, -3.0]))
        dt = data.draw(st.sampled_from([None, D.float32, D.float64]))
    else:
        start, stop = data.draw(st.integers(-20, 20)), data.draw(st.integers(-20, 20))
        step = data.draw(st.sampled_from([1, 2, -1, -3, 5]))
        dt = data.draw(st.sampled_from([None, D.int32, D.int64, D.float64]))
    kw = {} if dt is None else {"dtype": dt.name}
    check(peer, lambda c: c.ns.arange(start, stop, step, **{k: c.dtype(v) for k, v in kw.items()}, **c.dev))


@given_data
def test_linspace_eye_full(peer: Peer, data: st.DataObject) -> None:
    num = data.draw(st.integers(0, 7), "num")
    endpoint = data.draw(st.booleans(), "endpoint")
    cplx = data.draw(st.booleans(), "complex")
    a, b = data.draw(st.floats(-10, 10), "start"), data.draw(st.floats(-10, 10), "stop")
    if cplx:
        a, b = complex(a, 1.0), complex(b, -2.0)
    check(peer, lambda c: c.ns.linspace(a, b, num, endpoint=endpoint, **c.dev))
    dt = data.draw(dtypes(peer), "dtype")
    n, m, k = data.draw(st.integers(0, 4)), data.draw(st.integers(0, 4)), data.draw(st.integers(-3, 3))
    check(peer, lambda c: c.ns.eye(n, m, k=k, dtype=c.dtype(dt), **c.dev))
    shape = data.draw(shapes(), "shape")
    fill = data.draw(st.sampled_from([True, 3, -2.5, 1 + 2j]), "fill")
    check(peer, lambda c: c.ns.full(shape, fill, **c.dev))
    check(peer, lambda c: c.ns.zeros(shape, dtype=c.dtype(dt), **c.dev))
    check(peer, lambda c: c.ns.ones(shape, dtype=c.dtype(dt), **c.dev))
    check(peer, lambda c: c.ns.empty(shape, dtype=c.dtype(dt), **c.dev).shape)


@given_data
def test_like_functions(peer: Peer, data: st.DataObject) -> None:
    dt = data.draw(dtypes(peer), "dtype")
    x = data.draw(plain(dt, shapes()), "x")
    dt2 = data.draw(st.one_of(st.none(), dtypes(peer)), "dtype2")
    kw = (lambda c: {}) if dt2 is None else (lambda c: {"dtype": c.dtype(dt2)})
    check(peer, lambda c, a: c.ns.zeros_like(a, **kw(c)), x)
    check(peer, lambda c, a: c.ns.ones_like(a, **kw(c)), x)
    check(peer, lambda c, a: (lambda r: (r.shape, dtype_name(r.dtype)))(c.ns.empty_like(a, **kw(c))), x)
    fill = {"b": True, "i": 7, "u": 7, "f": 1.5, "c": 1.5 - 1j}[(dt2 or dt).kind]
    check(peer, lambda c, a: c.ns.full_like(a, fill, **kw(c)), x)


@given_data
def test_meshgrid_tril_triu(peer: Peer, data: st.DataObject) -> None:
    dt = data.draw(dtypes(peer, D.NUMERIC), "dtype")
    n = data.draw(st.integers(1, 3), "count")
    xs_ = [data.draw(plain(dt, (data.draw(st.integers(0, 4)),)), f"x{i}") for i in range(n)]
    indexing = data.draw(st.sampled_from(["xy", "ij"]), "indexing")
    check(peer, lambda c, *a: c.ns.meshgrid(*a, indexing=indexing), *xs_)
    x = data.draw(plain(dt, shapes(min_dims=2)), "x")
    k = data.draw(st.integers(-3, 3), "k")
    check(peer, lambda c, a: c.ns.tril(a, k=k), x)
    check(peer, lambda c, a: c.ns.triu(a, k=k), x)


@given_data
def test_asarray(peer: Peer, data: st.DataObject) -> None:
    obj = data.draw(st.one_of(st.booleans(), st.integers(-1000, 1000), st.floats(-1e6, 1e6),
                              st.lists(st.integers(-5, 5), max_size=4),
                              st.lists(st.lists(st.floats(-5, 5), min_size=2, max_size=2), max_size=3)), "obj")
    dt = data.draw(st.one_of(st.none(), dtypes(peer, D.REAL_FLOAT)), "dtype")
    kw = (lambda c: {}) if dt is None else (lambda c: {"dtype": c.dtype(dt)})
    check(peer, lambda c: c.ns.asarray(obj, **kw(c), **c.dev))
    x = data.draw(plain(data.draw(dtypes(peer)), shapes()), "x")
    check(peer, lambda c, a: c.ns.asarray(a, copy=True), x)
    check(peer, lambda c, a: c.ns.from_dlpack(np.array(a) if c.dev else a, **c.dev), x)


# ---- data types ----------------------------------------------------------------------------

@given_data
def test_astype(peer: Peer, data: st.DataObject) -> None:
    src, dst = data.draw(dtypes(peer), "from"), data.draw(dtypes(peer), "to")
    lo = 0 if dst.kind == "u" else -100
    x = data.draw(plain(src, shapes(), lo=lo, hi=100), "x")
    copy = data.draw(st.booleans(), "copy")
    check(peer, lambda c, a: c.ns.astype(a, c.dtype(dst), copy=copy), x)


def test_dtype_functions(peer: Peer) -> None:
    for t1 in peer.dtypes:
        for t2 in peer.dtypes:
            check(peer, lambda c: c.ns.can_cast(c.dtype(t1), c.dtype(t2)))
            check(peer, lambda c: dtype_name(c.ns.result_type(c.dtype(t1), c.dtype(t2))))
        for kind in ("bool", "signed integer", "unsigned integer", "integral", "real floating",
                     "complex floating", "numeric", ("bool", "real floating")):
            check(peer, lambda c: c.ns.isdtype(c.dtype(t1), kind))
        if t1.kind in "fc":
            check(peer, lambda c: (lambda f: (f.bits, f.eps, f.max, f.min, f.smallest_normal, dtype_name(f.dtype)))(
                c.ns.finfo(c.dtype(t1))))
        if t1.kind in "iu":
            check(peer, lambda c: (lambda i: (i.bits, i.max, i.min, dtype_name(i.dtype)))(c.ns.iinfo(c.dtype(t1))))
        for sc in (True, 1, 2.5, 1j):
            check(peer, lambda c: dtype_name(c.ns.result_type(c.dtype(t1), sc)))


# ---- manipulation -----------------------------------------------------------------------------

@given_data
def test_broadcast(peer: Peer, data: st.DataObject) -> None:
    bs = data.draw(hnp.mutually_broadcastable_shapes(num_shapes=3, max_dims=3, max_side=3), "shapes")
    dt = data.draw(dtypes(peer), "dtype")
    a, b, c_ = (data.draw(plain(dt, s)) for s in bs.input_shapes)
    check(peer, lambda c, *x: c.ns.broadcast_arrays(*x), a, b, c_)
    check(peer, lambda c, x: c.ns.broadcast_to(x, bs.result_shape), a)


@given_data
def test_reshape_permute_squeeze(peer: Peer, data: st.DataObject) -> None:
    dt = data.draw(dtypes(peer), "dtype")
    x = data.draw(plain(dt, shapes(max_side=3)), "x")
    nd = x.ndim
    target = data.draw(st.sampled_from([(x.size,), (-1,), (1, x.size), (x.size, 1, 1), x.shape[::-1]]), "shape")
    check(peer, lambda c, a: c.ns.reshape(a, target), x)
    perm = data.draw(st.permutations(list(range(nd))), "perm")
    check(peer, lambda c, a: c.ns.permute_dims(a, tuple(perm)), x)
    ax = data.draw(st.integers(-nd - 1, nd), "expand axis")
    check(peer, lambda c, a: c.ns.expand_dims(a, axis=ax), x)
    ones = tuple(i for i, n in enumerate(x.shape) if n == 1)
    if ones:
        check(peer, lambda c, a: c.ns.squeeze(a, axis=ones), x)
    if nd:
        src, dst = data.draw(axis_of(nd), "source"), data.draw(axis_of(nd), "destination")
        check(peer, lambda c, a: c.ns.moveaxis(a, src, dst), x)
        fl = data.draw(axes_of(nd), "flip axes")
        check(peer, lambda c, a: c.ns.flip(a, axis=fl), x)
        sh = data.draw(st.integers(-5, 5), "shift")
        rax = data.draw(st.one_of(st.none(), axis_of(nd)), "roll axis")
        check(peer, lambda c, a: c.ns.roll(a, sh, axis=rax), x)
        uax = data.draw(axis_of(nd), "unstack axis")
        check(peer, lambda c, a: c.ns.unstack(a, axis=uax), x)


@given_data
def test_concat_stack(peer: Peer, data: st.DataObject) -> None:
    dt1 = data.draw(dtypes(peer), "dtype1")
    dt2 = data.draw(st.sampled_from([t for t in peer.dtypes if (dt1, t) in D.PROMOTION]), "dtype2")
    shape = data.draw(shapes(min_dims=1, max_side=3), "shape")
    ax = data.draw(st.integers(-len(shape), len(shape) - 1), "axis")
    other = tuple(n + 1 if i == ax % len(shape) else n for i, n in enumerate(shape))
    a, b = data.draw(plain(dt1, shape), "a"), data.draw(plain(dt2, other), "b")
    check(peer, lambda c, x, y: c.ns.concat([x, y], axis=ax), a, b)
    check(peer, lambda c, x, y: c.ns.concat((x, y), axis=None), a, b)
    b2 = data.draw(plain(dt2, shape), "b2")
    sax = data.draw(st.integers(-len(shape) - 1, len(shape)), "stack axis")
    check(peer, lambda c, x, y: c.ns.stack([x, y], axis=sax), a, b2)


@given_data
def test_repeat_tile(peer: Peer, data: st.DataObject) -> None:
    dt = data.draw(dtypes(peer), "dtype")
    x = data.draw(plain(dt, shapes(max_side=3)), "x")
    ax = data.draw(st.one_of(st.none(), axis_of(x.ndim)), "axis")
    r = data.draw(st.integers(0, 3), "repeats")
    check(peer, lambda c, a: c.ns.repeat(a, r, axis=ax), x)
    n = x.size if ax is None else x.shape[ax]
    reps = np.asarray(data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n), "repeat array"), dtype=np.int64)
    check(peer, lambda c, a, rr: c.ns.repeat(a, rr, axis=ax), x, reps)
    t = tuple(data.draw(st.lists(st.integers(0, 3), max_size=4), "tile"))
    check(peer, lambda c, a: c.ns.tile(a, t), x)


# ---- searching -----------------------------------------------------------------------------------

@given_data
def test_argmax_argmin(peer: Peer, data: st.DataObject) -> None:
    dt = data.draw(dtypes(peer, D.REAL_NUMERIC), "dtype")
    x = data.draw(arrays(dt, shapes(min_side=1)) if dt.kind == "f" else plain(dt, shapes(min_side=1)), "x")
    ax = data.draw(st.one_of(st.none(), axis_of(x.ndim)), "axis")
    kd = data.draw(st.booleans(), "keepdims")
    check(peer, lambda c, a: c.ns.argmax(a, axis=ax, keepdims=kd), x)
    check(peer, lambda c, a: c.ns.argmin(a, axis=ax, keepdims=kd), x)


@given_data
def test_count_nonzero_nonzero_where(peer: Peer, data: st.DataObject) -> None:
    dt = data.draw(dtypes(peer), "dtype")
    x = data.draw(arrays(dt, shapes(), lo=-2, hi=2) if dt.kind in "iu"
                  else arrays(dt, shapes()), "x")
    ax = data.draw(axes_of(x.ndim), "axis")
    kd = data.draw(st.booleans(), "keepdims")
    check(peer, lambda c, a: c.ns.count_nonzero(a, axis=ax, keepdims=kd), x)
    if x.ndim:
        check(peer, lambda c, a: c.ns.nonzero(a), x)
    cond = data.draw(arrays(D.bool, x.shape[1:]), "cond")
    y = data.draw(plain(dt, x.shape[-1:] if x.ndim else ()), "y")
    check(peer, lambda c, k, a, b: c.ns.where(k, a, b), cond, x, y)
    sc = {"b": False, "i": 1, "u": 1, "f": 0.5, "c": 0.5j}[dt.kind]
    check(peer, lambda c, k, a: c.ns.where(k, a, sc), cond, x)
    check(peer, lambda c, k, a: c.ns.where(k, sc, a), cond, x)


@given_data
def test_searchsorted(peer: Peer, data: st.DataObject) -> None:
    dt = data.draw(dtypes(peer, D.REAL_NUMERIC), "dtype")
    x1 = np.sort(data.draw(plain(dt, (data.draw(st.integers(0, 6)),)), "x1"))
    x2 = data.draw(plain(dt, shapes(max_dims=2)), "x2")
    side = data.draw(st.sampled_from(["left", "right"]), "side")
    check(peer, lambda c, a, v: c.ns.searchsorted(a, v, side=side), x1, x2)
    order = np.argsort(x1[::-1], kind="stable").astype(np.int64)
    check(peer, lambda c, a, v, s: c.ns.searchsorted(a, v, side=side, sorter=s), np.ascontiguousarray(x1[::-1]),
          x2, order)


# ---- sets -----------------------------------------------------------------------------------------

@given_data
def test_unique(peer: Peer, data: st.DataObject) -> None:
    dt = data.draw(dtypes(peer, D.REAL_NUMERIC), "dtype")
    x = data.draw(arrays(dt, shapes(max_side=4), lo=-3, hi=3, special=False), "x")
    check(peer, lambda c, a: c.ns.unique_values(a), x, post=np.sort)
    check(peer, lambda c, a: tuple(c.ns.unique_counts(a)), x,
          post=lambda r: tuple(p[np.argsort(r[0], kind="stable")] for p in r))
    check(peer, lambda c, a: tuple(c.ns.unique_inverse(a)), x,
          post=lambda r: (np.sort(r[0]), r[0][r[1]]))
    check(peer, lambda c, a: tuple(c.ns.unique_all(a)), x,
          post=lambda r: (np.sort(r[0]), r[1][np.argsort(r[0])], r[0][r[2]], r[3][np.argsort(r[0])]))


# ---- sorting ------------------------------------------------------------------------------------------

@given_data
def test_sort_argsort(peer: Peer, data: st.DataObject) -> None:
    dt = data.draw(dtypes(peer, D.REAL_NUMERIC), "dtype")
    x = data.draw(arrays(dt, shapes(min_dims=1)) if dt.kind == "f" and data.draw(st.booleans(), "specials")
                  else arrays(dt, shapes(min_dims=1), lo=-3, hi=3, special=False), "x")
    ax = data.draw(axis_of(x.ndim), "axis")
    desc = data.draw(st.booleans(), "descending")
    check(peer, lambda c, a: c.ns.sort(a, axis=ax, descending=desc), x)
    check(peer, lambda c, a: c.ns.argsort(a, axis=ax, descending=desc, stable=True), x)


# ---- statistics and utilities -------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["sum", "prod", "mean", "min", "max", "std", "var", "all", "any"])
@given_data
def test_reduction(peer: Peer, name: str, data: st.DataObject) -> None:
    dt = data.draw(dtypes(peer), "dtype")
    x = data.draw(plain(dt, shapes(min_side=1), lo=-10, hi=10), "x")
    ax = data.draw(axes_of(x.ndim), "axis")
    kw: dict[str, Any] = {"axis": ax, "keepdims": data.draw(st.booleans(), "keepdims")}
    if name in ("std", "var"):
        kw["correction"] = data.draw(st.sampled_from([0, 1, 0.5, 0.0]), "correction")
    if name in ("sum", "prod") and data.draw(st.booleans(), "with dtype"):
        out = data.draw(st.sampled_from([t for t in peer.dtypes if (dt, t) in D.PROMOTION and D.PROMOTION[dt, t] is t]),
                        "out dtype")
        check(peer, lambda c, a: getattr(c.ns, name)(a, dtype=c.dtype(out), **kw), x, **tol(peer, out))
        return
    check(peer, lambda c, a: getattr(c.ns, name)(a, **kw), x, **tol(peer, dt))


@pytest.mark.parametrize("name", ["cumulative_sum", "cumulative_prod"])
@given_data
def test_cumulative(peer: Peer, name: str, data: st.DataObject) -> None:
    dt = data.draw(dtypes(peer, D.NUMERIC), "dtype")
    x = data.draw(plain(dt, shapes(min_dims=1, max_dims=2), lo=-3, hi=3), "x")
    ax = data.draw(axis_of(x.ndim), "axis") if x.ndim > 1 else data.draw(st.sampled_from([None, 0, -1]), "axis")
    inc = data.draw(st.booleans(), "include_initial")
    check(peer, lambda c, a: getattr(c.ns, name)(a, axis=ax, include_initial=inc), x, **tol(peer, dt))


@given_data
def test_diff(peer: Peer, data: st.DataObject) -> None:
    dt = data.draw(dtypes(peer, D.NUMERIC), "dtype")
    x = data.draw(plain(dt, shapes(min_dims=1)), "x")
    ax = data.draw(axis_of(x.ndim), "axis")
    n = data.draw(st.integers(0, 3), "n")
    check(peer, lambda c, a: c.ns.diff(a, axis=ax, n=n), x, **tol(peer, dt))
    edge = tuple(1 if i == ax % x.ndim else s for i, s in enumerate(x.shape))
    p, q = data.draw(plain(dt, edge), "prepend"), data.draw(plain(dt, edge), "append")
    check(peer, lambda c, a, b, e: c.ns.diff(a, axis=ax, n=n, prepend=b, append=e), x, p, q, **tol(peer, dt))
