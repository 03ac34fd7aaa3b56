"""Tensor movement between real peer processes over iroh (offline, loopback only)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from typing import Iterator

import numpy as np
import pytest

import ember
import ember.array_api as xp
from ember.errors import TransferError
from ember.protocol import messages as m

ENV = {**os.environ, "EMBER_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "RUST_BACKTRACE": "0"}
CLI = [sys.executable, "-m", "ember.cli.main"]


class Peer:
    """An `ember serve` subprocess with its own key, serving iroh and WebSocket on loopback."""

    def __init__(self, tmp: str, name: str) -> None:
        key = os.path.join(tmp, f"{name}.key")
        subprocess.run([*CLI, "keygen", key], check=True, capture_output=True, env=ENV, timeout=30)
        self.proc = subprocess.Popen([*CLI, "serve", "--offline", "--key", key, "--bind", "127.0.0.1:0",
                                      "--websocket", "127.0.0.1:0"],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=ENV)
        self.ticket = self.ws = ""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if mm := re.search(r"listening on (ws://\S+)", line):
                self.ws = mm.group(1)
            if mm := re.search(r"iroh ticket (endpoint\S+)", line):
                self.ticket = mm.group(1)
            if "relay-mode" in line:
                break
        assert self.ticket and self.ws, "ember serve did not print its addresses"

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture(scope="module")
def peers() -> Iterator[list[Peer]]:
    tmp = tempfile.mkdtemp(prefix="ember-peers-")
    ps = [Peer(tmp, n) for n in ("a", "b", "c")]
    yield ps
    for p in ps:
        p.stop()


@pytest.mark.timeout(120)
def test_three_peers_move_directly(peers):
    a, b, c = (ember.connect(p.ticket) for p in peers)
    data = np.random.default_rng(3).standard_normal((300, 200))
    x = xp.asarray(data, device=a) + 1.0
    y = x.to_device(b) * 2.0
    z = y.to_device(c) - 1.0
    np.testing.assert_array_equal(z.to_numpy(), (data + 1.0) * 2.0 - 1.0)
    assert a.stats()["bytes_received"] < 1000 and b.stats()["bytes_received"] < 1000
    back = z.to_device(a)
    np.testing.assert_array_equal(xp.max(xp.abs(back - ((x * 2.0) - 1.0))).to_numpy(), 0.0)


@pytest.mark.timeout(120)
def test_capability_is_bound_to_the_target_peer(peers):
    a, b, c = (ember.connect(p.ticket) for p in peers)
    x = xp.arange(5.0, device=a)
    cap = os.urandom(32)
    # expose for b's download identity, then let c try it
    x._session.send_alone([m.EXPOSE, x._id, cap, b.session.welcome["transfer_id"], 1, 300.0])
    from ember.array_api._array import RemoteArray
    tid = next(c.session.ids)
    c.session.record([m.FETCH, tid, peers[0].ticket, cap, 10.0])
    with pytest.raises(TransferError, match="bound to peer"):
        RemoteArray(tid, (5,), x.dtype, c, c.session).to_numpy()
    tid = next(b.session.ids)
    b.session.record([m.FETCH, tid, peers[0].ticket, cap, 10.0])
    np.testing.assert_array_equal(RemoteArray(tid, (5,), x.dtype, b, b.session).to_numpy(), np.arange(5.0))


@pytest.mark.timeout(120)
def test_iroh_and_websocket_peers_need_the_client_relay(peers):
    a = ember.connect(peers[0].ticket)
    b_ws = ember.connect(peers[1].ws)
    x = xp.arange(4.0, device=a)
    with pytest.raises(TransferError, match="different transports") as ei:
        x.to_device(b_ws)
    assert "via_client=True" in str(ei.value)
    np.testing.assert_array_equal(x.to_device(b_ws, via_client=True).to_numpy(), np.arange(4.0))


@pytest.mark.timeout(120)
def test_websocket_peers_move_directly_with_the_capability_alone(peers):
    a_ws, c_ws = ember.connect(peers[0].ws), ember.connect(peers[2].ws)
    x = xp.ones((1000,), device=a_ws) * 3.0
    y = x.to_device(c_ws)
    assert float(xp.sum(y)) == 3000.0
    assert c_ws.stats()["bytes_received"] < 1000


@pytest.mark.timeout(120)
@pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="stops a peer process (POSIX)")
def test_a_download_from_a_source_that_stops_answering_fails_in_seconds():
    """A source peer that vanishes mid-move (SIGSTOPped here: its host froze or its link went down) fails the
    target's download within seconds, naming it, not at QUIC's 30-s idle timeout; the target serves on."""
    from ember.server import download as transfer
    tmp = tempfile.mkdtemp(prefix="ember-stop-")
    a, b = Peer(tmp, "a"), Peer(tmp, "b")
    try:
        da, db = ember.connect(a.ticket), ember.connect(b.ticket)
        x = xp.arange(8.0, device=da)
        np.testing.assert_array_equal(x.to_device(db).to_numpy(), np.arange(8.0))  # b's link to a is up
        big = xp.ones((1 << 20,), device=da) * 2.0
        assert float(xp.sum(big[:1])) == 2.0
        os.kill(a.proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        y = big.to_device(db, timeout=60)
        with pytest.raises(TransferError, match="stopped answering") as ei:
            y.to_numpy()
        took = time.monotonic() - t0
        assert took < transfer.STALL_S + transfer.PROBE_S + 10, took  # (60 s without the probe)
        assert a.ticket[:40] in str(ei.value) and "move it again" in (ei.value.hint or "")
        np.testing.assert_array_equal((xp.arange(3.0, device=db) + 1.0).to_numpy(), np.arange(3.0) + 1.0)
    finally:
        a.proc.send_signal(signal.SIGCONT)
        a.stop()
        b.stop()


CLIENT = r"""
import re, sys, ember, ember.array_api as xp
src, dst = ember.connect(sys.argv[1]), ember.connect(sys.argv[2])
n = 256 * 1024 * 1024 // 8
y = (xp.ones((n,), device=src) * 2.0).to_device(dst, timeout=150)
assert float(xp.sum(y)) == 2.0 * n
print("RSS_MB", int(re.search(r"VmHWM:\s+(\d+)", open("/proc/self/status").read()).group(1)) // 1024)
"""


@pytest.mark.timeout(240)
def test_256_mib_over_iroh_peer_to_peer_with_a_small_client(peers):
    r = subprocess.run([sys.executable, "-c", CLIENT, peers[0].ticket, peers[1].ticket], capture_output=True,
                       text=True, timeout=230, env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    rss = int(re.search(r"RSS_MB (\d+)", r.stdout).group(1))
    assert rss < 160, f"client peak RSS {rss} MiB for a 256 MiB tensor"
