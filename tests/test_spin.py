"""Polling without sleeping for a small round trip's answer (transport/spin.py).

The client's caller thread polls its calm TCP socket for a moment before it sleeps; a peer process's own
loop (``Server.run``: ``run_loop(hot=True)``) keeps polling its sockets for a moment after a small inline
answer, while no session's worker has work. Real sockets and a real peer on loopback.
"""

from __future__ import annotations

import asyncio
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import ember
import ember.array_api as xp
from test_core_sessions import wait_until
from ember.cli.main import build_parser
from ember.errors import SessionLost
from ember.server import Server
from ember.transport import loop as tloop
from ember.transport import spin


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def test_spin_seconds_follow_the_setting_and_never_spin_on_one_cpu(monkeypatch):
    monkeypatch.setattr(spin.os, "sched_getaffinity", lambda _pid: {0, 1})
    monkeypatch.setenv("EMBER_SPIN_US", "250")
    assert spin._spin_seconds() == pytest.approx(250e-6)
    monkeypatch.setenv("EMBER_SPIN_US", "0")
    assert spin._spin_seconds() == 0.0
    monkeypatch.setenv("EMBER_SPIN_US", "not a number")
    assert spin._spin_seconds() == pytest.approx(300e-6)
    monkeypatch.setenv("EMBER_SPIN_US", "1e9")  # bounded: a moment, never a busy loop
    assert spin._spin_seconds() == pytest.approx(10e-3)
    monkeypatch.setenv("EMBER_SPIN_US", "-5")
    assert spin._spin_seconds() == 0.0
    monkeypatch.setenv("EMBER_SPIN_US", "250")
    monkeypatch.setattr(spin.os, "sched_getaffinity", lambda _pid: {0})
    assert spin._spin_seconds() == 0.0  # the spinner would hold the core the other end needs


def test_a_peer_told_to_spin_spins_even_on_one_cpu(monkeypatch):
    """``ember serve --spin-us``: a peer pinned to a core of its own polls hot there; bounded as the setting is."""
    monkeypatch.setattr(spin.os, "sched_getaffinity", lambda _pid: {1})
    monkeypatch.setattr(spin, "SPIN", 0.0)
    spin.set_spin_us(250)
    assert spin.SPIN == pytest.approx(250e-6)
    spin.set_spin_us(1e9)
    assert spin.SPIN == pytest.approx(10e-3)
    for off in (0, -5, float("nan")):
        spin.set_spin_us(off)
        assert spin.SPIN == 0.0
    args = build_parser().parse_args(["serve", "--spin-us", "300"])
    assert args.spin_us == 300.0
    assert build_parser().parse_args(["serve"]).spin_us is None  # (the default: EMBER_SPIN_US, one-CPU rule)
    for bad in ("-5", "nan", "1e9", "fast"):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(["serve", "--spin-us", bad])
        assert e.value.code == 2  # argparse's usage error, with the reason


def test_hot_selector_returns_an_event_from_its_hot_wait_and_keeps_timers(pair, monkeypatch):
    monkeypatch.setattr(spin, "SPIN", 60.0)  # hot for longer than the test: only events and timers end it
    a, b = pair
    sel = spin.HotSelector()
    try:
        sel.register(a, 1)  # EVENT_READ
        sel.keep_hot()
        b.send(b"x")
        ready = sel.select(None)
        assert [k.fileobj for k, _ in ready] == [a] and sel.hot_waits == 1
        a.recv(1)
        t0 = time.monotonic()
        assert sel.select(0.02) == []  # a timer due sooner ends the hot wait, as it ends a sleep
        assert time.monotonic() - t0 < 30.0
        assert sel.hot_waits == 1
        sel.keep_hot()
        sel.cool()  # cold again: an ordinary wait
        b.send(b"y")
        assert [k.fileobj for k, _ in sel.select(1.0)] == [a] and sel.hot_waits == 1
    finally:
        sel.close()


def test_keep_hot_does_nothing_when_spinning_is_off(monkeypatch):
    monkeypatch.setattr(spin, "SPIN", 0.0)
    sel = spin.HotSelector()
    try:
        sel.keep_hot()
        assert sel.hot_until == 0.0
        assert not hasattr(tloop.hot_event_loop(), "keep_hot")  # an ordinary loop then
    finally:
        sel.close()


def test_poll_hot_sees_data_and_gives_up_at_its_deadline(pair, monkeypatch):
    monkeypatch.setattr(spin, "SPIN", 60.0)
    a, b = pair
    p = select.poll()
    p.register(a.fileno(), select.POLLIN)
    assert spin.poll_hot(p, time.monotonic() - 1.0) is False  # past its deadline: the caller sleeps as usual
    b.send(b"x")
    assert spin.poll_hot(p, time.monotonic() + 30.0) is True


@pytest.fixture
def hot_peer(monkeypatch):
    """A peer serving on its own hot loop (as ``ember serve`` does) in a thread; (server, its selector)."""
    monkeypatch.setattr(spin, "SPIN", 2.0)  # hot long enough that each next request finds the loop polling
    if tloop.uvloop_module() is not None:
        pytest.skip("uvloop's loop never polls hot")
    srv = Server(["cpu", "torch:cpu"])
    srv.listen_tcp("127.0.0.1", 0)
    got: dict = {}
    ready = threading.Event()

    def on_ready(_addrs):
        got["loop"] = asyncio.get_running_loop()
        ready.set()

    t = threading.Thread(target=tloop.run_loop, args=(srv.serve(on_ready),), kwargs={"hot": True}, daemon=True)
    t.start()
    assert ready.wait(30)
    loop = got["loop"]
    assert hasattr(loop, "keep_hot")
    yield srv, loop._selector
    loop.call_soon_threadsafe(lambda: asyncio.ensure_future(srv.stop()))
    t.join(30)


def test_a_hot_peer_answers_round_trips_from_its_hot_wait(hot_peer):
    torch = pytest.importorskip("torch")
    import ember.torch  # noqa: F401
    srv, sel = hot_peer
    d = ember.connect(next(a for a in srv.addresses if a.startswith("tcp://")), device=1)
    try:
        with d:
            a = torch.arange(3.0, device="ember")
            before = sel.hot_waits
            for i in range(20):
                assert (a + i).sum().item() == float(torch.arange(3.0).add(i).sum())
            assert sel.hot_waits - before >= 10  # requests found the peer's loop polling, not asleep
            big = torch.ones(1 << 16, device="ember")  # past the inline bound: the worker runs it
            assert (big * 2).sum().item() == float(2 << 16)
            assert sel.hot_until == 0.0  # cooled when the batch went to the worker (its Python needs the GIL)
    finally:
        d.close()
    d = ember.connect(next(a for a in srv.addresses if a.startswith("tcp://")), device=0)  # NumPy, inline too
    try:
        x = xp.asarray(np.arange(3.0), device=d)
        before = sel.hot_waits
        for i in range(20):
            np.testing.assert_array_equal((x + i).to_numpy(), np.arange(3.0) + i)
        assert sel.hot_waits - before >= 10
    finally:
        d.close()


def test_a_spinning_client_still_hears_its_peer_die(monkeypatch):
    """The caller polls hot, then sleeps as usual: a peer that goes away mid-wait still ends the session."""
    torch = pytest.importorskip("torch")
    import ember.torch  # noqa: F401
    from ember.transport import tcp_exchange
    monkeypatch.setattr(spin, "SPIN", 0.05)
    monkeypatch.setattr(tcp_exchange, "PATIENCE", 5.0)
    srv = Server(["torch:cpu"])
    srv.listen_tcp("127.0.0.1", 0)
    srv.start_in_thread()
    d = ember.connect(next(a for a in srv.addresses if a.startswith("tcp://")))
    try:
        with d:
            a = torch.ones(4, device="ember")
            assert (a + 1).sum().item() == 8.0
            srv.close()
            with pytest.raises(SessionLost):
                for _ in range(100):
                    (a + 1).sum().item()
    finally:
        d.close()


def test_backoff_skips_more_chances_after_each_wasted_hot_wait_and_starts_over_on_a_hit():
    b = spin.Backoff()
    assert b.want() and b.want()  # nothing wasted yet
    b.missed()
    assert [b.want() for _ in range(3)] == [False, False, True]
    b.missed()
    assert [b.want() for _ in range(5)] == [False] * 4 + [True]
    for _ in range(20):
        b.missed()
    assert sum(not b.want() for _ in range(200)) == 64  # bounded: a link that pays again is tried soon
    b.hit()
    b.missed()
    assert [b.want() for _ in range(3)] == [False, False, True]


def test_a_hot_wait_in_vain_backs_the_selector_off(pair, monkeypatch):
    monkeypatch.setattr(spin, "SPIN", 0.005)
    a, _b = pair
    sel = spin.HotSelector()
    try:
        sel.register(a, 1)
        sel.keep_hot()
        assert sel.hot_until > 0
        assert sel.select(1.0) == []  # nothing came while hot, then nothing while asleep (1 s)
        assert sel.hot_until == 0.0 and sel.backoff.skip == 2
        sel.keep_hot()
        sel.keep_hot()
        assert sel.hot_until == 0.0  # the two chances after a wasted hot wait sleep at once
        sel.keep_hot()
        assert sel.hot_until > 0
    finally:
        sel.close()


def test_a_peer_sharing_its_process_never_polls_hot():
    """``start_in_thread`` (tests, notebooks) and the embedded peer share their process with user code: their
    loops sleep as usual (only ``Server.run``, a peer process's own loop, may poll hot)."""
    from ember.embedded import local_server
    srv = Server(["cpu"])
    srv.listen_tcp("127.0.0.1", 0)
    srv.start_in_thread()
    try:
        assert srv._loop is not None and not hasattr(srv._loop, "keep_hot")
        d = ember.connect("local")
        np.testing.assert_array_equal((xp.asarray(np.arange(3.0), device=d) + 1).to_numpy(), np.arange(3.0) + 1)
        loops = [s.loop for s in list(local_server().live)]  # (served on the client's own I/O loop)
        assert loops and not any(hasattr(lp, "keep_hot") for lp in loops)
        d.close()
    finally:
        srv.close()


def test_a_client_polls_hot_only_for_an_answer_that_may_come_soon(hot_peer, monkeypatch):
    """A read after a little work polls its socket hot; a read after much (a loss read after several steps of
    queued work: milliseconds) sleeps at once, so that it does not spin its core's share away."""
    from ember.client import exchange

    srv, _sel = hot_peer
    hot: list[bool] = []
    real = spin.poll_hot
    monkeypatch.setattr(spin, "poll_hot", lambda *a, **k: (hot.append(True), real(*a, **k))[1])
    d = ember.connect(next(a for a in srv.addresses if a.startswith("tcp://")))
    soon: list[bool] = []  # what each read on the caller's thread decided (its hot waits also back off by timing)
    finish = d.session._calm.finish
    monkeypatch.setattr(d.session._calm, "finish", lambda *a, **k: (soon.append(k.get("soon")), finish(*a, **k))[1])
    try:
        x = xp.asarray(np.arange(4.0), device=d)
        s = d.session
        for i in range(5):  # a little work before each read: polled hot
            z = x + i
            s.flush()  # (a read finding the link busy goes the ordinary way: on a loaded machine, wait for calm)
            assert wait_until(lambda: not s._frames and s._parked, timeout=30)
            np.testing.assert_array_equal(z.to_numpy(), np.arange(4.0) + i)
        assert len(soon) >= 4 and all(soon) and d.session.stats["exchanges"] >= 4, soon
        assert hot  # (a hot wait that misses, on a loaded machine, makes the next 2 sleep: so not one per read)
        hot.clear()
        soon.clear()
        exchanges = d.session.stats["exchanges"]
        y = x
        for _ in range(2 * exchange.SOON_WORK):  # much work, then one read: it sleeps at once
            y = y * 1.0 + 1.0
        s.flush()
        assert wait_until(lambda: not s._frames and s._parked, timeout=30)  # sent: the read finds the link calm
        np.testing.assert_array_equal(y.to_numpy(), np.arange(4.0) + 2 * exchange.SOON_WORK)
        assert d.session.stats["exchanges"] == exchanges + 1 and soon == [False] and hot == []
    finally:
        d.close()


@pytest.mark.timeout(120)
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="pins the peer to one CPU (Linux)")
def test_serve_pinned_to_one_cpu_polls_hot_only_when_told():
    """``ember serve`` as a user runs it, its affinity one CPU (``taskset -c N``): it never polls hot by
    itself, and does with ``--spin-us``; either way it answers every round trip."""
    torch = pytest.importorskip("torch")
    import ember.torch  # noqa: F401
    from test_core_cli import ENV, address_of
    cpu = min(os.sched_getaffinity(0))
    env = {k: v for k, v in ENV.items() if k != "EMBER_SPIN_US"} | {"EMBER_UVLOOP": "0"}
    for told in (False, True):
        extra = ["--spin-us", "300"] if told else []
        p = subprocess.Popen([sys.executable, "-m", "ember.cli.main", "serve", "--no-iroh", "--tcp", "127.0.0.1:0",
                              "--device", "torch:cpu", *extra], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             text=True, env=env, preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
        try:
            addr = address_of(p, r"listening on (tcp://\S+)")
            if told:
                assert p.stdout.readline().strip() == "ember serve: polls hot for 300 µs after a small answer"
            d = ember.connect(addr)
            with d:
                a = torch.arange(3.0, device="ember")
                for i in range(20):
                    assert (a + i).sum().item() == float(torch.arange(3.0).add(i).sum())
            d.close()
            p.send_signal(signal.SIGTERM)
            rest, _ = p.communicate(timeout=30)
            assert p.returncode == 0
            assert "polls hot" not in rest  # (told: said once, above; else never)
        finally:
            p.kill()
