"""Issue 22's targeted attack, each hole as a probe against a real peer on loopback: refused or
bounded, and a canary session on its own connection still right."""

from __future__ import annotations

import os
import threading
import time
from typing import Iterator

import msgpack
import numpy as np
import pytest
from websockets.sync.client import connect as ws_connect

import ember
import ember.array_api as xp
from ember.protocol import codec
from ember.protocol import messages as m
from ember.server import Server
from ember.transport.base import available_memory, receive_buffer

from test_memory_budgets import answers, raw_session, wait_until

MiB = 1 << 20


@pytest.fixture
def peer() -> Iterator[Server]:
    srv = Server(["cpu", "torch:cpu"], memory_limit="64MiB", session_memory="32MiB", max_wait=2.0)
    srv.listen_websocket("127.0.0.1", 0)
    srv.start_in_thread()
    yield srv
    srv.close()


def canary(srv: Server, device: int = 0) -> None:
    d = ember.connect(srv.addresses[0], device=device)
    try:
        assert float(xp.sum(xp.arange(10, device=d))) == 45
    finally:
        d.close()


def run(ws, batch: list, req: int) -> list:
    ws.send(msgpack.packb(batch))
    return answers(ws, req)


def error_of(got: list, req: int) -> str:
    r = next(r for r in got if r[0] == req)
    assert r[1] == m.ERROR, r
    return r[2]["message"]


@pytest.mark.parametrize("device", [0, 1])
def test_freed_data_is_never_read_back(peer, device):
    """Item 1: a victim's freed values never reach another session (empty, empty_like, where=)."""
    v = ember.connect(peer.addresses[0], device=device)
    a = xp.full((32768,), 1234.5678, device=v)
    (a * 1.0 + 0.0).to_numpy()
    del a
    v.close()
    w = ember.connect(peer.addresses[0], device=device)
    assert not np.any(xp.empty((32768,), device=w).to_numpy())
    assert not np.any(xp.empty_like(xp.ones((32768,), device=w)).to_numpy())
    w.close()
    ws, _ = raw_session(peer.addresses[0])
    got = run(ws, [[m.OP, "zeros", [], 0, [1], {"shape": [8], "dtype": "float64"}],
                   [m.OP, "add", [1, 1], 0, [2], {"where": False}], [m.READ, 5, 2]], 5)
    assert "where" in error_of(got, 5)
    ws.close()
    canary(peer, device)


OBJECT_MAKERS = {
    "full of a list": [m.OP, "full", [], 0, [9], {"shape": [4], "fill_value": [None, 1]}],
    "full of a dict": [m.OP, "full", [], 0, [9], {"shape": [4], "fill_value": {"a": 1}}],
    "full of a string": [m.OP, "full", [], 0, [9], {"shape": [1 << 20], "fill_value": "x" * 100}],
    "astype to object": [m.OP, "astype", [1, "O"], 2, [9], None],
    "where with a dict": [m.OP, "where", [2, {}, 1], 6, [9], None],
    "multiply by a string": [m.OP, "multiply", [1, "abc"], 2, [9], None],
}


@pytest.mark.parametrize("name", sorted(OBJECT_MAKERS))
def test_no_object_or_string_array_can_exist(peer, name):
    """Item 2: only the device's dtypes exist; what would make an object array is refused at once."""
    ws, _ = raw_session(peer.addresses[0])
    setup = [[m.OP, "ones", [], 0, [1], {"shape": [4], "dtype": "float64"}],
             [m.OP, "ones", [], 0, [2], {"shape": [4], "dtype": "bool"}]]
    t0 = time.monotonic()
    got = run(ws, setup + [OBJECT_MAKERS[name], [m.OP, "pow", [9, 2e7], 2, [10], None], [m.SHAPE, 7, 10]], 7)
    error_of(got, 7)
    assert time.monotonic() - t0 < 5
    ws.close()
    canary(peer)


def test_graph_scalars_are_plain_and_charged(peer):
    """Items 2 and 5: a graph's dict scalar is refused; its big scalars are charged and evicted."""
    ws, _ = raw_session(peer.addresses[0])
    ws.send(msgpack.packb([[m.GRAPH, 1, 0, [{"a": 1}], [["add", [0, 0], 1, None]], [1], []]]))
    assert "dict" in msgpack.unpackb(ws.recv(timeout=10))[0][2]["message"]
    ws.close()
    ws, _ = raw_session(peer.addresses[0])
    big = [0] * (1 * MiB)  # 1 MiB on the wire, 8 MiB of Python list on the peer
    for gid in range(8):
        ws.send(msgpack.packb([[m.GRAPH, gid, 0, [big], [["add", [0, 0], 1, None]], [1], []]]))
    got = run(ws, [[m.SYNC, 3]], 3)
    assert got[-1][1] == m.OK
    g = max((s.interp.graphs for s in peer.sessions.values()), key=lambda g: g.nbytes)
    assert len(g) <= 2 and 8 * MiB <= g.nbytes <= 20 * MiB, (g.nbytes, len(g))  # charged, then evicted
    ws.close()
    canary(peer)


def test_huge_frame_of_arrays_is_bounded_and_quick(peer):
    """Item 3: a SYNC of millions of tiny arrays is refused after a bounded count; PINGs carry on."""
    d = ember.connect(peer.addresses[0])
    xp.sum(xp.arange(3, device=d)).to_numpy()
    ws, _ = raw_session(peer.addresses[0])
    frame = msgpack.packb([[m.SYNC, 1, [[0]] * 6_000_000]])
    worst = [0.0]
    done = threading.Event()

    def ping() -> None:
        while not done.is_set():
            t = time.monotonic()
            d.sync()
            worst[0] = max(worst[0], time.monotonic() - t)

    th = threading.Thread(target=ping, daemon=True)
    th.start()
    t0 = time.monotonic()
    ws.send(frame)
    try:
        ws.recv(timeout=20)
    except Exception:  # noqa: BLE001 - the peer may end that session: either way it answered quickly
        pass
    took = time.monotonic() - t0
    done.set()
    th.join(10)
    assert took < 10 and worst[0] < 5, (took, worst[0])
    assert float(xp.sum(xp.arange(10, device=d))) == 45
    d.close()


BROADCAST_OPS = [("fft.fftshift", None), ("diff", None), ("std", None), ("linalg.vector_norm", None),
                 ("flip", None), ("isin", "isin")]


@pytest.mark.parametrize("name,kind", BROADCAST_OPS)
def test_ops_over_a_broadcast_view_are_charged_first(peer, name, kind):
    """Item 8: an op the peer cannot predict, over a 512 MiB broadcast view, is refused before it allocates."""
    ws, _ = raw_session(peer.addresses[0])
    view = [[m.OP, "ones", [], 0, [1], {"shape": [1], "dtype": "float64"}],
            [m.OP, "broadcast_to", [1], 0, [2], {"shape": [1 << 13, 1 << 13]}]]
    op = [m.OP, name, [2, 1] if kind == "isin" else [2], 0, [3], None]
    got = run(ws, view + [op, [m.SHAPE, 4, 3]], 4)
    assert "LimitExceeded" == next(r for r in got if r[0] == 4)[2]["kind"]
    ws.close()
    canary(peer)


def test_aten_declared_outputs_are_charged_first(peer):
    """Item 8: an ATen call whose client-declared output storage is 1.2 GB is refused, not zero-filled."""
    ws = ws_connect(peer.addresses[0], max_size=None)
    ws.send(codec.encode_hello(session_id=os.urandom(16), device=1, features=[]))
    assert msgpack.unpackb(ws.recv(timeout=10))["type"] == "welcome"
    lay = [[4], [1], 0, "float32"]
    got = run(ws, [[m.OP, "torch.alloc", [], 0, [1], {"n": 16}],
                   [m.OP, "aten.add.Tensor", [[1], 1, 1], 1, [2],
                    {"a": [0, 0, 1], "l": [lay, lay], "o": [[0, [4], [1], 0, "float32", 1200 * MiB]]}],
                   [m.SHAPE, 5, 2]], 5)
    assert next(r for r in got if r[0] == 5)[2]["kind"] == "LimitExceeded"
    ws.close()
    canary(peer, 1)


def test_a_huge_receive_buffer_raises_memory_error():
    """Item 13: a read larger than the machine raises MemoryError with the size, committing nothing."""
    free = available_memory()
    assert free is not None
    with pytest.raises(MemoryError, match=str(free * 4)):
        receive_buffer(free * 4)
    assert len(receive_buffer(40 * MiB)) == 40 * MiB


def test_a_refused_large_read_does_not_grow_the_client(peer):
    """Item 13: the peer refuses a 1 GiB array; the client's memory stays put and its session lives."""
    d = ember.connect(peer.addresses[0])
    x = xp.ones((1 << 27,), device=d)
    with open("/proc/self/statm") as f:
        before = int(f.read().split()[1]) * 4096
    with pytest.raises(ember.errors.LimitExceeded):
        x.to_numpy()
    with open("/proc/self/statm") as f:
        after = int(f.read().split()[1]) * 4096
    assert after - before < 256 * MiB
    assert float(xp.sum(xp.arange(10, device=d))) == 45
    d.close()


def _statm_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_connections_before_login_hold_a_few_kib():
    """Item 4: huge length prefixes before a Hello are refused unread; idle unauthenticated
    connections are capped per client; a canary then logs in and computes."""
    import socket
    from ember.server.guard.limits import MAX_PENDING_PER_CLIENT
    from ember.transport.tcp import PREAMBLE
    tcp = Server(["cpu"], memory_limit="64MiB", session_memory="32MiB")
    tcp.listen_tcp("127.0.0.1", 0)
    addr = [a for a in tcp.start_in_thread() if a.startswith("tcp://")][0]
    try:
        hp = addr[len("tcp://"):].rsplit(":", 1)
        base = _statm_rss()
        bombs = []
        for _ in range(20):  # 64 MiB frames announced before any Hello
            s = socket.create_connection((hp[0], int(hp[1])))
            s.sendall(PREAMBLE + (64 << 20).to_bytes(4, "big"))
            bombs.append(s)
        for s in bombs:
            s.settimeout(10)
            assert s.recv(1) == b""  # closed, unread
            s.close()
        idle = [socket.create_connection((hp[0], int(hp[1]))) for _ in range(MAX_PENDING_PER_CLIENT + 16)]
        closed = 0
        for s in idle[-16:]:
            s.settimeout(10)
            try:
                closed += s.recv(1) == b""
            except OSError:
                closed += 1
        assert closed == 16  # past the cap: closed at once
        assert _statm_rss() - base < 64 << 20
        for s in idle:
            s.close()
        d = None
        for _ in range(100):  # the idle ones are gone once the peer sees them closed
            try:
                d = ember.connect(addr)
                break
            except ember.errors.EmberError:
                time.sleep(0.05)
        assert d is not None and float(xp.sum(xp.arange(10, device=d))) == 45
        d.close()
    finally:
        tcp.close()


def test_orphaned_work_stops_and_counts_until_gone():
    """Item 11: a client queues long work and drops the connection: the work stops between ops, and the
    session counts against its client until its worker is gone."""
    srv = Server(["cpu"], memory_limit="64MiB", session_memory="32MiB", max_sessions_per_client=2)
    srv.listen_websocket("127.0.0.1", 0)
    addr = srv.start_in_thread()[0]
    try:
        ws, _ = raw_session(addr)
        ws.send(msgpack.packb([[m.OP, "ones", [], 0, [1], {"shape": [400, 400], "dtype": "float64"}]]
                              + [[m.OP, "matmul", [1, 1], 0, [2 + i % 4], None] for i in range(16000)]))
        assert wait_until(lambda: srv.live and next(iter(srv.live)).interp.ops_run >= 0, 10)
        time.sleep(0.2)  # the worker is in the middle of the batch
        ws.close()
        t0 = time.monotonic()
        assert wait_until(lambda: not srv.live, 20), "the orphaned worker kept computing"
        assert time.monotonic() - t0 < 10  # (16,000 matmuls of 400x400 take over a minute)
        assert wait_until(lambda: not srv.admission.per_client, 10)
        canary(srv)
    finally:
        srv.close()


def test_attribute_path_aten_names_are_refused_without_a_traceback_flood():
    """Item 12: ``aten.__class__.__init__`` with metrics on: refused each time, logged at most once."""
    import io
    import logging
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    logging.getLogger("ember").addHandler(handler)
    srv = Server(["torch:cpu"])
    srv.listen_websocket("127.0.0.1", 0)
    srv.listen_metrics("127.0.0.1", 0)
    addr = srv.start_in_thread()[0]
    try:
        ws = ws_connect(addr, max_size=None)
        ws.send(codec.encode_hello(session_id=os.urandom(16), device=0, features=[]))
        assert msgpack.unpackb(ws.recv(timeout=10))["type"] == "welcome"
        for i in range(100):
            got = run(ws, [[m.OP, "aten.__class__.__init__", [[]], 1, [2], {"a": [], "l": [], "o": []}],
                           [m.SHAPE, 5 + i, 2]], 5 + i)
            assert got[-1][1] == m.ERROR
        ws.close()
        canary(srv)
    finally:
        srv.close()
        logging.getLogger("ember").removeHandler(handler)
    assert "Traceback" not in buf.getvalue() and len(buf.getvalue()) < 4096


def test_one_client_cannot_fill_the_exposure_table():
    """Item 10: EXPOSE of an id the session does not hold is refused; one client's sessions together
    hold at most a quarter of the server's table; another tenant's MOVE still works."""
    srv = Server(["cpu", "cpu"], memory_limit="64MiB", session_memory="32MiB")
    srv.listen_websocket("127.0.0.1", 0)
    addr = srv.start_in_thread()[0]
    hub = srv.transfers
    try:
        ws, _ = raw_session(addr)
        ws.send(msgpack.packb([[m.EXPOSE, 99, os.urandom(32), None, 1, 3600.0]]))
        assert run(ws, [[m.SYNC, 1]], 1)[-1][1] == m.OK
        assert hub.exposed_count() == 0  # unknown id: nothing exposed
        sessions = []
        for k in range(8):  # 8 sessions x 256 exposures of a real tensor, TTL an hour
            w, _ = raw_session(addr)
            batch = [[m.OP, "zeros", [], 0, [1], {"shape": [1], "dtype": "float64"}]]
            batch += [[m.EXPOSE, 1, os.urandom(32), None, 1, 3600.0] for _ in range(256)]
            assert run(w, batch + [[m.SYNC, 2]], 2)[-1][1] == m.OK
            sessions.append(w)
        assert hub.exposed_count() <= hub.per_client <= hub.max_entries // 4 + 256
        assert hub.max_entries - hub.exposed_count() >= hub.max_entries // 2  # room for other clients
        for w in sessions[:4]:  # (on loopback every client is one address: free some of its share)
            w.close()
        assert wait_until(lambda: hub.exposed_count() <= hub.per_client - 256, 10)
        d0, d1 = ember.connect(addr, device=0), ember.connect(addr, device=1)
        assert xp.arange(5, device=d0).to_device(d1).to_numpy().tolist() == [0, 1, 2, 3, 4]
        d0.close(), d1.close()
        for w in sessions[4:]:
            w.close()
        ws.close()
    finally:
        srv.close()


def test_poisoned_ids_are_bounded(peer):
    """Item 9: 40,000 failing ops keep at most MAX_POISON errors; the latest still reads back its error."""
    from ember.server.execute.holdings import MAX_POISON
    ws, _ = raw_session(peer.addresses[0])
    for k in range(4):
        ws.send(msgpack.packb([[m.OP, "add", [10 ** 6 + i, 1], 0, [k * 10_000 + i], None] for i in range(10_000)]))
    got = run(ws, [[m.READ, 7, 39_999]], 7)
    assert "unknown" in error_of(got, 7)
    (sess,) = peer.sessions.values()
    assert len(sess.interp.poison) <= MAX_POISON
    ws.close()
    canary(peer)


def test_unread_answers_stop_the_reading():
    """Item 7: a client sends a million lone PINGs and never reads: the peer queues at most MAX_UNSENT
    answers, then stops reading that session; a canary is served meanwhile."""
    import socket
    from ember.server.session import MAX_UNSENT
    from ember.transport.tcp import PREAMBLE
    srv = Server(["cpu"], memory_limit="64MiB", session_memory="32MiB")
    srv.listen_tcp("127.0.0.1", 0)
    addr = [a for a in srv.start_in_thread() if a.startswith("tcp://")][0]
    try:
        host, port = addr[len("tcp://"):].rsplit(":", 1)
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
        s.connect((host, int(port)))
        hello = codec.encode_hello(session_id=os.urandom(16), device=0, features=[])
        s.sendall(PREAMBLE + len(hello).to_bytes(4, "big") + hello)
        ping = msgpack.packb([[m.PING, 1]])
        blob = (len(ping).to_bytes(4, "big") + ping) * 1_000_000
        s.settimeout(4)
        sent = 0
        try:
            while sent < len(blob):
                sent += s.send(blob[sent:sent + (1 << 20)])
        except socket.timeout:
            pass  # the peer stopped reading: the point
        assert wait_until(lambda: srv.sessions, 10)
        (sess,) = srv.sessions.values()
        worst = 0
        for _ in range(20):
            worst = max(worst, sess.outbox.qsize())
            time.sleep(0.02)
        assert worst <= MAX_UNSENT + 64, worst
        d = ember.connect(addr)
        assert float(xp.sum(xp.arange(10, device=d))) == 45
        d.close()
        s.close()
    finally:
        srv.close()


def test_uploads_held_by_a_graph_stall_are_bounded(peer):
    """Item 6: a REPLAY of an unknown graph, then uploads that are never run: past MAX_STALLED_BYTES
    the session ends with the reason (it held 1.4 GB before); the canary is served."""
    from ember.server.execute.replay import MAX_STALLED_BYTES
    ws, _ = raw_session(peer.addresses[0])
    ws.send(msgpack.packb([[m.REPLAY, 12345, [], [], []]]))
    assert msgpack.unpackb(ws.recv(timeout=10))[0][1] == m.NEED_GRAPH
    chunk = b"\0" * (8 * MiB)
    why = None
    try:
        for k in range(MAX_STALLED_BYTES // len(chunk) + 4):
            ws.send(msgpack.packb([[m.UPLOAD, 100 + k, "uint8", [len(chunk)], 0, chunk, len(chunk)]]))
        why = msgpack.unpackb(ws.recv(timeout=20))[0][2]["message"]
    except Exception:  # noqa: BLE001 - the session may end before the last send
        pass
    assert wait_until(lambda: not peer.sessions, 6)  # (before the 10 s stall timeout would end it)
    assert why is None or "graph 12345" in why
    ws.close()
    canary(peer)
