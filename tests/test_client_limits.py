"""Per-client limits on real peers: each refusal's reason reaches the client; other clients are served."""

from __future__ import annotations

import os
import time

import msgpack
import numpy as np
import pytest
import websockets
from websockets.sync.client import connect as ws_connect

import ember
import ember.array_api as xp
from ember.errors import ConnectError, LimitExceeded, ProtocolError
from ember.protocol import codec
from ember.protocol import messages as m
from ember.server import Server

from test_memory_budgets import answers, raw_session, wait_until


def test_sessions_per_client_are_limited_and_another_client_is_still_served(make_peer):
    srv = make_peer("127.0.0.1", "::1", max_sessions_per_client=3)
    v4, v6 = srv.addresses  # two client identities on one host: 127.0.0.1 and ::1
    assert "[::1]" in v6
    mine = [ember.connect(v4) for _ in range(3)]
    with pytest.raises(ConnectError, match=r"client 127.0.0.1 already has 3 sessions.*--max-sessions-per-client 3"):
        ember.connect(v4)
    other = ember.connect(v6)  # a second identity is still served
    assert float(xp.sum(xp.arange(4, device=other))) == 6
    assert srv.client_stats()["clients"] == {"127.0.0.1": 3, "::1": 1}
    assert srv.client_stats()["refusals"]["max_sessions_per_client"] == 1
    mine.pop().close()
    assert wait_until(lambda: srv.client_stats()["clients"].get("127.0.0.1") == 2)
    again = ember.connect(v4)
    assert float(xp.sum(xp.ones(3, device=again))) == 3
    for d in mine + [other, again]:
        d.close()


def test_a_full_peer_says_so(make_peer):
    srv = make_peer(max_sessions=2)
    a, b = ember.connect(srv.addresses[0]), ember.connect(srv.addresses[0])
    with pytest.raises(ConnectError, match=r"this peer is full \(2 sessions, --max-sessions\)"):
        ember.connect(srv.addresses[0])
    a.close(), b.close()


def test_handshake_timeout_closes_a_silent_connection(make_peer):
    srv = make_peer(handshake_timeout=0.5)
    t0 = time.monotonic()
    ws = ws_connect(srv.addresses[0])
    with pytest.raises(websockets.ConnectionClosed):
        ws.recv(timeout=10)
    assert time.monotonic() - t0 < 5
    assert srv.client_stats()["refusals"]["handshake_timeout"] == 1
    d = ember.connect(srv.addresses[0])  # a client that speaks is served
    assert float(xp.sum(xp.ones(2, device=d))) == 2
    d.close()


def test_a_batch_over_the_message_limit_ends_that_session_only(make_peer):
    srv = make_peer(max_messages=100)
    good = ember.connect(srv.addresses[0])
    assert good.session.max_batch == 49  # the client keeps under the announced limit
    x = xp.ones(4, device=good)
    for _ in range(1000):
        x = x + 1.0
    ws, _ = raw_session(srv.addresses[0])
    ws.send(codec.packb([[m.SYNC, i + 1] for i in range(200)]))
    err = answers(ws, 0)[0]
    assert err[1] == m.ERROR and err[2]["kind"] == "LimitExceeded"
    assert "batch of 200 messages exceeds this peer's limit of 100" in err[2]["message"]
    with pytest.raises(websockets.ConnectionClosed):
        ws.recv(timeout=5)
    np.testing.assert_array_equal(x.to_numpy(), np.full(4, 1001.0))
    good.close()


def test_a_reused_session_id_is_refused(make_peer):
    srv = make_peer()
    sid = os.urandom(16)
    ws1 = ws_connect(srv.addresses[0])
    ws1.send(codec.encode_hello(session_id=sid, device=0))
    assert msgpack.unpackb(ws1.recv(timeout=5))["type"] == "welcome"
    ws2 = ws_connect(srv.addresses[0])
    ws2.send(codec.encode_hello(session_id=sid, device=0))
    reply = msgpack.unpackb(ws2.recv(timeout=5))
    assert reply["type"] == "reject" and "already in use" in reply["reason"]
    assert len(srv.sessions) == 1
    ws1.close(), ws2.close()


def test_a_replay_waiting_for_a_graph_that_never_comes_ends_the_session(make_peer):
    srv = make_peer(stall_timeout=0.5)
    other = ember.connect(srv.addresses[0])
    ws, _ = raw_session(srv.addresses[0])
    ws.send(codec.packb([[m.REPLAY, 12345, [], [], []], [m.SYNC, 7]]))
    got = answers(ws, 0)
    assert got[0][1] == m.NEED_GRAPH
    err = answers(ws, 0)[0]
    assert err[1] == m.ERROR and "never sent" in err[2]["message"]
    with pytest.raises(websockets.ConnectionClosed):
        ws.recv(timeout=5)
    assert float(xp.sum(xp.ones(5, device=other))) == 5
    other.close()


def test_the_pump_stops_reading_while_the_worker_is_behind_and_keeps_the_client_alive(make_peer):
    srv = make_peer(max_inflight=4 << 20)
    srv.register_op("nap", lambda xp_, x, *, seconds: (time.sleep(seconds), x * 1.0)[1])
    d = ember.connect(srv.addresses[0], heartbeat_timeout=2.0)
    x = xp.ones(4, device=d)
    slow = ember.custom_op("nap", x, outputs=[((4,), xp.float64)], seconds=4.0)
    big = np.arange(32 << 17, dtype=np.float64)  # 32 MiB in 1 MiB chunks, sent while the worker naps
    up = xp.asarray(big, device=d)
    peak = 0
    deadline = time.monotonic() + 3.5
    while time.monotonic() < deadline:
        s = srv.memory_stats()["sessions"]
        peak = max([peak] + [e["inflight"] for e in s])
        time.sleep(0.05)
    assert peak <= (4 << 20) + (2 << 20)  # the window, plus the frame that crossed it
    # 4 s of nap > the 2 s heartbeat timeout: keepalives told the client the peer was alive
    np.testing.assert_array_equal(slow.to_numpy(), np.ones(4))
    assert float(up[-1]) == big[-1]
    d.close()


def test_answers_wait_for_the_network_instead_of_piling_up(make_peer):
    srv = make_peer(stage_window=4 << 20)
    ws, _ = raw_session(srv.addresses[0])
    data = np.arange(1 << 20, dtype=np.float64)  # 8 MiB
    chunk = 1 << 20
    for off in range(0, data.nbytes, chunk):
        ws.send(codec.packb([[m.UPLOAD, 5, "float64", [1 << 20], off, data.tobytes()[off:off + chunk], data.nbytes]]))
    ws.send(codec.packb([[m.READ, i + 1, 5] for i in range(12)] + [[m.SYNC, 99]]))  # ~96 MiB of answers
    time.sleep(1.5)  # this client reads nothing meanwhile
    staged = max([e["staged"] for e in srv.memory_stats()["sessions"]] or [0])
    assert staged <= (4 << 20) + 3 * chunk
    got = answers(ws, 99, timeout=60)
    assert sum(1 for r in got if r[1] == m.OK and r[0] != 99) == 12
    ws.close()


def test_client_and_peer_limits_are_announced():
    srv = Server(["cpu"], max_messages=1000, max_uploads=3, max_tensors=77, session_memory="1GiB")
    limits = srv.welcome_limits(0)
    assert {k: limits[k] for k in ("max_messages", "max_uploads", "max_tensors", "session_memory")} == \
        {"max_messages": 1000, "max_uploads": 3, "max_tensors": 77, "session_memory": 1 << 30}
    with pytest.raises(ember.errors.EmberError, match="unknown Server option"):
        Server(["cpu"], max_everything=3)


def test_limit_exceeded_is_a_protocol_error_subclass_for_old_handlers():
    assert issubclass(LimitExceeded, ProtocolError)


@pytest.mark.timeout(60)
def test_a_flood_of_large_frames_waits_in_the_socket_not_in_the_peer(make_peer):
    """While the worker is busy, big upload frames pile up in TCP, not in the peer's memory."""
    import threading

    from test_memory_budgets import rss
    srv = make_peer()
    srv.register_op("nap", lambda xp_, x, *, seconds: (time.sleep(seconds), x * 1.0)[1])
    ws, _ = raw_session(srv.addresses[0])
    ws.send(codec.packb([[m.UPLOAD, 1, "float64", [4], 0, np.ones(4).tobytes(), 32],
                         [m.CUSTOM, "nap", [1], [2], {"seconds": 8.0}, [[[4], "float64"]]]]))
    time.sleep(0.3)
    before = rss()
    chunk = 32 << 20
    frame = codec.packb([[m.UPLOAD, 100, "uint8", [chunk], 0, b"\1" * chunk, chunk]])

    def push() -> None:
        try:
            for _ in range(48):  # 1.5 GiB, far beyond what the peer should buffer
                ws.send(frame)
        except Exception:
            pass
    threading.Thread(target=push, daemon=True).start()
    time.sleep(4)
    grown = rss() - before  # this process hosts the peer (and the pushing client's one frame)
    assert grown < 512 << 20, f"the peer buffered {grown >> 20} MiB"
    ws.close()
