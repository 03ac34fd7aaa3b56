"""Ember end to end over iroh: ``ember.connect(ticket)``, ``ember serve``/``keygen``/``doctor``.

Offline and loopback only (conftest sets EMBER_OFFLINE, EMBER_BIND, EMBER_CLIENT_BIND
and a temporary EMBER_KEY); servers in subprocesses are read through their stdout.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

import ember
import ember.array_api as xp
from ember.client.io import run_sync
from ember.errors import AuthorizationError, ConnectError, SessionLost
from ember.keys import peer_id_of
from ember.server import Server
from ember.transport.iroh import client_peer_id

LOOPBACK = ["127.0.0.1:0", "[::1]:0"]
ENV = {**os.environ, "EMBER_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "RUST_BACKTRACE": "0"}
CLI = [sys.executable, "-m", "ember.cli.main"]


@pytest.fixture
def iroh_server() -> Iterator[Server]:
    srv = Server(["cpu"])
    srv.listen_iroh(offline=True, bind=LOOPBACK)
    srv.start_in_thread()
    yield srv
    srv.close()


@pytest.mark.timeout(120)
def test_full_array_workload_over_iroh(iroh_server: Server) -> None:
    ticket = iroh_server.addresses[0]
    assert ticket.startswith("endpoint")
    dev = ember.connect(ticket)
    try:
        assert dev.peer_id == iroh_server.peer_id and len(dev.peer_id or "") == 64
        rng = np.random.default_rng(7)
        a, b = rng.standard_normal((64, 32)), rng.standard_normal((32, 16))
        x, y = xp.asarray(a, device=dev), xp.asarray(b, device=dev)
        z = xp.exp(x * 0.1) @ y + 1.0
        np.testing.assert_allclose(z.to_numpy(), np.exp(a * 0.1) @ b + 1.0, rtol=1e-12)
        assert float(xp.sum(x)) == pytest.approx(a.sum())
        np.testing.assert_allclose(xp.mean(z, axis=0).to_numpy(), (np.exp(a * 0.1) @ b + 1.0).mean(axis=0))
        w = x
        for _ in range(200):  # many pipelined ops, one read
            w = w * 0.99 + 0.01
        np.testing.assert_allclose(w.to_numpy(), _loop(a))
        big = rng.standard_normal(5_000_001)  # 40 MB: several upload chunks and read chunks
        np.testing.assert_array_equal((xp.asarray(big, device=dev) * 2.0).to_numpy(), big * 2.0)
    finally:
        dev.close()


def _loop(a: np.ndarray) -> np.ndarray:
    w = a
    for _ in range(200):
        w = w * 0.99 + 0.01
    return w


@pytest.mark.timeout(120)
def test_long_upload_is_not_mistaken_for_a_dead_peer(iroh_server: Server) -> None:
    """No answers come back while a big upload streams out; the heartbeat must not give up."""
    # the upload (~3 s on loopback) outlasts the heartbeat timeout; the margin keeps a loaded CI box green
    dev = ember.connect(iroh_server.addresses[0], heartbeat_interval=0.25, heartbeat_timeout=2.0)
    try:
        host = (np.arange(320 * 2**20, dtype=np.uint32) % 251).astype(np.uint8)
        x = xp.asarray(host, device=dev)
        dev.sync(timeout=100)
        assert int(xp.sum(xp.astype(x[:1000], xp.int64))) == int(host[:1000].astype(np.int64).sum())
    finally:
        dev.close()


@pytest.mark.timeout(60)
def test_authorizer_sees_the_authenticated_peer_id_and_its_reason_reaches_the_client() -> None:
    seen: list[str | None] = []

    def only_friends(peer_id: str | None, device: int, credential: bytes) -> bool | str:
        seen.append(peer_id)
        return credential == b"friend" or f"peer {peer_id[:8] if peer_id else '?'} is not on the list"

    srv = Server(["cpu"], authorizer=only_friends)
    srv.listen_iroh(offline=True, bind=LOOPBACK)
    srv.start_in_thread()
    try:
        me = run_sync(client_peer_id(), 10)
        with pytest.raises(AuthorizationError, match="is not on the list") as ei:
            ember.connect(srv.addresses[0])
        assert me[:8] in ei.value.reason
        dev = ember.connect(srv.addresses[0], credential=b"friend")
        assert float(xp.sum(xp.ones((3,), device=dev))) == 3.0
        dev.close()
        assert seen == [me, me]
    finally:
        srv.close()


@pytest.mark.timeout(60)
def test_connect_errors_over_iroh(iroh_server: Server) -> None:
    from ember.transport.iroh import parse_address
    import iroh

    t = parse_address(iroh_server.addresses[0])
    stranger = iroh.SecretKey.generate().public()
    wrong = str(iroh.EndpointTicket.from_addr(iroh.EndpointAddr(stranger, None, t.addr.direct_addresses())))
    t0 = time.monotonic()
    with pytest.raises(ConnectError, match="wrong peer"):
        ember.connect(wrong, timeout=5)
    assert time.monotonic() - t0 < 5
    with pytest.raises(ConnectError, match="ticket"):
        ember.connect(str(stranger), timeout=5)  # offline: a bare id cannot be found


def start_serve(*args: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, dict[str, str]]:
    """Start `ember serve`; parse its stdout until the last address line."""
    p = subprocess.Popen([*CLI, "serve", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env or ENV)
    assert p.stdout is not None
    info: dict[str, str] = {}
    deadline = time.monotonic() + 30
    want_ws = "--websocket" in args
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if not line:
            break
        words = line.split()
        for key in ("ticket", "peer-id", "relay-mode"):
            if key in words:
                info[key] = words[words.index(key) + 1]
        if "direct-addresses" in words:
            info["direct-addresses"] = " ".join(words[words.index("direct-addresses") + 1:])
        if "secret-key" in words:
            info["key-line"] = line.strip()
        m = re.search(r"listening on (ws://\S+)", line)
        if m:
            info["ws"] = m.group(1)
        if "key-line" in info and (not want_ws or "ws" in info):
            return p, info
    p.kill()
    raise AssertionError(f"ember serve printed no ticket; stderr: {p.stderr.read() if p.stderr else ''}")


def stop(p: subprocess.Popen) -> None:
    p.send_signal(signal.SIGTERM)
    try:
        assert p.wait(15) == 0
    finally:
        p.kill()


@pytest.mark.timeout(120)
def test_identity_is_stable_across_serve_restarts(tmp_path: Path) -> None:
    key = tmp_path / "srv.key"
    r = subprocess.run([*CLI, "keygen", str(key)], capture_output=True, text=True, env=ENV, timeout=30)
    assert r.returncode == 0, r.stderr
    pid = r.stdout.strip()
    assert re.fullmatch(r"[0-9a-f]{64}", pid)
    assert pid == peer_id_of(bytes.fromhex(key.read_text().strip()))
    ids, tickets = [], []
    for _ in range(2):
        p, info = start_serve("--key", str(key), "--offline", "--bind", "127.0.0.1:0", "--bind", "[::1]:0")
        try:
            ids.append(info["peer-id"])
            tickets.append(info["ticket"])
            assert info["relay-mode"] == "offline"
            assert all(a.startswith(("127.0.0.1:", "[::1]:")) for a in info["direct-addresses"].split())
            assert str(key) in info["key-line"]
            dev = ember.connect(info["ticket"])
            assert dev.peer_id == pid
            assert float(xp.sum(xp.arange(5, device=dev, dtype=xp.float64))) == 10.0
            dev.close()
        finally:
            stop(p)
    assert ids == [pid, pid]
    assert tickets[0] != tickets[1]  # new ports, same identity


@pytest.mark.timeout(120)
def test_a_peer_killed_and_restarted_with_its_key_is_reached_at_once(tmp_path: Path) -> None:
    """A crashed peer sends no CONNECTION_CLOSE: the client's QUIC connection to it lives on until its
    idle timeout. A new session must not wait for it (it did: ~30 s of failed connects)."""
    key = tmp_path / "srv.key"
    assert subprocess.run([*CLI, "keygen", str(key)], capture_output=True, env=ENV, timeout=30).returncode == 0
    args = ("--key", str(key), "--offline", "--bind", "127.0.0.1:0", "--bind", "[::1]:0")
    p, info = start_serve(*args)
    try:
        dev = ember.connect(info["ticket"])
        assert float(xp.sum(xp.ones(3, device=dev))) == 3.0
        dev.close()
    finally:
        p.kill()
        p.wait(10)
    p, info = start_serve(*args)  # same identity, new ports
    try:
        t0 = time.monotonic()
        dev = ember.connect(info["ticket"], timeout=20)
        assert float(xp.sum(xp.ones(4, device=dev))) == 4.0
        assert time.monotonic() - t0 < 5
        dev.close()
    finally:
        stop(p)


@pytest.mark.timeout(120)
def test_default_key_is_created_then_reused(tmp_path: Path) -> None:
    env = {**ENV, "EMBER_KEY": str(tmp_path / "cfg" / "secret.key")}
    ids = []
    for word in ("created", "reused"):
        p, info = start_serve(env=env)
        try:
            assert word in info["key-line"] and str(tmp_path / "cfg" / "secret.key") in info["key-line"]
            ids.append(info["peer-id"])
        finally:
            stop(p)
    assert ids[0] == ids[1]
    assert (tmp_path / "cfg" / "secret.key").stat().st_mode & 0o077 == 0


@pytest.mark.timeout(120)
def test_two_running_peers_never_share_a_key(tmp_path: Path) -> None:
    """A peer is its key, and iroh keeps one connection per peer id: two peers of one key were one address to
    every client (the second's sessions opened on the first, a mesh of both ran inside one). A second peer on the
    default key serves under a new one for its run, and says so; one given a key another peer holds exits."""
    path = tmp_path / "cfg" / "secret.key"
    env = {**ENV, "EMBER_KEY": str(path)}
    a, info_a = start_serve("--offline", "--bind", "127.0.0.1:0", env=env)
    try:
        b, info_b = start_serve("--offline", "--bind", "127.0.0.1:0", env=env)
        try:
            assert "reused" in info_a["key-line"] or "created" in info_a["key-line"]
            assert "new for this run" in info_b["key-line"] and "in use" in info_b["key-line"]
            assert info_a["peer-id"] != info_b["peer-id"]
            with ember.connect(info_a["ticket"]) as da, ember.connect(info_b["ticket"]) as db:
                assert (da.peer_id, db.peer_id) == (info_a["peer-id"], info_b["peer-id"])
                assert float(xp.sum(xp.ones(3, device=db))) == 3.0
                da.close()
                db.close()
        finally:
            stop(b)
        r = subprocess.run([*CLI, "serve", "--offline", "--bind", "127.0.0.1:0", "--key", str(path)],
                           capture_output=True, text=True, env=ENV, timeout=30)
        assert r.returncode != 0 and "another running ember serve uses the secret key" in r.stderr
        assert "ember keygen" in r.stderr and "Traceback" not in r.stderr
    finally:
        stop(a)


@pytest.mark.timeout(120)
def test_both_transports_at_once() -> None:
    p, info = start_serve("--websocket", "127.0.0.1:0")
    try:
        a = ember.connect(info["ticket"])
        b = ember.connect(info["ws"])
        assert float(xp.sum(xp.ones((4,), device=a))) == 4.0
        assert float(xp.sum(xp.ones((5,), device=b))) == 5.0
        assert a.session.welcome.get("instance") == b.session.welcome.get("instance")
        a.close()
        b.close()
    finally:
        stop(p)


@pytest.mark.timeout(90)
def test_killed_server_fails_pending_read_with_session_lost_within_seconds() -> None:
    p, info = start_serve()
    try:
        d = ember.connect(info["ticket"], heartbeat_timeout=3.0)
        x = xp.asarray(np.ones((400, 400)), device=d)
        for _ in range(300):
            x = x @ x * 1e-3  # keeps the peer busy so the read really waits
        t0 = time.monotonic()
        os.kill(p.pid, signal.SIGKILL)
        with pytest.raises(SessionLost):
            x.to_numpy()
        assert time.monotonic() - t0 < 8
    finally:
        p.kill()
        p.wait(10)


@pytest.mark.timeout(60)
def test_serve_errors_are_clear_without_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.key"
    bad.write_text("not a key\n")
    cases = [
        (["--key", str(bad)], "does not hold a secret key", "keygen"),
        (["--key", str(tmp_path / "missing.key")], "does not exist", "ember keygen"),
        (["--bind", "not-an-address"], "invalid bind address", "HOST:PORT"),
        (["--bind", "203.0.113.7:0"], "Cannot assign requested address", "not an address of this host"),
    ]
    for args, message, hint in cases:
        r = subprocess.run([*CLI, "serve", *args], capture_output=True, text=True, env=ENV, timeout=30)
        assert r.returncode != 0, args
        assert "Traceback" not in r.stderr, r.stderr
        assert message in r.stderr and "hint:" in r.stderr and hint in r.stderr, r.stderr
    r = subprocess.run([*CLI, "--debug", "serve", "--key", str(bad)], capture_output=True, text=True,
                       env=ENV, timeout=30)
    assert r.returncode != 0 and "Traceback" in r.stderr


@pytest.mark.timeout(60)
def test_keygen_refuses_overwrite_and_doctor_offline(tmp_path: Path) -> None:
    key = tmp_path / "k.key"
    first = subprocess.run([*CLI, "keygen", str(key)], capture_output=True, text=True, env=ENV, timeout=30)
    again = subprocess.run([*CLI, "keygen", str(key)], capture_output=True, text=True, env=ENV, timeout=30)
    assert first.returncode == 0 and again.returncode != 0
    assert "--force" in again.stderr and "Traceback" not in again.stderr
    forced = subprocess.run([*CLI, "keygen", str(key), "--force"], capture_output=True, text=True, env=ENV,
                            timeout=30)
    assert forced.returncode == 0 and forced.stdout.strip() != first.stdout.strip()
    doc = subprocess.run([*CLI, "doctor", "--offline", "--key", str(key)], capture_output=True, text=True,
                         env=ENV, timeout=60)
    assert doc.returncode == 0, doc.stdout + doc.stderr
    assert "self-connection" in doc.stdout and "serving is possible" in doc.stdout
    doc = subprocess.run([*CLI, "doctor", "--offline", "--key", str(tmp_path / "none.key")],
                         capture_output=True, text=True, env=ENV, timeout=60)
    assert doc.returncode == 1 and "hint:" in doc.stdout


@pytest.mark.timeout(120)
def test_peer_to_peer_move_over_iroh(make_peer) -> None:
    """The target server downloads straight from the source over a transfer stream."""
    a, b = (ember.connect(make_peer(iroh=True).addresses[0]) for _ in range(2))
    data = np.arange(300_000, dtype=np.float64)
    x = xp.asarray(data, device=a) + 1.0
    y = x.to_device(b)
    np.testing.assert_array_equal((y * 2.0).to_numpy(), (data + 1.0) * 2.0)
    a.close()
    b.close()
