"""``x[key]`` and ``x[key] = v`` against NumPy's semantics, on NumPy and torch peers.

The oracle here is NumPy itself: the standard requires only a subset of NumPy indexing
(which array-api-strict enforces), and Ember accepts more. Shapes must be known without
a round trip except where they depend on data (boolean masks) or on backend layout
conventions (array indices split by slices, or mixed with None).
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import ember.array_api as xp
from ember.array_api import _dtypes as D
from ember.protocol import messages as m
from test_conformance import Peer, compare, dtypes, given_data, peer, plain, shapes  # noqa: F401

pytestmark = [pytest.mark.filterwarnings("ignore::RuntimeWarning"), pytest.mark.timeout(300)]  # JAX compiles


class Requests:
    """Counts the SHAPE round trips a block of code makes."""

    def __init__(self, dev: Any) -> None:
        self.session = dev.session
        self.count = 0

    def __enter__(self) -> "Requests":
        orig = self.session.request

        def counting(kind: int, *a: Any, **k: Any) -> Any:
            if kind == m.SHAPE:
                self.count += 1
            return orig(kind, *a, **k)

        self.session.request = counting  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        del self.session.request


def remote(peer: Peer, a: np.ndarray) -> xp.Array:
    return xp.asarray(a, device=peer.dev)


def ekey(peer: Peer, key: Any) -> Any:
    """The key with its NumPy arrays uploaded."""
    t = key if isinstance(key, tuple) else (key,)
    out = tuple(remote(peer, k) if isinstance(k, np.ndarray) else k for k in t)
    return out if isinstance(key, tuple) else out[0]


@given_data
def test_basic_indexing(peer: Peer, data: st.DataObject) -> None:
    dt = data.draw(dtypes(peer), "dtype")
    a = data.draw(plain(dt, shapes(max_dims=4)), "x")
    key = data.draw(hnp.basic_indices(a.shape, allow_newaxis=True, allow_ellipsis=True), "key")
    x = remote(peer, a)
    with Requests(peer.dev) as r:
        y = x[key]
    assert r.count == 0, "basic indexing must not ask the peer for a shape"
    compare(y.to_numpy(), np.asarray(a[key]))


@st.composite
def advanced_keys(draw: Any, shape: tuple[int, ...]) -> tuple[Any, ...]:
    """Slices around a run of adjacent integer-array (or int) indices."""
    n = len(shape)
    start = draw(st.integers(0, n - 1))
    stop = draw(st.integers(start + 1, n))
    bshape = draw(hnp.array_shapes(min_dims=0, max_dims=2, max_side=3))
    key: list[Any] = []
    for i, size in enumerate(shape):
        if start <= i < stop:
            if draw(st.booleans()) or i == start:
                key.append(draw(hnp.arrays(np.int64, bshape, elements=st.integers(-size, size - 1))))
            else:
                key.append(draw(st.integers(-size, size - 1)))
        else:
            key.append(draw(st.slices(size)))
    return tuple(key)


@given_data
def test_integer_array_indexing(peer: Peer, data: st.DataObject) -> None:
    dt = data.draw(dtypes(peer), "dtype")
    a = data.draw(plain(dt, shapes(min_dims=1, max_dims=3, min_side=1)), "x")
    key = data.draw(advanced_keys(a.shape), "key")
    x = remote(peer, a)
    k = ekey(peer, key)
    with Requests(peer.dev) as r:
        y = x[k]
    assert r.count == 0, "adjacent integer-array indices need no round trip"
    compare(y.to_numpy(), np.asarray(a[key]))


@given_data
def test_split_array_indices(peer: Peer, data: st.DataObject) -> None:
    """Array indices split by a slice: NumPy puts the broadcast dims first; one round trip."""
    a = data.draw(plain(D.float64, shapes(min_dims=3, max_dims=3, min_side=1)), "x")
    i = data.draw(hnp.arrays(np.int64, (2,), elements=st.integers(0, a.shape[0] - 1)), "i")
    j = data.draw(hnp.arrays(np.int64, (2,), elements=st.integers(0, a.shape[2] - 1)), "j")
    x = remote(peer, a)
    with Requests(peer.dev) as r:
        y = x[remote(peer, i), :, remote(peer, j)]
    assert r.count == 1
    compare(y.to_numpy(), a[i, :, j])


@given_data
def test_boolean_mask_indexing(peer: Peer, data: st.DataObject) -> None:
    dt = data.draw(dtypes(peer), "dtype")
    a = data.draw(plain(dt, shapes(min_dims=1, max_dims=3)), "x")
    k = data.draw(st.integers(1, a.ndim), "mask dims")
    mask = data.draw(hnp.arrays(np.bool_, a.shape[:k]), "mask")
    x = remote(peer, a)
    with Requests(peer.dev) as r:
        y = x[remote(peer, mask)]
    assert r.count == 1, "a boolean mask costs exactly one round trip"
    compare(y.to_numpy(), a[mask])
    if a.ndim > k:
        tm = data.draw(hnp.arrays(np.bool_, a.shape[-1:]), "trailing mask")
        compare(x[..., remote(peer, tm)].to_numpy(), a[..., tm])
    z = xp.asarray(a, device=peer.dev)
    assert z[remote(peer, np.ones(a.shape, bool))].shape == (a.size,)


@given_data
def test_setitem(peer: Peer, data: st.DataObject) -> None:
    dt = data.draw(dtypes(peer), "dtype")
    a = data.draw(plain(dt, shapes(min_dims=1, max_dims=3, min_side=1)), "x")
    x = remote(peer, a)
    ident = id(x)
    expected = a.copy()
    kind = data.draw(st.sampled_from(["basic", "mask", "int", "array value"]), "kind")
    if kind == "basic":
        key = data.draw(hnp.basic_indices(a.shape, allow_ellipsis=True), "key")
        v = data.draw(plain(dt, ()), "value").item()
        v = v if dt.kind != "c" else complex(v)
        expected[key] = v
        with Requests(peer.dev) as r:
            x[key] = v
        assert r.count == 0
    elif kind == "mask":
        mask = data.draw(hnp.arrays(np.bool_, a.shape), "mask")
        v = data.draw(plain(dt, ()), "value")
        expected[mask] = v
        x[remote(peer, mask)] = remote(peer, v)
    elif kind == "int":
        idx = np.asarray(data.draw(st.lists(st.integers(0, a.shape[0] - 1), unique=True, max_size=a.shape[0])),
                         dtype=np.int64)
        expected[idx] = 0
        x[remote(peer, idx)] = 0 if dt.kind != "b" else False
        expected[idx] = 0 if dt.kind != "b" else False
    else:
        key = data.draw(hnp.basic_indices(a.shape, allow_ellipsis=True), "key")
        v = data.draw(plain(dt, expected[key].shape), "value array")
        expected[key] = v
        x[key] = remote(peer, v)
    assert id(x) == ident and x.shape == a.shape and x.dtype.name == a.dtype.name
    compare(x.to_numpy(), expected)


def test_setitem_checks(peer: Peer) -> None:
    x = remote(peer, np.zeros((2, 3), np.float32))
    with pytest.raises(TypeError):
        x[0] = remote(peer, np.zeros(3, np.float64))   # float64 values do not fit a float32 array
    with pytest.raises(ValueError):
        x[0] = remote(peer, np.zeros(2, np.float32))   # (2,) does not broadcast to (3,)
    with pytest.raises(TypeError):
        x[0] = 1j
    with pytest.raises(IndexError):
        x[0, 0, 0]
    with pytest.raises(IndexError):
        x[5]
    with pytest.raises(IndexError):
        x[..., ...]
    with pytest.raises(IndexError):
        x[True]
    with pytest.raises(IndexError):
        x[remote(peer, np.zeros((3,), bool))]         # the mask's shape must match the dims it indexes


@given_data
def test_take(peer: Peer, data: st.DataObject) -> None:
    dt = data.draw(dtypes(peer), "dtype")
    a = data.draw(plain(dt, shapes(min_dims=1, min_side=1)), "x")
    ax = data.draw(st.integers(-a.ndim, a.ndim - 1), "axis")
    n = a.shape[ax]
    idx = data.draw(hnp.arrays(np.int64, (data.draw(st.integers(0, 4)),), elements=st.integers(0, n - 1)), "indices")
    x = remote(peer, a)
    compare(xp.take(x, remote(peer, idx), axis=ax).to_numpy(), np.take(a, idx, axis=ax))
    along = data.draw(hnp.arrays(np.int64, a.shape[:ax % a.ndim] + (2,) + a.shape[ax % a.ndim + 1:],
                                 elements=st.integers(0, n - 1)), "along")
    compare(xp.take_along_axis(x, remote(peer, along), axis=ax).to_numpy(), np.take_along_axis(a, along, axis=ax))


@pytest.fixture(scope="module")
def two_devices() -> Iterator[tuple[Any, Any]]:
    import ember
    a, b = ember.connect("local"), ember.connect("local")
    yield a, b
    a.close()
    b.close()


def test_mixing_devices_raises(two_devices: tuple[Any, Any]) -> None:
    d1, d2 = two_devices
    x, y = xp.ones(3, device=d1), xp.ones(3, device=d2)
    for f in (lambda: x + y, lambda: xp.add(x, y), lambda: x[y > 0], lambda: xp.where(x > 0, x, y),
              lambda: xp.concat([x, y]), lambda: xp.matmul(x, y), lambda: xp.take(x, xp.zeros(1, dtype=xp.int64,
                                                                                                device=d2))):
        with pytest.raises(ValueError, match="different devices"):
            f()
    assert x.device is d1 and xp.ones_like(x).device is d1
    z = x.to_device(d2)
    assert z.device is d2 and (z + y).to_numpy().tolist() == [2.0, 2.0, 2.0]
    assert x.to_device(d1) is x
