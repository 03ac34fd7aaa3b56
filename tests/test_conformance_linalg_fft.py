"""Conformance against array-api-strict: the ``linalg`` and ``fft`` extensions and the main
namespace's linear algebra (the harness lives in ``test_conformance``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ember.array_api import _dtypes as D
from test_conformance import Peer, check, dtypes, given_data, peer, plain, shapes  # noqa: F401

pytestmark = [pytest.mark.filterwarnings("ignore::RuntimeWarning"), pytest.mark.timeout(300)]  # JAX compiles


def tol(dt: D.DType) -> dict[str, float]:
    return {"rtol": 2e-3, "atol": 2e-3} if dt in (D.float32, D.complex64) else {"rtol": 1e-8, "atol": 1e-8}


def matrices(data: st.DataObject, peer: Peer, square: bool = True, min_n: int = 1) -> tuple[D.DType, np.ndarray]:
    """A (possibly batched) float matrix with entries in [-2, 2]."""
    dt = data.draw(dtypes(peer, D.FLOAT), "dtype")
    batch = data.draw(st.sampled_from([(), (2,)]), "batch")
    m = data.draw(st.integers(min_n, 4), "rows")
    n = m if square else data.draw(st.integers(min_n, 4), "cols")
    a = data.draw(plain(dt, batch + (m, n), lo=-2, hi=2), "x")
    return dt, np.asarray(np.where(np.abs(a) < 1e-3, np.zeros_like(a), a))  # no ill-conditioning from tiny entries


def _h(a: np.ndarray) -> np.ndarray:
    return np.conj(np.swapaxes(a, -1, -2))


def _well_conditioned(a: np.ndarray) -> np.ndarray:
    n = a.shape[-1]
    return (a + 3 * n * np.eye(n, dtype=a.dtype)).astype(a.dtype)


# ---- main-namespace linear algebra -----------------------------------------------------------

@given_data
def test_matmul_tensordot_vecdot(peer: Peer, data: st.DataObject) -> None:
    dt = data.draw(dtypes(peer, D.NUMERIC), "dtype")
    bs = data.draw(hnp.mutually_broadcastable_shapes(signature="(m,n),(n,p)->(m,p)", max_side=3), "shapes")
    a, b = data.draw(plain(dt, bs.input_shapes[0], lo=-5, hi=5)), data.draw(plain(dt, bs.input_shapes[1], lo=-5, hi=5))
    check(peer, lambda c, x, y: c.ns.matmul(x, y), a, b, **tol(dt))
    check(peer, lambda c, x, y: x @ y, a, b, **tol(dt))
    check(peer, lambda c, x: c.ns.matrix_transpose(x), a)
    check(peer, lambda c, x: x.mT, a)
    v = data.draw(plain(dt, a.shape[-1:], lo=-5, hi=5), "vector")
    check(peer, lambda c, x, y: c.ns.matmul(x, y), a, v, **tol(dt))
    check(peer, lambda c, x, y: c.ns.vecdot(x, y), a, v, **tol(dt))
    check(peer, lambda c, x, y: c.ns.linalg.vecdot(x, y, axis=-1), a, a, **tol(dt))
    k = data.draw(st.integers(0, min(a.ndim, 2)), "axes")
    b2 = data.draw(plain(dt, a.shape[a.ndim - k:] + (2,), lo=-5, hi=5), "b2")
    check(peer, lambda c, x, y: c.ns.tensordot(x, y, axes=k), a, b2, **tol(dt))
    b3 = np.ascontiguousarray(np.swapaxes(a, 0, -1))
    check(peer, lambda c, x, y: c.ns.tensordot(x, y, axes=([a.ndim - 1], [0])), a, b3, **tol(dt))


# ---- linalg extension -------------------------------------------------------------------------

@given_data
def test_linalg_square(peer: Peer, data: st.DataObject) -> None:
    dt, a = matrices(data, peer)
    w = _well_conditioned(a)
    t = tol(dt)
    check(peer, lambda c, x: c.ns.linalg.det(x), w, **t)
    check(peer, lambda c, x: c.ns.linalg.inv(x), w, **t)
    check(peer, lambda c, x: tuple(c.ns.linalg.slogdet(x)), w, **t)
    p = data.draw(st.integers(-2, 3), "power")
    check(peer, lambda c, x: c.ns.linalg.matrix_power(x, p), w, **t)
    b = data.draw(plain(dt, a.shape[:-1] + (2,), lo=-2, hi=2), "b")
    check(peer, lambda c, x, y: c.ns.linalg.solve(x, y), w, b, **t)
    spd = (a @ _h(a) + a.shape[-1] * np.eye(a.shape[-1], dtype=a.dtype)).astype(a.dtype)
    upper = data.draw(st.booleans(), "upper")
    check(peer, lambda c, x: c.ns.linalg.cholesky(x, upper=upper), spd, **t)
    herm = ((a + _h(a)) / 2).astype(a.dtype)
    check(peer, lambda c, x: c.ns.linalg.eigvalsh(x), herm, **t)
    check(peer, lambda c, x: tuple(c.ns.linalg.eigh(x)), herm,
          post=lambda r: (r[0], (r[1] * r[0][..., None, :]) @ _h(r[1])), **t)
    off = data.draw(st.integers(-2, 2), "offset")
    check(peer, lambda c, x: c.ns.linalg.diagonal(x, offset=off), a)
    check(peer, lambda c, x: c.ns.linalg.trace(x, offset=off), a, **t)


@given_data
def test_linalg_rectangular(peer: Peer, data: st.DataObject) -> None:
    dt, a = matrices(data, peer, square=False)
    t = tol(dt)
    full = data.draw(st.booleans(), "full_matrices")

    def usv(r: Any) -> Any:
        u, s, vh = r
        k = s.shape[-1]
        return (s, (u[..., :, :k] * s[..., None, :]) @ vh[..., :k, :], u.shape, vh.shape)

    check(peer, lambda c, x: tuple(c.ns.linalg.svd(x, full_matrices=full)), a, post=usv, **t)
    check(peer, lambda c, x: c.ns.linalg.svdvals(x), a, **t)
    mode = data.draw(st.sampled_from(["reduced", "complete"]), "mode")
    check(peer, lambda c, x: tuple(c.ns.linalg.qr(x, mode=mode)), a,
          post=lambda r: (r[0] @ r[1], r[0].shape, r[1].shape), **t)
    check(peer, lambda c, x: c.ns.linalg.pinv(x), a, **{k: v * 10 for k, v in t.items()})
    check(peer, lambda c, x: c.ns.linalg.matrix_rank(x), a)
    ord_ = data.draw(st.sampled_from(["fro", "nuc", 1, -1, 2, -2, np.inf, -np.inf]), "ord")
    kd = data.draw(st.booleans(), "keepdims")
    check(peer, lambda c, x: c.ns.linalg.matrix_norm(x, ord=ord_, keepdims=kd), a, **t)


@given_data
def test_linalg_vectors(peer: Peer, data: st.DataObject) -> None:
    dt = data.draw(dtypes(peer, D.FLOAT), "dtype")
    x = data.draw(plain(dt, shapes(min_side=1), lo=-3, hi=3), "x")
    t = tol(dt)
    ax = data.draw(st.one_of(st.none(), st.integers(-x.ndim, x.ndim - 1) if x.ndim else st.none()), "axis")
    ord_ = data.draw(st.sampled_from([2, 1, np.inf, -np.inf, 0, 3]), "ord")
    kd = data.draw(st.booleans(), "keepdims")
    check(peer, lambda c, a: c.ns.linalg.vector_norm(a, axis=ax, ord=ord_, keepdims=kd), x, **t)
    u, v = data.draw(plain(dt, (3,), lo=-3, hi=3), "u"), data.draw(plain(dt, (2, 3), lo=-3, hi=3), "v")
    check(peer, lambda c, a, b: c.ns.linalg.cross(a, b), u, v, **t)
    check(peer, lambda c, a, b: c.ns.linalg.outer(a, b), u, v[0], **t)


# ---- fft extension -----------------------------------------------------------------------------

NORMS = st.sampled_from(["backward", "ortho", "forward"])


@pytest.mark.parametrize("name", ["fft", "ifft", "rfft", "irfft", "hfft", "ihfft"])
@given_data
def test_fft_1d(peer: Peer, name: str, data: st.DataObject) -> None:
    kinds = D.REAL_FLOAT if name in ("rfft", "ihfft") else D.COMPLEX
    dt = data.draw(dtypes(peer, kinds), "dtype")
    x = data.draw(plain(dt, shapes(min_dims=1, min_side=2), lo=-3, hi=3), "x")
    ax = data.draw(st.integers(-x.ndim, x.ndim - 1), "axis")
    n = data.draw(st.one_of(st.none(), st.integers(2, 6)), "n")
    norm = data.draw(NORMS, "norm")
    check(peer, lambda c, a: getattr(c.ns.fft, name)(a, n=n, axis=ax, norm=norm), x, **tol(dt))


@pytest.mark.parametrize("name", ["fftn", "ifftn", "rfftn", "irfftn"])
@given_data
def test_fft_nd(peer: Peer, name: str, data: st.DataObject) -> None:
    kinds = D.REAL_FLOAT if name == "rfftn" else D.COMPLEX
    dt = data.draw(dtypes(peer, kinds), "dtype")
    x = data.draw(plain(dt, shapes(min_dims=1, min_side=2), lo=-3, hi=3), "x")
    axes = data.draw(st.one_of(st.none(), st.lists(st.integers(0, x.ndim - 1), min_size=1, unique=True)), "axes")
    s = None
    if data.draw(st.booleans(), "with s"):
        k = len(axes) if axes is not None else x.ndim
        s = data.draw(st.lists(st.integers(2, 5), min_size=k, max_size=k), "s")
    norm = data.draw(NORMS, "norm")
    check(peer, lambda c, a: getattr(c.ns.fft, name)(a, s=s, axes=axes, norm=norm), x, **tol(dt))


@given_data
def test_fft_helpers(peer: Peer, data: st.DataObject) -> None:
    n = data.draw(st.integers(1, 9), "n")
    dspace = data.draw(st.sampled_from([1.0, 0.5, 2.0]), "d")
    dt = data.draw(dtypes(peer, D.REAL_FLOAT), "dtype")
    check(peer, lambda c: c.ns.fft.fftfreq(n, d=dspace, dtype=c.dtype(dt), **c.dev), **tol(dt))
    check(peer, lambda c: c.ns.fft.rfftfreq(n, d=dspace, **c.dev))
    x = data.draw(plain(dt, shapes(min_dims=1)), "x")
    axes = data.draw(st.one_of(st.none(), st.integers(0, x.ndim - 1)), "axes")
    check(peer, lambda c, a: c.ns.fft.fftshift(a, axes=axes), x)
    check(peer, lambda c, a: c.ns.fft.ifftshift(a, axes=axes), x)
