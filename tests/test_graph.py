"""Op-graph caching: recurring op groups are registered once and replayed by id.

Every workload runs twice, with and without graphs, and must give identical
results (values, errors, what the peer holds afterwards).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator

import numpy as np
import pytest

import ember
import ember.array_api as xp
from ember.errors import RemoteExecutionError
from ember.server import Server


@pytest.fixture(params=["local", "websocket"])
def connect(request: pytest.FixtureRequest) -> Iterator[Callable[..., ember.Device]]:
    """connect(**session_options) -> a device over the in-memory link or WebSocket; closed afterwards."""
    opened: list[ember.Device] = []
    address = "local" if request.param == "local" else request.getfixturevalue("server").addresses[0]

    def make(**kw: Any) -> ember.Device:
        d = ember.connect(address, **kw)
        opened.append(d)
        return d

    yield make
    for d in opened:
        d.close()


@pytest.fixture
def tiny_server() -> Iterator[Server]:
    srv = Server(["cpu"], graph_cache=1)
    srv.listen_websocket("127.0.0.1", 0)
    srv.start_in_thread()
    yield srv
    srv.close()


def mlp_steps(dev: ember.Device, steps: int, *, lr0: float = 0.05) -> tuple[list[float], list[np.ndarray]]:
    """A two-layer regression net trained by hand-written backprop: ~40 ops per step, one read."""
    rng = np.random.default_rng(1)
    X = xp.asarray(rng.standard_normal((32, 8)), device=dev)
    Y = xp.asarray(rng.standard_normal((32, 1)), device=dev)
    W1 = xp.asarray(rng.standard_normal((8, 16)) * 0.3, device=dev)
    W2 = xp.asarray(rng.standard_normal((16, 1)) * 0.3, device=dev)
    losses = []
    for i in range(steps):
        lr = lr0 / (1 + 0.1 * i)          # a scalar that changes every step
        h = X @ W1
        a = xp.tanh(h)
        out = a @ W2
        err = out - Y
        loss = xp.mean(err * err)
        g_out = err * (2.0 / 32)
        g_W2 = xp.matrix_transpose(a) @ g_out
        g_a = g_out @ xp.matrix_transpose(W2)
        g_h = g_a * (1.0 - a * a)
        g_W1 = xp.matrix_transpose(X) @ g_h
        n1 = xp.sqrt(xp.sum(g_W1 * g_W1, axis=(0, 1)))
        g_W1 = g_W1 / xp.maximum(n1, 1.0)
        W1 = W1 - lr * g_W1
        W2 = W2 - lr * g_W2
        W2 = xp.astype(xp.astype(W2, xp.float32), xp.float64)  # dtype kwargs inside a replayed group
        W1 = xp.clip(W1, -3.0, 3.0)
        losses.append(float(loss))
    return losses, [W1.to_numpy(), W2.to_numpy()]


def test_training_loop_is_identical_with_and_without_graphs(connect: Callable[..., ember.Device]) -> None:
    plain, cached = connect(graphs=False), connect()
    l0, w0 = mlp_steps(plain, 20)
    l1, w1 = mlp_steps(cached, 20)
    assert l0 == l1
    for a, b in zip(w0, w1):
        np.testing.assert_array_equal(a, b)
    st = cached.stats()  # (one graph of the whole step, then its two parts around the loss read: the split)
    assert st["graphs"] <= 3 and st["replays"] >= 10, st
    assert plain.stats()["replays"] == 0
    assert st["bytes_sent"] < plain.stats()["bytes_sent"] / 2


def test_replayed_step_sends_ten_times_fewer_bytes(connect: Callable[..., ember.Device]) -> None:
    dev = connect()
    s = dev.session
    rng = np.random.default_rng(0)
    x = xp.asarray(rng.standard_normal(16), device=dev)
    sizes = []
    for i in range(8):
        before = s.stats["bytes_sent"]
        total = xp.sum(x)  # (read after the step, which does not write it: the READ, then the step)
        y = x
        for k in range(25):  # 50 ops
            y = xp.sin(y) * (1.0 + 0.01 * k)
        x = y
        float(total)
        sizes.append(s.stats["bytes_sent"] - before)
    assert s.stats["replays"] >= 4
    first, replayed = sizes[0], max(sizes[4:])  # (registered by then: the step, then its two parts)
    assert first >= 10 * replayed, sizes


def test_errors_inside_a_replayed_group_poison_exactly_as_without(connect: Callable[..., ember.Device]) -> None:
    """A data-dependent failure (inverting a singular matrix) in some steps, upstream poison in others."""
    def run(dev: ember.Device) -> list[Any]:
        good = xp.asarray(np.eye(3) * 2.0, device=dev)
        singular = xp.asarray(np.ones((3, 3)), device=dev)
        poisoned = xp.linalg.inv(singular)  # fails on the peer: every use is poisoned upstream
        results: list[Any] = []
        for i in range(9):
            m = [good, singular, poisoned][i % 3]
            inv = xp.linalg.inv(m)
            y = inv @ good + 1.0
            z = xp.exp(y) * 2.0 - y
            for _ in range(4):
                z = z * 0.5 + 1.0
            ok = xp.sum(good) * 3.0  # independent of the failure: stays valid
            try:
                results.append(("ok", float(xp.sum(z)), float(ok)))
            except RemoteExecutionError as e:
                results.append(("err", e.op, str(e), float(ok)))
        return results

    plain, cached = connect(graphs=False), connect()
    r0, r1 = run(plain), run(cached)
    assert r0 == r1
    assert [r[0] for r in r0] == ["ok", "err", "err"] * 3
    assert cached.stats()["replays"] >= 6
    # the session survives: more work still runs
    assert float(xp.sum(xp.asarray(np.ones(4), device=cached) * 2.0)) == 8.0


def test_peer_holds_nothing_after_a_replayed_loop(server: Server) -> None:
    for graphs in (False, True):
        dev = ember.connect(server.addresses[0], graphs=graphs)
        losses, weights = mlp_steps(dev, 8)
        del weights
        dev.sync()
        assert server.held_tensors() == 0 or _held_after_gc(server, dev) == 0
        dev.close()


def _held_after_gc(server: Server, dev: ember.Device) -> int:
    import gc
    gc.collect()
    dev.sync()
    deadline = time.monotonic() + 5
    while server.held_tensors() and time.monotonic() < deadline:
        time.sleep(0.01)
    return server.held_tensors()


def three_step_kinds(dev: ember.Device, rounds: int) -> list[float]:
    """Three recurring groups that start with different ops, interleaved."""
    x = xp.asarray(np.linspace(0.0, 1.0, 16), device=dev)
    out = []
    for i in range(rounds * 3):
        k = i % 3
        if k == 0:
            y = x + 1.0
            for _ in range(8):
                y = xp.sin(y) * 0.9
        elif k == 1:
            y = x * 2.0
            for _ in range(8):
                y = xp.cos(y) + 0.1
        else:
            y = x - 0.5
            for _ in range(8):
                y = xp.tanh(y) * 1.1
        x = y
        out.append(float(xp.sum(x)))
    return out


def test_eviction_with_a_tiny_cache_reregisters_transparently(tiny_server: Server) -> None:
    addr = tiny_server.addresses[0]
    plain = ember.connect(addr, graphs=False)
    cached = ember.connect(addr)
    try:
        assert cached.session.welcome["limits"]["graph_cache"] == 1
        assert three_step_kinds(plain, 6) == three_step_kinds(cached, 6)
        st = cached.stats()
        assert st["replays"] >= 12
        assert st["graphs"] > 3  # evicted graphs were registered again, before their replay
        assert st["graph_resends"] == 0  # ... by the client's mirror of the LRU, without a round trip
    finally:
        plain.close()
        cached.close()


def test_server_evicting_behind_the_clients_back_is_recovered_in_order(tiny_server: Server) -> None:
    """The client believes the peer holds every graph; the peer (cache of 1) asks for them again.

    Groups are separated by uploads, not reads, so many batches are in flight behind the
    REPLAY that misses: the peer must hold them until the graph comes back, then run them in order.
    """
    addr = tiny_server.addresses[0]

    def run(dev: ember.Device) -> list[float]:
        x = xp.asarray(np.linspace(0.0, 1.0, 16), device=dev)
        for i in range(30):
            u = xp.asarray(np.full(16, 0.01 * i), device=dev)  # an upload: a boundary, no round trip
            k = i % 3
            y = x + float(i) if k == 0 else x * 1.01 if k == 1 else x - 0.5
            for _ in range(8):
                y = (xp.sin(y) if k == 0 else xp.cos(y) if k == 1 else xp.tanh(y)) * 0.9
            x = y + u
        return x.to_numpy().tolist()

    plain = ember.connect(addr, graphs=False)
    cached = ember.connect(addr)
    try:
        cached.session._gtable.server_capacity = 1000  # the mirror no longer matches the peer
        assert run(plain) == run(cached)
        st = cached.stats()
        assert st["replays"] >= 20 and st["graph_resends"] >= 1, st
    finally:
        plain.close()
        cached.close()


def test_groups_that_change_shape_of_attributes_or_scalar_types_fall_back(connect: Callable[..., ember.Device]) -> None:
    def run(dev: ember.Device) -> list[Any]:
        x = xp.reshape(xp.asarray(np.arange(24.0), device=dev), (4, 6))
        res = []
        for i in range(8):
            y = x * (2 if i % 2 else 2.0)   # int vs float scalar: a different graph
            for _ in range(8):
                y = y + 1.0
            s = xp.sum(y, axis=i % 2)       # a changing attribute: a different graph
            res.append(s.to_numpy().tolist())
        return res

    plain, cached = connect(graphs=False), connect()
    assert run(plain) == run(cached)


def test_a_group_held_too_long_is_sent_anyway(connect: Callable[..., ember.Device]) -> None:
    dev = connect(graph_hold=0.01)
    s = dev.session
    x = xp.asarray(np.ones(8), device=dev)

    def step(pause: float) -> float:
        y = x
        for k in range(10):
            y = y * 1.5
            if k == 4 and pause:
                batches = s.stats["batches"]
                time.sleep(pause)
                # held past graph_hold: the idle timer sent the first ops without waiting for the read
                assert s.stats["batches"] > batches
        return float(xp.sum(y))

    assert step(0) == step(0) == step(0.2) == step(0) == 8 * 1.5 ** 10
    assert s.stats["replays"] >= 2


def test_threads_recording_concurrently_stay_correct(connect: Callable[..., ember.Device]) -> None:
    import threading
    dev = connect()
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            x = xp.asarray(np.full(8, float(seed)), device=dev)
            for i in range(20):
                y = x
                for _ in range(9):
                    y = y * 1.0 + 0.0
                assert float(xp.sum(y)) == 8.0 * seed
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(1, 4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errors, errors


def test_a_loop_without_reads_is_cut_on_its_period_and_replayed(connect: Callable[..., ember.Device]) -> None:
    """No boundary for 60 steps: the op stream's period makes soft boundaries (results unchanged)."""
    def run(dev: ember.Device) -> tuple[list[float], dict[str, int]]:
        x = xp.asarray(np.linspace(-1.0, 1.0, 32), device=dev)
        w = xp.asarray(np.ones(32) * 0.5, device=dev)
        out = []
        for rnd in range(3):
            for i in range(60):   # 11 ops per step, no read
                y = xp.tanh(x * w + 0.1) * 2.0 - x
                g = xp.mean(y * y) * 0.01
                w = w - g * (0.5 + 0.001 * i)
                w = xp.clip(w, -2.0, 2.0)
            out.append(float(xp.sum(w)))
        return out, dev.stats()

    (r0, s0), (r1, s1) = run(connect(graphs=False)), run(connect(graph_min_period=32))
    assert r0 == r1
    assert s1["replays"] >= 20 and s1["replayed_ops"] >= 1000, s1
    r2, s2 = run(connect())  # the default period floor (128 ops: 12 steps a group)
    assert r2 == r0 and s2["replays"] >= 6
    assert s1["bytes_sent"] * 2 < s0["bytes_sent"]  # (the first ~500 ops go out as they are)


def test_a_periodic_stream_that_changes_falls_back(connect: Callable[..., ember.Device]) -> None:
    def run(dev: ember.Device) -> list[float]:
        x = xp.asarray(np.full(8, 0.5), device=dev)
        for i in range(400):
            x = x * 0.99 + 0.01          # period 2 ...
        for i in range(300):
            x = xp.sin(x) if i % 3 else xp.cos(x) * 1.0   # ... then another pattern
        return x.to_numpy().tolist()

    assert run(connect(graphs=False)) == run(connect())


def test_a_held_group_is_compared_by_its_keyword_objects_then_by_their_encoding() -> None:
    """A held group is canonicalised without encoding its keyword arguments: the very objects of the
    candidate's ops (a cached plan's) match at once; equal copies match by their encoding; a value the
    protocol cannot carry makes it no graph (it is then sent as ops), without raising."""
    from ember.client.graph import canon

    kw = {"l": [[[4], [1], 0, "float32"]]}

    def group(kwargs: Any, first: int) -> list[list[Any]]:
        return [[5, "aten.add.Tensor", [[], 1, 2], 1, [first], kwargs],
                [5, "aten.mul.Tensor", [[], first, 2], 1, [first + 1], kwargs]]
    cand = canon(group(kw, 10), set())
    assert cand is not None
    same_objects = canon(group(kw, 20), set(), check_kws=False)
    copies = canon(group({"l": [[[4], [1], 0, "float32"]]}, 30), set(), check_kws=False)
    other = canon(group({"l": [[[4], [1], 0, "float64"]]}, 40), set(), check_kws=False)
    bad = canon(group({"l": object()}, 50), set(), check_kws=False)
    assert same_objects is not None and copies is not None and other is not None and bad is not None
    assert cand.same(same_objects) and cand.same(copies)
    assert not cand.same(other) and not cand.same(bad)
    assert canon(group({"l": object()}, 60), set()) is None  # checked up front, as a candidate's own is
