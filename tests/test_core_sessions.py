"""Sessions: poisoning, bad input from raw clients, freeing, handshake refusals, custom ops."""

from __future__ import annotations

import logging
import os
import time

import msgpack
import numpy as np
import pytest
from websockets.sync.client import connect as ws_connect

import ember
import ember.array_api as xp
from ember.errors import (AuthorizationError, ConnectError, LimitExceeded, ProtocolError,
                          RemoteExecutionError, SessionLost)
from ember.protocol import codec
from ember.protocol import messages as m
from ember.server import Server, token_authorizer


def wait_until(pred, timeout=5.0):
    """Poll a condition with a deadline (a readiness check, not a sleep-as-synchronisation)."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def raw_session(address: str, **hello):
    ws = ws_connect(address, max_size=None)
    ws.send(codec.encode_hello(session_id=os.urandom(16), device=0, **hello))
    reply = msgpack.unpackb(ws.recv(timeout=5))
    return ws, reply


def test_failing_op_poisons_exactly_its_dependents(dev):
    a = xp.asarray(np.ones((2, 3)), device=dev)
    b = xp.asarray(np.ones((4, 5)), device=dev)
    other = xp.asarray(np.ones((2, 3)), device=dev)
    # shapes are checked on the client, so make the server fail: a custom op that doesn't exist
    boom = ember.custom_op("no_such_op", a, outputs=[((2, 3), xp.float64)])
    dep = xp.exp(boom) + 1.0
    ok = xp.exp(a) + other
    with pytest.raises(RemoteExecutionError) as ei:
        dep.to_numpy()
    assert ei.value.op == "no_such_op"
    assert "no custom op named 'no_such_op'" in str(ei.value)
    with pytest.raises(RemoteExecutionError):
        boom.to_numpy()
    np.testing.assert_allclose(ok.to_numpy(), np.exp(1.0) + 1.0)
    np.testing.assert_allclose((b * 2).to_numpy(), 2.0)  # the session keeps working


def test_server_side_failure_names_op_shapes_and_message(dev):
    # int64 // 0 is fine in numpy; use a reshape the server refuses by sending a raw op
    a = xp.asarray(np.arange(6.0), device=dev)
    s = a._session
    tid = next(s.ids)
    s.record([m.OP, "reshape", [a._id], 0, [tid], {"shape": [4, 4]}])
    from ember.array_api._array import RemoteArray
    r = RemoteArray(tid, (4, 4), a.dtype, a.device, s)
    with pytest.raises(RemoteExecutionError) as ei:
        r.to_numpy()
    msg = str(ei.value)
    assert "reshape" in msg and "(6,) float64" in msg and "cannot reshape" in msg
    assert float(xp.sum(a)) == 15.0


def test_unknown_op_is_an_error_at_read_not_a_crash(dev):
    a = xp.asarray(np.arange(3.0), device=dev)
    s = a._session
    tid = next(s.ids)
    s.record([m.OP, "__import__", [a._id], 0, [tid], None])
    from ember.array_api._array import RemoteArray
    with pytest.raises(RemoteExecutionError, match="unknown op '__import__'"):
        RemoteArray(tid, (3,), a.dtype, a.device, s).to_numpy()
    assert float(xp.sum(a)) == 3.0


def test_garbage_and_malformed_frames_do_not_harm_the_server(server, ws_address):
    good = ember.connect(ws_address)
    x = xp.asarray(np.arange(4.0), device=good)
    # 1. garbage bytes as the first frame: refused with a reason
    ws = ws_connect(ws_address)
    ws.send(b"\xc1\xff garbage")
    reply = msgpack.unpackb(ws.recv(timeout=5))
    assert reply["type"] == "reject" and reply["code"] == m.REJECT_PROTOCOL
    ws.close()
    # 2. a text message instead of Hello
    ws = ws_connect(ws_address)
    ws.send("hello?")
    assert msgpack.unpackb(ws.recv(timeout=5))["type"] == "reject"
    ws.close()
    # 3. a malformed batch after a good handshake: session-level error, then closed
    ws, reply = raw_session(ws_address)
    assert reply["type"] == "welcome"
    ws.send(msgpack.packb({"not": "a batch"}))
    resp = msgpack.unpackb(ws.recv(timeout=5))
    assert resp[0][0] == 0 and resp[0][1] == m.ERROR and resp[0][2]["kind"] == "ProtocolError"
    ws.close()
    # 4. wrongly shaped messages inside a valid batch: answered, session survives
    ws, _ = raw_session(ws_address)
    ws.send(msgpack.packb([[m.OP, "add"], [m.READ, 7, 12345], [m.UPLOAD, 1], [m.SYNC, 8]]))
    answers = {}
    while len(answers) < 2:
        for req, status, payload in msgpack.unpackb(ws.recv(timeout=5)):
            answers[req] = (status, payload)
    assert answers[7][0] == m.ERROR and "unknown" in answers[7][1]["message"]
    assert answers[8] == (m.OK, None)
    ws.close()
    # 5. raw TCP garbage (not even HTTP)
    import socket
    host, port = ws_address.removeprefix("ws://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b"\x00\x01\x02 not http\r\n\r\n")
        sock.recv(100)
    # the first client was served all along, and a new one is too
    np.testing.assert_allclose((x + 1).to_numpy(), np.arange(4.0) + 1)
    other = ember.connect(ws_address)
    assert float(xp.sum(xp.ones(5, device=other))) == 5.0
    good.close()
    other.close()


def test_tensors_freed_on_drop_close_and_disconnect(server, ws_address):
    d = ember.connect(ws_address)
    a = xp.asarray(np.arange(10.0), device=d)
    b = a * 2
    c = b + a
    d.sync()
    assert server.held_tensors() == 3
    del b
    d.sync()
    assert server.held_tensors() == 2  # dropped ids are freed with the next batch
    d.close()
    assert wait_until(lambda: server.held_tensors() == 0)
    # disconnect without Close: the transport breaks, the server frees everything
    d2 = ember.connect(ws_address)
    keep = [xp.ones(100, device=d2) for _ in range(5)]
    d2.sync()
    assert server.held_tensors() == 5
    import asyncio
    from ember.client.io import get_loop
    asyncio.run_coroutine_threadsafe(d2.session.conn._ws.transport.abort() or asyncio.sleep(0), get_loop()).result(5)
    assert wait_until(lambda: server.held_tensors() == 0)
    assert len(keep) == 5 and c.shape == (10,)


def test_nothing_listening_is_a_connect_error():
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(ConnectError) as ei:
        ember.connect(f"ws://127.0.0.1:{port}", timeout=5)
    assert f"127.0.0.1:{port}" in str(ei.value) and "ember serve" in str(ei.value)


def test_version_mismatch_names_both_versions(server, ws_address, caplog):
    caplog.set_level(logging.WARNING, logger="ember.server")
    ws, reply = raw_session(ws_address, protocol=99)
    assert reply["code"] == m.REJECT_VERSION
    assert "99" in reply["reason"] and str(m.PROTOCOL_VERSION) in reply["reason"]
    assert any("99" in r.getMessage() and "version 1" in r.getMessage() for r in caplog.records)
    ws.close()
    # and the client side: a Welcome in another version
    from ember.client.session import open_session
    from ember.transport.memory import memory_pair
    import asyncio

    async def fake_peer():
        cli, srv = memory_pair()
        await srv.send(codec.packb({"type": "welcome", "protocol": 7, "devices": [], "limits": {}}))
        return await open_session(cli, address="fake", device=0, credential=b"", timeout=2, session_id=os.urandom(16))

    with pytest.raises(ProtocolError, match="version 1.*version 7"):
        asyncio.run(fake_peer())


def test_device_index_out_of_range(ws_address):
    with pytest.raises(ConnectError, match="hosts 1 device"):
        ember.connect(ws_address, device=3)


def test_authorizer_reason_reaches_the_client():
    seen = []

    def auth(peer, device, cred):
        seen.append((peer, device, cred))
        return True if cred == b"open sesame" else "credential not on the guest list"

    srv = Server(["cpu"], authorizer=auth)
    srv.listen_websocket("127.0.0.1", 0)
    addr = srv.start_in_thread()[0]
    try:
        with pytest.raises(AuthorizationError) as ei:
            ember.connect(addr, credential=b"nope")
        assert ei.value.reason == "credential not on the guest list"
        d = ember.connect(addr, credential="open sesame")
        assert float(xp.sum(xp.ones(3, device=d))) == 3.0
        assert seen[0] == (None, 0, b"nope")
        d.close()
    finally:
        srv.close()
    tok = Server(["cpu"], authorizer=token_authorizer(b"t0k"))
    tok.listen_websocket("127.0.0.1", 0)
    addr = tok.start_in_thread()[0]
    try:
        with pytest.raises(AuthorizationError, match="missing credential"):
            ember.connect(addr)
    finally:
        tok.close()


def test_custom_ops():
    srv = Server(["cpu"])

    @srv.custom_op("softplus_scaled")
    def softplus(xp_, x, *, scale):
        return xp_.log1p(xp_.exp(x)) * scale

    srv.register_op("split_halves", lambda xp_, x: (x[: x.shape[0] // 2], x[x.shape[0] // 2:]))
    srv.listen_websocket("127.0.0.1", 0)
    addr = srv.start_in_thread()[0]
    try:
        d = ember.connect(addr)
        v = np.linspace(-2, 2, 8)
        x = xp.asarray(v, device=d)
        y = ember.custom_op("softplus_scaled", x, outputs=[((8,), xp.float64)], scale=3.0)
        np.testing.assert_allclose(y.to_numpy(), np.log1p(np.exp(v)) * 3.0)
        lo, hi = ember.custom_op("split_halves", x, outputs=[((4,), xp.float64), ((4,), xp.float64)])
        np.testing.assert_allclose(hi.to_numpy(), v[4:])
        wrong = ember.custom_op("softplus_scaled", x, outputs=[((3,), xp.float64)], scale=1.0)
        with pytest.raises(RemoteExecutionError, match="declared"):
            wrong.to_numpy()
        d.close()
    finally:
        srv.close()


def test_read_timeout_is_typed(dev):
    x = xp.ones(3, device=dev)
    from ember.client.session import ReadTimeout
    assert issubclass(ReadTimeout, ember.EmberError) and issubclass(ReadTimeout, TimeoutError)
    assert x.to_numpy(timeout=5).sum() == 3.0


def test_session_lost_then_reconnect_for_new_work():
    srv = Server(["cpu"])
    srv.listen_websocket("127.0.0.1", 0)
    addr = srv.start_in_thread()[0]
    d = ember.connect(addr)
    x = xp.ones(3, device=d)
    d.sync()
    srv.close()
    with pytest.raises(SessionLost):
        x.to_numpy(timeout=10)
    srv2 = Server(["cpu"])
    port = int(addr.rsplit(":", 1)[1])
    srv2.listen_websocket("127.0.0.1", port)
    try:
        srv2.start_in_thread()
    except ember.errors.BindError:
        pytest.skip("port was taken meanwhile")
    try:
        with pytest.raises(SessionLost, match="session"):
            (x + 1).to_numpy()
        assert float(xp.sum(xp.ones(4, device=d))) == 4.0  # new work reconnects
    finally:
        srv2.close()


def test_upload_over_max_tensor_is_refused_by_the_client_and_by_the_peer():
    srv = Server(["cpu"], max_tensor=1000)
    srv.listen_websocket("127.0.0.1", 0)
    addr = srv.start_in_thread()[0]
    try:
        d = ember.connect(addr)
        sent = d.session.stats["bytes_sent"]
        with pytest.raises(LimitExceeded, match="max_tensor of 1000 bytes.*nothing was sent"):
            xp.asarray(np.zeros(1000), device=d)  # 8000 bytes: the Welcome said 1000
        assert d.session.stats["bytes_sent"] == sent
        small = xp.asarray(np.ones(10), device=d)
        # a client that ignores the announced limit: the peer poisons that tensor only
        s = small._session
        s.record([m.UPLOAD, 999, "float64", [1000], 0, b"\0" * 8000, 8000])
        from ember.array_api._array import RemoteArray
        with pytest.raises(LimitExceeded, match="max_tensor"):
            RemoteArray(999, (1000,), xp.float64, d, s).to_numpy()
        assert float(xp.sum(small)) == 10.0
        d.close()
    finally:
        srv.close()
