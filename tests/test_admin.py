"""The admin path: STATS on one's own session, whole-peer figures for admins only, `ember status`."""

from __future__ import annotations

import json
import subprocess
import sys

import msgpack
import numpy as np
import pytest

import ember
import ember.array_api as xp
from ember.client.io import run_sync
from ember.errors import AuthorizationError, ProtocolError
from ember.protocol import codec
from ember.protocol import messages as m
from ember.server import Server
from ember.transport.iroh import client_peer_id

from test_core_cli import ENV, start_serve
from test_core_sessions import raw_session, wait_until

CLI = [sys.executable, "-m", "ember.cli.main"]


@pytest.fixture
def admin_server():
    srv = Server(["cpu"], admin_tokens=["s3cret"])
    srv.listen_websocket("127.0.0.1", 0)
    srv.start_in_thread()
    yield srv
    srv.close()


def test_own_session_figures_need_no_admin_rights(admin_server):
    d = ember.connect(admin_server.addresses[0])
    x = xp.asarray(np.ones((10, 10)), device=d)
    y = x @ x + 1.0
    y.to_numpy()
    # (the batch that read y stays charged, as a decoded batch, a moment after its answer went out)
    assert wait_until(lambda: d.stats()["peer"]["session"]["bytes_held"] == 1600), d.stats()["peer"]["session"]
    st = d.stats()
    assert st["ops"] >= 3 and st["bytes_received"] > 800  # the client's counters, as before
    peer = st["peer"]
    assert peer["scope"] == "session" and "sessions" not in peer  # nothing about other sessions
    me = peer["session"]
    assert me["tensors"] == 2 and me["bytes_held"] == 1600 and me["ops"] >= 4 and me["bytes_in"] > 800
    assert me["device"] == 0 and peer["device"]["spec"] == "cpu" and me["admin"] is False
    with pytest.raises(AuthorizationError, match="admin session"):
        d.peer_stats()
    assert float(xp.sum(x)) == 100.0  # the session carries on
    d.close()


def test_admin_sees_every_session_with_memory_and_last_error(admin_server):
    a, b = ember.connect(admin_server.addresses[0]), ember.connect(admin_server.addresses[0])
    xa = xp.asarray(np.ones(1000), device=a)
    xb = xp.asarray(np.ones(10), device=b)
    bad = ember.custom_op("no_such_op", xb, outputs=[((10,), xp.float64)])
    with pytest.raises(ember.errors.RemoteExecutionError):
        bad.to_numpy()
    float(xp.sum(xa))
    admin = ember.connect(admin_server.addresses[0], admin=True, credential="s3cret")

    def snap_with_error():
        s = admin.peer_stats()
        rows = {r["id"]: r for r in s["sessions"]}
        return s if any(r["last_error"] for r in rows.values()) else None
    assert wait_until(snap_with_error)
    snap = snap_with_error()
    rows = sorted((r for r in snap["sessions"] if not r["admin"]), key=lambda r: -r["bytes_held"])
    assert [r["bytes_held"] for r in rows] == [8000, 80]
    assert "no custom op named 'no_such_op'" in rows[1]["last_error"] and rows[0]["last_error"] is None
    assert snap["devices"][0]["bytes_held"] == 8080 and snap["devices"][0]["sessions"] == 3
    assert snap["totals"]["sessions_open"] == 3 and snap["totals"]["errors"] == {"RemoteExecutionError": 1}
    assert snap["recent"]["errors"][-1]["op"] == "no_such_op"
    a.close(), b.close()
    closed = lambda s: [c["reason"] for c in s["recent"]["closed"]]  # noqa: E731
    assert wait_until(lambda: admin.peer_stats()["totals"]["sessions_open"] == 1 and len(closed(admin.peer_stats())) == 2)
    after = admin.peer_stats()  # (a session's end and its closed event are reported one after the other)
    assert after["totals"]["ops"] >= rows[0]["ops"] + rows[1]["ops"]  # closed sessions still count
    assert set(closed(after)) == {"client_closed"}
    admin.close()


@pytest.mark.parametrize("cred, reason", [("wrong", "wrong admin token"), ("", "missing admin token")])
def test_wrong_or_missing_admin_token_is_refused_with_the_reason(admin_server, cred, reason):
    with pytest.raises(AuthorizationError) as ei:
        ember.connect(admin_server.addresses[0], admin=True, credential=cred)
    assert ei.value.reason == reason and "--token" in (ei.value.hint or "")


def test_a_peer_without_admin_access_says_how_to_enable_it(server, ws_address):
    with pytest.raises(AuthorizationError, match="--admin-token"):
        ember.connect(ws_address, admin=True, credential="anything")


def test_admin_token_does_not_open_ordinary_sessions_and_vice_versa():
    srv = Server(["cpu"], authorizer=lambda p, d, c: c == b"user" or "wrong credential", admin_tokens=["adm"])
    srv.listen_websocket("127.0.0.1", 0)
    srv.start_in_thread()
    try:
        with pytest.raises(AuthorizationError):
            ember.connect(srv.addresses[0], credential="adm")
        with pytest.raises(AuthorizationError):
            ember.connect(srv.addresses[0], admin=True, credential="user")
        ember.connect(srv.addresses[0], admin=True, credential="adm").close()
    finally:
        srv.close()


def test_malformed_stats_requests_are_answered_not_fatal(admin_server):
    ws, reply = raw_session(admin_server.addresses[0])
    assert reply["type"] == "welcome"
    ws.send(codec.packb([[m.STATS, 7, "everything"]]))
    got = msgpack.unpackb(ws.recv(timeout=5))
    assert got == [[7, m.ERROR, {"kind": "ProtocolError", "op": None, "message": got[0][2]["message"]}]], got
    assert "scope" in got[0][2]["message"]
    ws.send(codec.packb([[m.STATS], [m.SYNC, 8]]))  # no request id: nothing to answer, the batch goes on
    assert msgpack.unpackb(ws.recv(timeout=5)) == [[8, m.OK, None]]
    ws.send(codec.packb([[m.STATS, 9, "session"]]))
    ((req, status, payload),) = msgpack.unpackb(ws.recv(timeout=5))
    assert (req, status) == (9, m.OK) and payload["session"]["messages"] == 2
    ws.close()
    with pytest.raises(ProtocolError, match="admin flag"):
        codec.decode_hello(codec.packb({"type": "hello", "protocol": 1, "device": 0, "session_id": b"x" * 16,
                                        "admin": "yes"}))


@pytest.mark.timeout(90)
def test_allowlisted_iroh_peer_is_admin_without_a_token():
    me = run_sync(client_peer_id(), 20)
    srv = Server(["cpu"], admin_peers=[me])
    srv.listen_iroh(offline=True, bind=["127.0.0.1:0", "[::1]:0"])
    other = Server(["cpu"], admin_peers=["ab" * 32])
    other.listen_iroh(offline=True, bind=["127.0.0.1:0", "[::1]:0"])
    srv.start_in_thread(), other.start_in_thread()
    try:
        admin = ember.connect(srv.addresses[0], admin=True, timeout=20)
        snap = admin.peer_stats()
        (row,) = snap["sessions"]
        assert row["peer"] == me and row["transport"] == "iroh" and row["admin"]
        admin.close()
        with pytest.raises(AuthorizationError, match="is not an admin peer"):
            ember.connect(other.addresses[0], admin=True, timeout=20)
    finally:
        srv.close(), other.close()


@pytest.mark.timeout(60)
def test_ember_status_prints_a_table_and_json(tmp_path):
    token_file = tmp_path / "admin.token"
    token_file.write_text("from-a-file\n")
    p, addr = start_serve("--no-iroh", "--websocket", "127.0.0.1:0", "--admin-token-file", str(token_file))
    try:
        d = ember.connect(addr)
        x = xp.asarray(np.ones(5000), device=d)
        float(xp.sum(x))
        r = subprocess.run(CLI + ["status", addr, "--token", "from-a-file", "--json"], capture_output=True, text=True,
                           env=ENV, timeout=30)
        assert r.returncode == 0, r.stderr
        snap = json.loads(r.stdout)
        user = next(s for s in snap["sessions"] if not s["admin"])
        assert user["bytes_held"] == 40000 and snap["devices"][0]["spec"] == "cpu"
        r = subprocess.run(CLI + ["status", addr], capture_output=True, text=True, timeout=30,
                           env={**ENV, "EMBER_ADMIN_TOKEN": "from-a-file", "COLUMNS": "160"})
        assert r.returncode == 0, r.stderr
        assert "ember status" in r.stdout and "40.0 kB" in r.stdout and user["id"][:8] in r.stdout
        assert "sessions" in r.stdout and "devices" in r.stdout and "totals" in r.stdout
        r = subprocess.run(CLI + ["status", addr, "--token", "nope"], capture_output=True, text=True, env=ENV,
                           timeout=30)
        assert r.returncode == 2 and "wrong admin token" in r.stderr and "Traceback" not in r.stderr
        d.close()
    finally:
        p.terminate()
        p.wait(15)


def test_serve_refuses_an_unreadable_admin_token_file(tmp_path):
    r = subprocess.run(CLI + ["serve", "--no-iroh", "--websocket", "127.0.0.1:0", "--admin-token-file",
                              str(tmp_path / "missing")], capture_output=True, text=True, env=ENV, timeout=30)
    assert r.returncode == 2 and "cannot read the admin token file" in r.stderr and "hint:" in r.stderr


def test_an_operator_can_look_at_a_full_peer():
    srv = Server(["cpu"], max_sessions=1, admin_tokens=["adm"])
    srv.listen_websocket("127.0.0.1", 0)
    srv.start_in_thread()
    try:
        d = ember.connect(srv.addresses[0])
        with pytest.raises(ember.errors.ConnectError, match="full"):
            ember.connect(srv.addresses[0])
        admin = ember.connect(srv.addresses[0], admin=True, credential="adm")
        snap = admin.peer_stats()
        assert snap["totals"]["sessions_refused"] == {"full": 1} and snap["totals"]["sessions_open"] == 2
        admin.close(), d.close()
    finally:
        srv.close()


def test_serve_checks_admin_peer_ids():
    r = subprocess.run(CLI + ["serve", "--websocket", "127.0.0.1:0", "--admin-peer", "not-a-peer-id"],
                       capture_output=True, text=True, env=ENV, timeout=30)
    assert r.returncode == 2 and "is not an iroh peer id" in r.stderr and "64 hex" in r.stderr
