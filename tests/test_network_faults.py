"""Serving through network faults: relays unreachable, and links that start dropping every packet."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import iroh
import numpy as np
import pytest

import ember
import ember.array_api as xp
from ember.errors import ConnectError, SessionLost
from ember.server import Server

from netfault import DroppingProxy
from test_core_cli import start_serve
from test_core_sessions import raw_session, wait_until


def dead_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def serve_with_dead_relay(*extra: str) -> subprocess.Popen:
    """`ember serve` told to use a relay on a dead loopback port (discovery off: nothing leaves the host)."""
    env = {k: v for k, v in os.environ.items() if k != "EMBER_OFFLINE"}
    env.update(PYTHONUNBUFFERED="1", EMBER_BIND="127.0.0.1:0,[::1]:0")
    p = subprocess.Popen([sys.executable, "-m", "ember.cli.main", "serve", "--websocket", "127.0.0.1:0",
                          "--relay", f"http://127.0.0.1:{dead_port()}", "--no-discovery", *extra],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    return p


@pytest.mark.timeout(90)
def test_relays_unreachable_serves_on_websocket_and_direct_addresses_and_warns_once():
    p = serve_with_dead_relay()
    info: dict[str, str] = {}
    try:
        assert p.stdout is not None and p.stderr is not None
        deadline = time.monotonic() + 60
        while "secret-key" not in info and time.monotonic() < deadline:
            line = p.stdout.readline()
            if not line:
                break
            ws = re.search(r"listening on (ws://\S+)", line)
            if ws:
                info["ws"] = ws.group(1)
            kv = re.search(r"iroh (\S+) (.+)$", line.strip())
            if kv:
                info[kv.group(1)] = kv.group(2)
        assert "ws" in info and "ticket" in info, (info, p.stderr.read() if p.poll() is not None else "")
        d = ember.connect(info["ws"])
        assert float(xp.sum(xp.arange(4, device=d))) == 6
        d.close()
        t = ember.connect(info["ticket"])  # direct addresses only: no relay needed
        assert float(xp.sum(xp.ones(5, device=t))) == 5
        t.close()
        p.terminate()
        assert p.wait(20) == 0
        err = p.stderr.read()
        assert err.count("relays unreachable") == 1, err
        assert "retrying relays in the background" in err and "--require-relay" in err
    finally:
        p.kill()
        p.wait(10)


@pytest.mark.timeout(60)
def test_require_relay_keeps_the_fail_fast():
    p = serve_with_dead_relay("--require-relay")
    try:
        out, err = p.communicate(timeout=50)
    finally:
        p.kill()
    assert p.returncode == 2, out + err
    assert "relays unreachable" in err and "hint:" in err and "Traceback" not in err


def _lose_and_reconnect(address: str, proxy: DroppingProxy, hb: float) -> None:
    d = ember.connect(address, heartbeat_interval=0.25, heartbeat_timeout=hb, timeout=3.0)
    x = xp.asarray(np.arange(6.0), device=d)
    assert float(xp.sum(x)) == 15.0
    proxy.dropping = True
    y = x * 2.0
    t0 = time.monotonic()
    with pytest.raises(SessionLost, match="did not answer"):
        y.to_numpy()
    took = time.monotonic() - t0
    assert took < hb + 2.0, took  # within the heartbeat window, no hang
    assert proxy.dropped > 0
    with pytest.raises(SessionLost):  # arrays do not survive their session
        (x + 1.0).to_numpy()
    t0 = time.monotonic()
    with pytest.raises(ConnectError):  # the path is still down: new work fails within its timeout
        float(xp.sum(xp.ones(3, device=d)))
    assert time.monotonic() - t0 < 10
    proxy.dropping = False
    assert float(xp.sum(xp.ones(3, device=d))) == 3.0  # the path is back: new work reconnects
    d.close()


@pytest.mark.timeout(60)
def test_dropping_tcp_link_gives_session_lost_then_reconnects():
    srv = Server(["cpu"])
    srv.listen_websocket("127.0.0.1", 0)
    port = int(srv.start_in_thread()[0].rsplit(":", 1)[1])
    proxy = DroppingProxy("tcp", port)
    try:
        _lose_and_reconnect(f"ws://127.0.0.1:{proxy.port}", proxy, hb=2.0)
    finally:
        proxy.close()
        srv.close()


@pytest.mark.timeout(60)
def test_silent_iroh_peer_gives_session_lost_then_reconnects():
    """A peer that goes silent on every path (a frozen host, a pulled cable) loses the session in the
    heartbeat window; new work fails within its timeout while it is silent and reconnects once it answers.

    A link proxy cannot simulate this over iroh: when the proxied path dies, iroh may move the
    connection to a direct address the peer advertised (measured: after ~5 s, sometimes not within
    30 s), so the peer's whole process is stopped instead: no path can answer."""
    p, ticket = start_serve(pattern=r"iroh ticket (\S+)")  # iroh only, offline, loopback (conftest)
    try:
        d = ember.connect(ticket, heartbeat_interval=0.25, heartbeat_timeout=2.0, timeout=3.0)
        x = xp.asarray(np.arange(6.0), device=d)
        assert float(xp.sum(x)) == 15.0
        os.kill(p.pid, signal.SIGSTOP)
        try:
            y = x * 2.0
            t0 = time.monotonic()
            with pytest.raises(SessionLost, match="did not answer"):
                y.to_numpy()
            assert time.monotonic() - t0 < 2.0 + 2.0  # within the heartbeat window, no hang
            with pytest.raises(SessionLost):  # arrays do not survive their session
                (x + 1.0).to_numpy()
            t0 = time.monotonic()
            with pytest.raises(ConnectError):  # still silent: new work fails within its timeout
                float(xp.sum(xp.ones(3, device=d)))
            assert time.monotonic() - t0 < 10
        finally:
            os.kill(p.pid, signal.SIGCONT)
        assert float(xp.sum(xp.ones(3, device=d))) == 3.0  # it answers again: new work reconnects
        d.close()
    finally:
        p.kill()
        p.wait(10)


def test_iroh_objects_dying_on_an_iroh_thread_are_freed_later_not_there():
    """The binding's deadlock (a SendStream freed inside iroh's callback thread) cannot happen."""
    import ctypes
    import gc

    from ember.transport import iroh_finalizers
    iroh_finalizers.install()
    before = iroh_finalizers.deferred
    done = []

    @ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)
    def foreign(_arg):  # runs on a thread Python did not start, as iroh's callbacks do
        import threading
        key = iroh.SecretKey.generate()
        done.append(isinstance(threading.current_thread(), threading._DummyThread))
        del key
        gc.collect()
        return None

    libc = ctypes.CDLL(None)
    tid = ctypes.c_ulong()
    assert libc.pthread_create(ctypes.byref(tid), None, foreign, None) == 0
    assert libc.pthread_join(tid, None) == 0
    assert done == [True]
    after = iroh_finalizers.deferred
    assert after >= before + 1  # (the collection may have found other iroh objects too)
    key = iroh.SecretKey.generate()  # on a Python thread: freed at once, as before
    del key
    assert iroh_finalizers.deferred == after


@pytest.mark.timeout(60)
def test_a_vanished_client_s_session_ends_and_frees_its_memory_while_an_idle_one_stays(make_peer):
    """A client whose link dies without a FIN (the proxy swallows everything) would hold its session
    and its memory for ever; the peer ends it after --idle-timeout of silence. An idle client with a
    live link pings within that window and keeps its session and arrays."""
    window = 3.0  # the peer's silence window; the client pings 30 times within it and waits 4 s for an answer
    srv = make_peer(idle_timeout=window)
    proxy = DroppingProxy("tcp", int(srv.addresses[0].rsplit(":", 1)[1]))
    held = lambda: srv.memory_stats()["devices"][0]["held"]  # noqa: E731
    try:
        d = ember.connect(f"ws://127.0.0.1:{proxy.port}", heartbeat_interval=0.1, heartbeat_timeout=4.0,
                          timeout=5.0)
        x = xp.asarray(np.ones(1 << 16), device=d)
        assert float(xp.sum(x)) == 1 << 16
        assert held() >= 8 << 16
        session = next(iter(srv.sessions.values()))
        t0, pinged = time.monotonic(), session.bytes_in
        time.sleep(window + 1.5)  # idle past the window on purpose (the subject, not a synchronisation)
        assert session.bytes_in > pinged and time.monotonic() - t0 >= window + 1.5  # its pings kept it
        assert float(xp.sum(x)) == 1 << 16 and len(srv.sessions) == 1  # same session, same array
        proxy.dropping = True
        t0 = time.monotonic()
        assert wait_until(lambda: srv.telemetry.closed["silent"] == 1, 30.0)  # (reported once it has ended)
        took = time.monotonic() - t0
        assert took < window + 0.5 + 2.0 + 9.0, took  # the window, its check period, the close's wait, slack
        assert wait_until(lambda: not srv.sessions and held() == 0, 10.0)  # its memory is back in the budget
        with pytest.raises(SessionLost, match="did not answer"):  # its unanswered ping told the client
            x.to_numpy()
        proxy.dropping = False
        assert float(xp.sum(xp.ones(3, device=d))) == 3.0  # new work reconnects
        d.close()
    finally:
        proxy.close()


@pytest.mark.timeout(60)
def test_a_client_that_says_nothing_after_its_hello_is_ended(make_peer):
    srv = make_peer(idle_timeout=1.0)
    ws, welcome = raw_session(srv.addresses[0])
    assert welcome["limits"]["idle_timeout"] == 1.0  # told in Welcome
    t0 = time.monotonic()
    assert wait_until(lambda: srv.telemetry.closed["silent"] == 1, 15.0)  # (reported once it has ended)
    took = time.monotonic() - t0
    assert 1.0 <= took < 1.0 + 7.0, took
    assert not srv.sessions
    ws.close()
