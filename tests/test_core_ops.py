"""Every op of the core slice equals NumPy, over the in-memory link and real WebSocket."""

from __future__ import annotations

import numpy as np
import pytest

import ember.array_api as xp

rng = np.random.default_rng(0)
A = rng.standard_normal((3, 4)).astype(np.float32)
B = rng.standard_normal((3, 4)).astype(np.float32)
P = np.abs(A) + 0.5


def close(x, y, tol=1e-5):
    x = np.asarray(x)
    assert x.shape == np.shape(y), (x.shape, np.shape(y))
    assert x.dtype == np.asarray(y).dtype, (x.dtype, np.asarray(y).dtype)
    np.testing.assert_allclose(x, y, rtol=tol, atol=tol)


def test_creation(dev):
    close(xp.zeros((2, 3), device=dev).to_numpy(), np.zeros((2, 3)))
    close(xp.ones(4, dtype=xp.int32, device=dev), np.ones(4, dtype=np.int32))
    close(xp.full((2, 2), 7, device=dev), np.full((2, 2), 7))
    close(xp.full((2,), 1.5, dtype=xp.float32, device=dev), np.full((2,), 1.5, dtype=np.float32))
    assert xp.empty((2, 5), device=dev).shape == (2, 5)
    close(xp.arange(10, device=dev), np.arange(10))
    close(xp.arange(1.0, 2.0, 0.25, device=dev), np.arange(1.0, 2.0, 0.25))
    close(xp.linspace(0, 1, 5, device=dev), np.linspace(0, 1, 5))
    close(xp.eye(3, 4, k=1, device=dev), np.eye(3, 4, k=1))
    a = xp.asarray(A, device=dev)
    close(xp.zeros_like(a), np.zeros_like(A))
    close(xp.ones_like(a, dtype=xp.float64), np.ones_like(A, dtype=np.float64))
    close(xp.full_like(a, 3.0), np.full_like(A, 3.0))
    assert xp.empty_like(a).shape == A.shape
    close(xp.asarray([1, 2, 3], device=dev), np.asarray([1, 2, 3]))
    close(xp.asarray([[True, False]], device=dev), np.asarray([[True, False]]))


@pytest.mark.parametrize("name", ["exp", "log", "sqrt", "sin", "cos", "tanh", "abs", "negative", "square",
                                  "floor", "ceil", "round", "sign", "expm1", "log1p"])
def test_unary(dev, name):
    x = P if name in ("log", "sqrt", "log1p") else A
    close(getattr(xp, name)(xp.asarray(x, device=dev)), getattr(np, name)(x))


@pytest.mark.parametrize("name", ["add", "subtract", "multiply", "divide", "maximum", "minimum", "pow",
                                  "equal", "not_equal", "less", "less_equal", "greater", "greater_equal",
                                  "atan2", "hypot"])
def test_binary(dev, name):
    a, b = (P, P) if name == "pow" else (A, B)
    np_name = {"pow": "power"}.get(name, name)
    close(getattr(xp, name)(xp.asarray(a, device=dev), xp.asarray(b, device=dev)), getattr(np, np_name)(a, b))


def test_operators_scalars_and_reflection(dev):
    a, b = xp.asarray(A, device=dev), xp.asarray(B, device=dev)
    close(a + b, A + B)
    close(a - 2.0, A - np.float32(2.0))
    close(2.0 - a, np.float32(2.0) - A)
    close(3 * a, 3 * A)
    close(a / 4, A / np.float32(4))
    close(1.0 / (xp.abs(a) + 1), 1.0 / (np.abs(A) + np.float32(1)))
    close(-a, -A)
    close(a ** 2, A ** 2)
    close(a @ b.T, A @ B.T)
    close((a > 0) & (b < 0), (A > 0) & (B < 0))
    close(~(a > 0), ~(A > 0))
    i = xp.asarray(np.arange(6, dtype=np.int64), device=dev)
    close(i // 4, np.arange(6) // 4)
    close(i % 4, np.arange(6) % 4)
    close(i << 1, np.arange(6) << 1)
    close(5 - i, 5 - np.arange(6))


def test_logical_and_where(dev):
    a, b = xp.asarray(A, device=dev), xp.asarray(B, device=dev)
    close(xp.logical_and(a > 0, b > 0), np.logical_and(A > 0, B > 0))
    close(xp.logical_or(a > 0, b > 0), np.logical_or(A > 0, B > 0))
    close(xp.logical_not(a > 0), np.logical_not(A > 0))
    close(xp.where(a > 0, a, b), np.where(A > 0, A, B))
    close(xp.where(a > 0, a, 0.0), np.where(A > 0, A, np.float32(0)))
    with np.errstate(all="ignore"):
        close(xp.isnan(a / 0.0 * 0.0), np.isnan(A / np.float32(0) * np.float32(0)))


@pytest.mark.parametrize("name", ["sum", "prod", "mean", "min", "max", "std", "var"])
@pytest.mark.parametrize("axis", [None, 0, 1, (0, 1), -1])
@pytest.mark.parametrize("keepdims", [False, True])
def test_reductions(dev, name, axis, keepdims):
    got = getattr(xp, name)(xp.asarray(A, device=dev), axis=axis, keepdims=keepdims)
    want = getattr(np, name)(A, axis=axis, keepdims=keepdims)
    assert got.shape == np.shape(want)
    close(got, np.asarray(want, dtype=np.float32), tol=1e-4)


def test_reduction_dtypes(dev):
    i = xp.asarray(np.arange(6, dtype=np.int32), device=dev)
    s = xp.sum(i)
    assert s.dtype == xp.int64
    assert int(s) == 15
    assert xp.all(i >= 0) and not xp.any(i > 10)
    assert float(xp.std(xp.asarray(A, device=dev), correction=1)) == pytest.approx(float(np.std(A, ddof=1)), rel=1e-5)


def test_manipulation(dev):
    a = xp.asarray(A, device=dev)
    close(xp.reshape(a, (4, 3)), A.reshape(4, 3))
    close(xp.reshape(a, (-1,)), A.reshape(-1))
    close(xp.permute_dims(a, (1, 0)), A.T)
    close(xp.expand_dims(a, axis=1), np.expand_dims(A, 1))
    close(xp.squeeze(xp.expand_dims(a, axis=0), axis=0), A)
    close(xp.concat([a, a], axis=0), np.concatenate([A, A], 0))
    close(xp.concat([a, a], axis=None), np.concatenate([A.ravel(), A.ravel()]))
    close(xp.stack([a, a], axis=1), np.stack([A, A], 1))
    close(xp.flip(a, axis=1), np.flip(A, 1))
    close(xp.flip(a), np.flip(A))


def test_astype_promotion_and_attributes(dev):
    a = xp.asarray(A, device=dev)
    d = xp.astype(a, xp.float64)
    assert d.dtype == xp.float64
    close(d, A.astype(np.float64))
    assert (a + d).dtype == xp.float64
    i8 = xp.asarray(np.array([1, 2], dtype=np.int8), device=dev)
    u8 = xp.asarray(np.array([1, 2], dtype=np.uint8), device=dev)
    s = i8 + u8
    assert s.dtype == xp.int16
    close(s, np.array([2, 4], dtype=np.int16))
    with pytest.raises(TypeError):
        i8 + a  # int + float arrays: no promotion in the standard
    assert a.ndim == 2 and a.size == 12 and a.device is dev
    close(a.T, A.T)
    close(a.mT, A.T)
    assert a.__array_namespace__() is xp
    assert xp.result_type(xp.int8, xp.uint8) == xp.int16


def test_slicing_and_reads(dev):
    a = xp.asarray(A, device=dev)
    close(a[1], A[1])
    close(a[:, 1:3], A[:, 1:3])
    close(a[::-1, ::2], A[::-1, ::2])
    close(a[None, 1, ...], A[None, 1, ...])
    close(a[-1, -1], A[-1, -1])
    assert float(a[0, 0]) == pytest.approx(float(A[0, 0]))
    assert int(xp.asarray(np.array([7]), device=dev)) == 7
    assert bool(xp.asarray(np.array(True), device=dev)) is True
    np.testing.assert_array_equal(np.asarray(a), A)
    with pytest.raises(IndexError):
        a[5]
    with pytest.raises(TypeError):
        bool(a)


def test_setitem_and_inplace_keep_identity(dev):
    a = xp.asarray(A.copy(), device=dev)
    ident = id(a)
    a[0, :] = 0.0
    a += 1.0
    a *= xp.asarray(B, device=dev)
    want = A.copy()
    want[0, :] = 0
    want = (want + 1) * B
    assert id(a) == ident
    close(a, want)


def test_default_device_and_with(dev):
    import ember
    with dev:
        x = xp.ones(3)
    assert x.device is dev
    ember.set_default_device(dev)
    try:
        assert xp.zeros(2).device is dev
    finally:
        ember.set_default_device(None)


def test_mixing_devices_is_a_clear_error(dev, server):
    import ember
    other = ember.connect(server.addresses[0])
    try:
        a = xp.ones(3, device=dev)
        b = xp.ones(3, device=other)
        with pytest.raises(ValueError, match="different devices"):
            a + b
        close(b.to_device(dev) + a, np.full(3, 2.0))
    finally:
        other.close()


def test_big_upload_and_read_are_chunked(server):
    import ember
    from ember.server import Server
    srv = Server(["cpu"], max_frame=1 << 20, chunk=256 << 10)
    srv.listen_websocket("127.0.0.1", 0)
    srv.start_in_thread()
    try:
        d = ember.connect(srv.addresses[0])
        big = rng.standard_normal(1_000_003)  # ~8 MB, odd size: many chunks each way
        x = xp.asarray(big, device=d)
        np.testing.assert_array_equal((x * 2.0).to_numpy(), big * 2.0)
        assert d.stats()["bytes_received"] > big.nbytes
        d.close()
    finally:
        srv.close()
