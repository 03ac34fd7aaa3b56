"""The telemetry probe: events from real sessions, the two tiers, bounded queues that report drops."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

import ember
import ember.array_api as xp
from ember.server import Server
from ember.server.telemetry import probe as t


def wait_for(sub: t.Subscription, cls: type, pred=lambda ev: True, timeout: float = 5.0) -> list:
    """Events of ``sub`` up to and including the first ``cls`` event matching ``pred``."""
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ev = sub.get(timeout=0.2)
        if ev is None:
            continue
        seen.append(ev)
        if isinstance(ev, cls) and pred(ev):
            return seen
    raise AssertionError(f"no {cls.__name__} within {timeout} s; saw {[type(e).__name__ for e in seen]}")


@pytest.fixture
def srv():
    s = Server(["cpu", "cpu"])
    s.listen_websocket("127.0.0.1", 0)
    s.start_in_thread()
    yield s
    s.close()


def test_nobody_listening_means_the_plain_loop(srv):
    # the server's own subscribers (figures, the session log) take session events only
    assert srv.telemetry.subscribers and not srv.telemetry.active
    d = ember.connect(srv.addresses[0])
    x = xp.asarray(np.arange(4.0), device=d)
    assert float(xp.sum(x * 2.0)) == 12.0
    (s,) = srv.telemetry.sessions
    assert "_telemetry_timed" not in s.interp.__dict__  # no timed handlers were ever built
    with srv.telemetry.subscribe({"SessionClosed"}) as sub:  # session events do not turn op events on
        assert not srv.telemetry.active
        d.close()
        closed = wait_for(sub, t.SessionClosed)[-1]
    assert closed.reason == "client_closed" and closed.figures["ops"] >= 3


def test_session_and_op_events_with_timings(srv):
    with srv.telemetry.subscribe() as sub:
        assert srv.telemetry.active
        d = ember.connect(srv.addresses[0], device=1)
        x = xp.asarray(np.ones(8), device=d)
        y = xp.exp(x) + x
        assert y.to_numpy()[0] == pytest.approx(np.e + 1)
        d.close()
        evs = wait_for(sub, t.SessionClosed)
    opened = next(e for e in evs if isinstance(e, t.SessionOpened))
    assert opened.device == 1 and opened.transport == "websocket" and opened.remote.startswith("127.0.0.1:")
    ops = [e for e in evs if isinstance(e, t.Op)]
    names = [(e.kind, e.name) for e in ops]
    assert ("op", "exp") in names and ("op", "add") in names and ("upload", None) in names
    read = next(e for e in ops if e.kind == "read")
    assert read.nbytes == 64 and read.seconds > 0 and read.wait_s >= 0
    assert all(e.session == opened.session for e in ops)
    batches = [e for e in evs if isinstance(e, t.Batch)]
    assert sum(b.messages for b in batches) == len(ops) and all(b.run_s >= 0 for b in batches)
    assert max(b.memory for b in batches) >= 2 * 64  # x and y held: memory per session and device
    assert all(b.device_memory >= b.memory for b in batches)
    closed = evs[-1]
    assert closed.session == opened.session and closed.duration_s > 0
    assert closed.figures["bytes_in"] > 64 and closed.figures["bytes_out"] > 64 and closed.why == "closed by the client"


def test_poisoning_reports_the_error_once_not_for_each_dependent(srv):
    with srv.telemetry.subscribe({"Error"}) as sub:
        assert not srv.telemetry.active  # error events are session-tier
        d = ember.connect(srv.addresses[0])
        a = xp.asarray(np.ones(3), device=d)
        bad = ember.custom_op("no_such_op", a, outputs=[((3,), xp.float64)])
        dep = xp.exp(bad) + 1.0
        with pytest.raises(ember.errors.RemoteExecutionError):
            dep.to_numpy()
        ev = wait_for(sub, t.Error)[-1]
        d.close()
        assert ev.poisoned and ev.op == "no_such_op" and ev.kind == "RemoteExecutionError"
        assert "no custom op named 'no_such_op'" in ev.message
        time.sleep(0.1)
        assert sub.drain() == []  # exp(bad) and + 1.0 inherited the poison: no new errors
    assert srv.telemetry.errors["RemoteExecutionError"] == 1


def test_same_peer_move_reports_transfer_phases_with_sizes(srv):
    with srv.telemetry.subscribe({"Transfer"}) as sub:
        d0, d1 = ember.connect(srv.addresses[0]), ember.connect(srv.addresses[0], device=1)
        x = xp.asarray(np.arange(1000.0), device=d0)
        y = x.to_device(d1)
        assert float(xp.sum(y)) == 499500.0
        evs = wait_for(sub, t.Transfer, lambda e: e.phase == "completed")
        d0.close(), d1.close()
    assert [e.phase for e in evs] == ["started", "completed"]
    assert evs[-1].scope == "device" and evs[-1].nbytes == 8000 and evs[-1].seconds >= 0


def test_graph_replays_report_ops_and_saved_bytes(srv):
    with srv.telemetry.subscribe({"Op"}) as sub:
        d = ember.connect(srv.addresses[0])
        x = xp.asarray(np.ones(4), device=d)
        for _ in range(6):  # a recurring group between reads: registered once, then replayed
            y = x
            for _ in range(10):
                y = y * 1.0 + 0.0
            float(xp.sum(y))
        evs = wait_for(sub, t.Op, lambda e: e.kind == "replay")
        d.close()
    graph = next(e for e in evs if e.kind == "graph")
    replay = evs[-1]
    assert graph.nbytes > 0 and replay.ops == 21 and replay.saved_bytes > 0 and replay.name == graph.name


def test_a_full_queue_drops_and_says_how_many(srv):
    with srv.telemetry.subscribe({"Op"}, capacity=2) as sub:
        d = ember.connect(srv.addresses[0], graphs=False)
        x = xp.asarray(np.ones(4), device=d)
        for _ in range(5):  # five batches, each a Batch record: three are dropped
            x = x + 1.0
            d.sync()
        d.close()
        first = sub.get(timeout=1)
        assert isinstance(first, t.Missed) and first.count >= 3
        assert sub.missed >= 3 and srv.telemetry.dropped >= 3
        rest = sub.drain()
        assert rest and all(isinstance(e, t.Op) for e in rest)  # the two kept batches, unpacked


def test_a_subscriber_that_never_reads_does_not_slow_the_session(srv):
    sub = srv.telemetry.subscribe(capacity=16)
    try:
        d = ember.connect(srv.addresses[0], graphs=False)
        x = xp.asarray(np.ones(4), device=d)
        for _ in range(300):
            x = x + 1.0
            if _ % 10 == 0:
                d.sync()
        assert x.to_numpy()[0] == 301.0
        d.close()
        assert sub.missed > 0 and len(sub._q) == 16
    finally:
        sub.close()
    assert not srv.telemetry.active


def test_shapes_are_recorded_only_when_asked(srv):
    with srv.telemetry.subscribe({"Op"}, shapes=True) as sub:
        d = ember.connect(srv.addresses[0])
        x = xp.asarray(np.ones((2, 3), dtype=np.float32), device=d)
        y = xp.matmul(x, xp.ones((3, 5), dtype=xp.float32, device=d))
        y.to_numpy()
        evs = wait_for(sub, t.Op, lambda e: e.name == "matmul")
        d.close()
    (out,) = evs[-1].outputs
    assert out[1:] == ((2, 5), "float32")


def test_async_iteration_and_generic_op_reports():
    probe = t.Probe()

    async def main():
        sub = probe.subscribe({"Op"})
        probe.op("s1", "aten", "aten::add.Tensor", 1e-5, nbytes=16)
        probe.op("s1", 0, "add")
        got = []
        async for ev in sub:
            got.append(ev)
            if len(got) == 2:
                sub.close()
        return got

    got = asyncio.run(asyncio.wait_for(main(), 5))
    assert [(e.kind, e.name) for e in got] == [("aten", "aten::add.Tensor"), ("op", "add")]
    probe.op("s1", "aten", "x")  # nobody listens any more: nothing is built
    assert not probe.active


def test_unknown_event_kinds_are_refused():
    with pytest.raises(ValueError, match="unknown event kind"):
        t.Probe().subscribe({"Nope"})


def test_refusals_are_counted_and_reported():
    srv = Server(["cpu"], authorizer=lambda peer, dev, cred: cred == b"ok" or "bad credential")
    srv.listen_websocket("127.0.0.1", 0)
    srv.start_in_thread()
    try:
        with srv.telemetry.subscribe({"SessionRefused"}) as sub:
            with pytest.raises(ember.errors.AuthorizationError):
                ember.connect(srv.addresses[0], credential=b"no")
            ev = wait_for(sub, t.SessionRefused)[-1]
        assert ev.code == "unauthorized" and ev.reason == "bad credential"
        assert srv.telemetry.refused["unauthorized"] == 1
    finally:
        srv.close()
