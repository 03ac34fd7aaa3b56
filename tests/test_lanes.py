"""Lanes (feature ``"lanes"``): large uploads and read answers striped over several streams of the
session's peer, and downloads between iroh peers striped over several transfer streams.

Real servers on loopback only: iroh offline (conftest), WebSocket on 127.0.0.1. Hostile lanes are
raw streams that send what a real client never would.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any, Iterator

import msgpack
import numpy as np
import pytest
from websockets.sync.client import connect as ws_connect

import ember
import ember.array_api as xp
from ember.client.io import run_sync
from ember.errors import LimitExceeded, ProtocolError, SessionLost
from ember.protocol import codec
from ember.protocol import lanes as pl
from ember.protocol import messages as m
from ember.server import Server
from ember.server.lanes import MAX_REFUSED
from ember.transport import dial

from test_memory_budgets import wait_until

LOOPBACK = ["127.0.0.1:0", "[::1]:0"]
CHUNK = m.DEFAULT_CHUNK
MiB = 1 << 20


# ---- protocol (sans-I/O) ---------------------------------------------------------------------

@pytest.mark.timeout(30)
@pytest.mark.parametrize("total,k", [(0, 4), (1, 4), (CHUNK, 4), (CHUNK + 1, 4), (3 * CHUNK, 4),
                                     (10 * CHUNK + 17, 4), (8 * CHUNK, 3), (5 * CHUNK, 8), (7 * CHUNK - 1, 1)])
def test_stripe_bounds_cover_every_byte_once_on_chunk_boundaries(total, k):
    b = pl.stripe_bounds(total, CHUNK, k)
    chunks = max(1, -(-total // CHUNK))
    assert len(b) == min(k, chunks)
    assert b[0][0] == 0 and b[-1][1] == total
    for (lo, hi), (lo2, _) in zip(b, b[1:]):
        assert hi == lo2 and lo < hi  # contiguous, none empty unless the tensor is
    for lo, hi in b:
        assert lo % CHUNK == 0 and (hi % CHUNK == 0 or hi == total)
    sizes = [hi - lo for lo, hi in b]
    if total >= k * CHUNK:  # balanced to within a chunk
        assert max(sizes) - min(sizes) <= CHUNK


@pytest.mark.timeout(30)
def test_stripe_bounds_of_an_empty_tensor_is_one_empty_stripe():
    assert pl.stripe_bounds(0, CHUNK, 4) == [(0, 0)]
    assert pl.stripe_bounds(0, CHUNK, 1) == [(0, 0)]


@pytest.mark.timeout(30)
def test_coverage_takes_each_chunk_exactly_once_and_completes_once():
    total, c = 3 * 100 + 42, 100
    cov = pl.Coverage(total, c)
    assert not cov.complete and cov.missing == 4
    assert not cov.expect(50, 100)       # misaligned
    assert not cov.expect(-100, 100)     # negative
    assert not cov.expect(400, 42)       # past the end
    assert not cov.expect(300, 100)      # the last chunk is shorter
    assert not cov.expect(0, 99)         # wrong length
    assert not cov.expect(1.0, 100)      # not an int
    assert not cov.expect(True, 100)     # a bool is no offset either
    assert cov.missing == 4              # refusals mark nothing
    assert cov.expect(300, 42) and cov.expect(100, 100) and cov.expect(0, 100)
    assert not cov.expect(100, 100)      # duplicate
    assert not cov.complete and cov.missing == 1
    assert cov.expect(200, 100) and cov.complete
    assert not cov.expect(200, 100) and cov.complete and cov.missing == 0


@pytest.mark.timeout(30)
def test_attach_frames_round_trip_and_malformed_lane_requests_are_refused():
    sid, key = os.urandom(16), os.urandom(32)
    assert pl.decode_first(codec.unpackb(pl.encode_attach(sid, key))) == ("lane", sid, key)
    assert pl.decode_first(codec.unpackb(pl.encode_transfer_lane(key, 3))) == ("transfer_lane", key, 3)
    assert pl.decode_first({"type": "transfer", "key": key}) is None
    assert pl.decode_first([1, 2, 3]) is None
    bad = [{"type": "lane", "session_id": sid, "key": key[:31]},
           {"type": "lane", "session_id": sid, "key": "x" * 32},
           {"type": "lane", "session_id": sid},
           {"type": "lane", "session_id": sid[:15], "key": key},
           {"type": "lane", "session_id": 7, "key": key},
           {"type": "transfer_lane", "key": key, "index": 0},
           {"type": "transfer_lane", "key": key, "index": pl.MAX_LANES},
           {"type": "transfer_lane", "key": key, "index": True},
           {"type": "transfer_lane", "key": key, "index": "1"},
           {"type": "transfer_lane", "key": key[:5], "index": 1}]
    for d in bad:
        with pytest.raises(ProtocolError):
            pl.decode_first(d)


@pytest.mark.timeout(30)
def test_agreed_lanes_needs_the_feature_and_a_well_formed_offer():
    key = os.urandom(32)
    w = {"features": ["data", "lanes"], "lanes": {"key": key, "max": 6, "min_bytes": pl.STRIPE_MIN, "chunk": CHUNK}}
    assert pl.agreed_lanes(w, 4) == (4, key)
    assert pl.agreed_lanes(w, 7) == (6, key)   # the peer's max
    assert pl.agreed_lanes({**w, "lanes": {**w["lanes"], "max": 99}}, 99) == (pl.MAX_LANES, key)
    assert pl.agreed_lanes(w, 0) == (0, key)
    assert pl.agreed_lanes({**w, "features": ["data"]}, 4) == (0, None)
    assert pl.agreed_lanes({"features": ["data", "lanes"]}, 4) == (0, None)
    assert pl.agreed_lanes({**w, "lanes": {"key": key[:8], "max": 4}}, 4) == (0, None)
    assert pl.agreed_lanes({**w, "lanes": {"key": key, "max": "4"}}, 4) == (0, None)


# ---- real peers -------------------------------------------------------------------------------

@pytest.fixture
def peer() -> Iterator[Server]:
    """One peer serving iroh (offline) and WebSocket on loopback."""
    srv = Server(["cpu"])
    srv.listen_iroh(offline=True, bind=LOOPBACK)
    srv.listen_websocket("127.0.0.1", 0)
    srv.start_in_thread()
    yield srv
    srv.close()


def _ticket(srv: Server) -> str:
    return next(a for a in srv.addresses if a.startswith("endpoint"))


def _ws(srv: Server) -> str:
    return next(a for a in srv.addresses if a.startswith("ws://"))


def _server_session(srv: Server, dev: ember.Device) -> Any:
    return srv.sessions[dev.session._session_id]


def _count(obj: Any, name: str) -> list[int]:
    """Count calls of ``obj.name`` (a spy: the real method still runs)."""
    calls = [0]
    real = getattr(obj, name)

    def spy(*a: Any, **kw: Any) -> Any:
        calls[0] += 1
        return real(*a, **kw)
    setattr(obj, name, spy)
    return calls


ARRAYS = [
    ("float64, not a multiple of the chunk", lambda r: r.standard_normal(3 * CHUNK // 8 + 13)),
    ("float32 2-d", lambda r: r.standard_normal((1031, 1033)).astype(np.float32)),
    ("uint8, exactly STRIPE_MIN", lambda r: r.integers(0, 256, pl.STRIPE_MIN, dtype=np.uint8)),
    ("int16, odd", lambda r: r.integers(-30000, 30000, 5 * CHUNK // 2 + 1, dtype=np.int16)),
    ("complex128", lambda r: (r.standard_normal(200_003) + 1j * r.standard_normal(200_003))),
    ("bool", lambda r: r.integers(0, 2, 2 * CHUNK + 5).astype(bool)),
]


@pytest.mark.timeout(120)
def test_striped_uploads_and_reads_over_iroh_are_bit_exact(peer):
    dev = ember.connect(_ticket(peer), lanes=4)
    try:
        rng = np.random.default_rng(11)
        s = None
        for name, make in ARRAYS:
            a = make(rng)
            assert a.nbytes >= pl.STRIPE_MIN, name
            x = xp.asarray(a, device=dev)
            if s is None:  # lanes open with the first large transfer
                dev.sync()  # (its UPLOAD has run on the peer before the spies go in)
                assert len(dev.session.lanes) == 4
                s = _server_session(peer, dev)
                assert s.lanes is not None and len(s.lanes.conns) == 4
                finished, striped = _count(s.lanes, "finish"), _count(s.lanes, "send_read")
            back = x.to_numpy()
            assert back.dtype == a.dtype and back.shape == a.shape, name
            assert back.tobytes() == a.tobytes(), name
        assert finished[0] == len(ARRAYS) - 1  # every later upload's bytes came on the lanes
        assert striped[0] == len(ARRAYS)  # every read answer went out over them
        sizes = sum(make(np.random.default_rng(0)).nbytes for _, make in ARRAYS)
        assert s.bytes_out >= sizes and s.bytes_in >= sizes - ARRAYS[0][1](np.random.default_rng(0)).nbytes
    finally:
        dev.close()


@pytest.mark.timeout(120)
def test_lanes_are_the_default_over_iroh_and_lanes_0_opens_none(peer):
    a = np.random.default_rng(2).standard_normal(3 * CHUNK // 8)
    dflt = ember.connect(_ticket(peer))
    off = ember.connect(_ticket(peer), lanes=0)
    try:
        for dev in (dflt, off):
            np.testing.assert_array_equal(xp.asarray(a, device=dev).to_numpy(), a)
        assert len(dflt.session.lanes) == pl.DEFAULT_LANES
        assert len(_server_session(peer, dflt).lanes.conns) == pl.DEFAULT_LANES
        assert off.session.lanes == [] and off.session.lanes_wanted == 0
        assert _server_session(peer, off).lanes is None  # the feature was not even offered
        assert m.LANES_FEATURE not in off.session.welcome.get("features", [])
    finally:
        dflt.close()
        off.close()


@pytest.mark.timeout(120)
def test_order_is_kept_between_striped_uploads_small_ops_and_mixed_reads(peer):
    dev = ember.connect(_ticket(peer), lanes=4)
    try:
        rng = np.random.default_rng(5)
        a, b = rng.standard_normal(CHUNK // 2 + 7), rng.standard_normal(CHUNK // 2 + 7)  # 4 MiB each
        x = xp.asarray(a, device=dev)
        y = x * 2.0 + 1.0           # small ops using the striped upload, queued after it
        head = x[:10]
        z = xp.asarray(b, device=dev)
        w = y - z                   # needs both uploads in place
        tiny = xp.asarray(np.arange(5.0), device=dev) + z[:5]
        np.testing.assert_array_equal(head.to_numpy(), a[:10])                # not striped
        np.testing.assert_array_equal(w.to_numpy(), a * 2.0 + 1.0 - b)        # striped
        np.testing.assert_array_equal(tiny.to_numpy(), np.arange(5.0) + b[:5])
        assert float(xp.sum(x)) == pytest.approx(a.sum())
        np.testing.assert_array_equal(y.to_numpy(), a * 2.0 + 1.0)
        for _ in range(3):  # an upload over an id's old value is seen by what comes after it
            x = xp.asarray(a + 1.0, device=dev)
            a = a + 1.0
        np.testing.assert_array_equal((x - 1.0).to_numpy(), a - 1.0)
        assert len(dev.session.lanes) == 4
    finally:
        dev.close()


@pytest.mark.timeout(120)
def test_lanes_over_websocket_and_tcp_when_asked(peer):
    peer_tcp = Server(["cpu"])
    peer_tcp.listen_tcp("127.0.0.1", 0)
    peer_tcp.start_in_thread()
    try:
        a = np.random.default_rng(9).standard_normal(3 * CHUNK // 8 + 5)
        for srv, addr in ((peer, _ws(peer)), (peer_tcp, peer_tcp.addresses[0])):
            dflt = ember.connect(addr)
            assert dflt.session.lanes_wanted == 0  # not by default off iroh
            dflt.close()
            dev = ember.connect(addr, lanes=2)
            try:
                x = xp.asarray(a, device=dev)
                assert len(dev.session.lanes) == 2, addr
                s = _server_session(srv, dev)
                assert len(s.lanes.conns) == 2
                striped = _count(s.lanes, "send_read")
                assert (x + 0.0).to_numpy().tobytes() == a.tobytes()
                assert striped[0] == 1
            finally:
                dev.close()
    finally:
        peer_tcp.close()


@pytest.mark.timeout(30)
def test_lanes_out_of_range_are_refused_at_connect(peer):
    with pytest.raises(ember.errors.ConnectError, match="lanes must be between 0 and"):
        ember.connect(_ws(peer), lanes=pl.MAX_LANES + 1)


@pytest.mark.timeout(120)
def test_a_striped_upload_over_the_session_budget_is_refused_and_the_session_carries_on():
    srv = Server(["cpu"], session_memory="6MiB")
    srv.listen_iroh(offline=True, bind=LOOPBACK)
    srv.start_in_thread()
    try:
        dev = ember.connect(_ticket(srv), lanes=4)
        first = np.ones(4 * MiB // 8)
        x = xp.asarray(first, device=dev)  # 4 MiB held
        second = np.arange(4 * MiB // 8, dtype=np.float64)
        y = xp.asarray(second, device=dev)  # striped; over the budget with x
        assert len(dev.session.lanes) == 4
        with pytest.raises(LimitExceeded) as e:
            y.to_numpy()
        assert "session memory budget of 6.0 MiB" in str(e.value)
        assert float(xp.sum(x)) == first.sum()  # the session carries on
        np.testing.assert_array_equal((xp.ones(3, device=dev) * 2).to_numpy(), [2.0, 2.0, 2.0])
        assert wait_until(lambda: srv.memory_held() <= 4 * MiB + (1 << 16))  # the refused buffer is not held
        dev.close()
        assert wait_until(lambda: srv.memory_held() == 0), srv.memory_held()
    finally:
        srv.close()


@pytest.mark.timeout(120)
def test_refused_striped_uploads_leave_nothing_behind_and_never_end_the_session():
    """Regression: chunks of a refused upload that came after its UPLOAD ran began it anew (another
    refusal), and its id stayed among the refused until, after MAX_REFUSED of them, the session ended."""
    srv = Server(["cpu"], session_memory="12MiB")
    srv.listen_iroh(offline=True, bind=LOOPBACK)
    srv.start_in_thread()
    try:
        dev = ember.connect(_ticket(srv), lanes=4)
        x = xp.asarray(np.ones(4 * MiB // 8), device=dev)
        s = _server_session(srv, dev)
        big = np.ones(10 * MiB // 8)
        n = MAX_REFUSED + 2
        for i in range(n):
            y = xp.asarray(big, device=dev)
            with pytest.raises(LimitExceeded):
                y.to_numpy()
            del y
        assert s.alive and dev.session._session_id in srv.sessions
        assert wait_until(lambda: not s.lanes.refused and not s.lanes.dropping and not s.lanes.assemblies)
        assert s.interp.mem.refusals == n  # one refusal per upload, not one per late chunk
        assert float(xp.sum(x)) == 4 * MiB // 8
        dev.close()
        assert wait_until(lambda: srv.memory_held() == 0)
    finally:
        srv.close()


# ---- hostile lanes ------------------------------------------------------------------------------

def _raw_lane(address: str, session_id: bytes, key: bytes) -> Any:
    """A raw lane stream opened on the client's I/O loop; its first answer."""
    async def go() -> tuple[Any, Any]:
        conn = await dial(address, timeout=10.0, max_frame=m.DEFAULT_MAX_FRAME)
        await conn.send(pl.encode_attach(session_id, key))
        reply = await asyncio.wait_for(conn.recv(), 10.0)
        return conn, codec.unpackb(reply)
    return run_sync(go(), 15.0, "opening a raw lane")


def _send(conn: Any, *frames: Any) -> None:
    async def go() -> None:
        for f in frames:
            await conn.send(f)
    run_sync(go(), 10.0, "sending on a raw lane")


def _close(conn: Any) -> None:
    run_sync(conn.close(), 10.0, "closing a raw lane")


def _chunk(tid: int, off: int, n: int, total: int) -> tuple[bytes, bytes]:
    return codec.data_prefix([m.UPLOAD, tid, "uint8", [total], off, None, total]), bytes(n)


def _canary(dev: ember.Device) -> None:
    assert float(xp.sum(xp.arange(10.0, device=dev))) == 45.0


@pytest.mark.timeout(120)
def test_lanes_with_a_wrong_key_unknown_session_or_from_another_peer_are_refused(peer):
    ticket = _ticket(peer)
    dev = ember.connect(ticket, lanes=4)
    ws_dev = ember.connect(_ws(peer), lanes=2)
    try:
        _canary(dev)
        sid, key = dev.session._session_id, dev.session.welcome["lanes"]["key"]
        cases = [(sid, os.urandom(32), "wrong lane key"),
                 (os.urandom(16), key, "no session with lanes by that id"),
                 # an iroh stream to a WebSocket session: not the session's peer
                 (ws_dev.session._session_id, ws_dev.session.welcome["lanes"]["key"], "session's own peer")]
        for s_id, k, why in cases:
            conn, reply = _raw_lane(ticket, s_id, k)
            assert reply["type"] == "denied" and why in reply["reason"]
            _close(conn)
        a = np.random.default_rng(1).standard_normal(3 * CHUNK // 8)
        for d in (dev, ws_dev):  # both sessions carry on, and get their lanes
            _canary(d)
            assert xp.asarray(a, device=d).to_numpy().tobytes() == a.tobytes()
        assert len(_server_session(peer, dev).lanes.conns) == 4
    finally:
        dev.close()
        ws_dev.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("what", ["duplicate", "misaligned", "outside", "not data", "not an upload"])
def test_a_lane_that_sends_what_it_must_not_ends_its_session_only(peer, what):
    ticket = _ticket(peer)
    victim, other = ember.connect(ticket, lanes=4), ember.connect(ticket, lanes=4)
    try:
        _canary(victim)
        conn, reply = _raw_lane(ticket, victim.session._session_id, victim.session.welcome["lanes"]["key"])
        assert reply == {"type": "lane"}
        total = 3 * CHUNK
        frames = {"duplicate": [_chunk(7, 0, CHUNK, total), _chunk(7, 0, CHUNK, total)],
                  "misaligned": [_chunk(7, 100, CHUNK, total)],
                  "outside": [_chunk(7, 3 * CHUNK, CHUNK, total)],
                  "not data": [codec.packb([[m.SYNC, 1]])],
                  "not an upload": [codec.data_prefix([1, m.CHUNK, [0, None, CHUNK]]) + bytes(CHUNK)]}[what]
        x = xp.asarray(np.arange(4.0), device=victim)
        old = victim.session
        _send(conn, *frames)
        assert wait_until(lambda: old.lost is not None, 15.0)
        assert isinstance(old.lost, ProtocolError) and "lane" in old.lost.message, old.lost
        with pytest.raises((ProtocolError, SessionLost)):
            x.to_numpy()  # its arrays went with it
        _canary(victim)  # new work on the device opens a new session
        assert victim.session is not old
        _canary(other)  # another client's session carries on
        a = np.random.default_rng(4).standard_normal(3 * CHUNK // 8)
        assert xp.asarray(a, device=other).to_numpy().tobytes() == a.tobytes()
        assert wait_until(lambda: old._session_id not in peer.sessions)
        _close(conn)
    finally:
        victim.close()
        other.close()


@pytest.mark.timeout(60)
def test_a_lane_the_peer_closes_ends_the_session_for_the_caller_in_bounded_time(peer):
    dev = ember.connect(_ticket(peer), lanes=4)
    try:
        a = np.random.default_rng(3).standard_normal(3 * CHUNK // 8)
        x = xp.asarray(a, device=dev)
        old, s = dev.session, _server_session(peer, dev)
        assert len(s.lanes.conns) == 4
        t0 = time.monotonic()
        asyncio.run_coroutine_threadsafe(s.lanes.conns[0].close(), peer._loop).result(10)
        assert wait_until(lambda: old.lost is not None, 10.0)
        # the caller learns that a lane went: lost, or the peer's reason when it ended the session first
        assert isinstance(old.lost, (SessionLost, ProtocolError)) and "lane" in old.lost.message, old.lost
        with pytest.raises((SessionLost, ProtocolError)):
            x.to_numpy()
        assert time.monotonic() - t0 < 10.0
        assert wait_until(lambda: old._session_id not in peer.sessions, 10.0)  # not left behind on the peer
        _canary(dev)  # new work opens a new session (with its own lanes)
        assert xp.asarray(a, device=dev).to_numpy().tobytes() == a.tobytes() and len(dev.session.lanes) == 4
    finally:
        dev.close()


def _raw_ws_session(address: str) -> tuple[Any, dict[str, Any], bytes]:
    sid = os.urandom(16)
    ws = ws_connect(address, max_size=None)
    ws.send(codec.encode_hello(session_id=sid, device=0, features=["data", "lanes"]))
    welcome = msgpack.unpackb(ws.recv(timeout=5))
    assert welcome["type"] == "welcome" and "lanes" in welcome["features"]
    info = welcome["lanes"]
    assert len(info["key"]) == 32 and info["max"] == pl.MAX_LANES and info["min_bytes"] == pl.STRIPE_MIN
    assert info["chunk"] == CHUNK
    return ws, welcome, sid


def _raw_ws_lane(address: str, sid: bytes, key: bytes) -> Any:
    lane = ws_connect(address, max_size=None)
    lane.send(pl.encode_attach(sid, key))
    assert msgpack.unpackb(lane.recv(timeout=5)) == {"type": "lane"}
    return lane


def _session_error(ws: Any, timeout: float) -> dict[str, Any]:
    """The session-level error the peer ends a raw session with."""
    deadline = time.monotonic() + timeout
    while True:
        frame = ws.recv(timeout=max(0.01, deadline - time.monotonic()))
        if codec.is_data(frame):
            continue
        for r in msgpack.unpackb(frame):
            if r[0] == 0 and r[1] == m.ERROR:
                return r[2]


@pytest.mark.timeout(60)
def test_a_lane_closed_in_the_middle_of_an_upload_ends_the_session(peer):
    other = ember.connect(_ws(peer))
    ws, welcome, sid = _raw_ws_session(_ws(peer))
    lane = _raw_ws_lane(_ws(peer), sid, welcome["lanes"]["key"])
    total = 3 * CHUNK
    ws.send(codec.packb([[m.UPLOAD, 1, "uint8", [total], 0, None, total]]))
    lane.send(b"".join(_chunk(1, 0, CHUNK, total)))
    lane.close()
    t0 = time.monotonic()
    err = _session_error(ws, 15.0)
    assert err["kind"] == "ProtocolError" and "lane closed in the middle of an upload" in err["message"]
    assert time.monotonic() - t0 < 10.0
    _canary(other)
    assert wait_until(lambda: sid not in peer.sessions)
    assert wait_until(lambda: peer.memory_held() == 0)
    ws.close()
    other.close()


@pytest.mark.timeout(60)
def test_a_striped_upload_whose_chunks_never_come_is_bounded_by_the_stall_timeout(make_peer):
    srv = make_peer(stall_timeout=1.0)
    addr = srv.addresses[0]
    other = ember.connect(addr)
    ws, welcome, sid = _raw_ws_session(addr)
    lane = _raw_ws_lane(addr, sid, welcome["lanes"]["key"])
    total = 3 * CHUNK
    ws.send(codec.packb([[m.UPLOAD, 1, "uint8", [total], 0, None, total], [m.SYNC, 2]]))
    lane.send(b"".join(_chunk(1, CHUNK, CHUNK, total)))  # one chunk of three, then nothing
    t0 = time.monotonic()
    err = _session_error(ws, 15.0)
    assert err["kind"] == "ProtocolError" and "no chunk arrived on the lanes for 1 s" in err["message"]
    assert time.monotonic() - t0 < 8.0
    _canary(other)
    assert wait_until(lambda: srv.memory_held() == 0)
    lane.close()
    ws.close()
    other.close()


@pytest.mark.timeout(60)
def test_a_raw_striped_upload_over_websocket_is_stored_and_read_back(peer):
    """The wire as docs/protocol.md describes it: UPLOAD with nil bytes, chunks on two lanes in any
    order, then a striped read answer: CHUNK frames on the lanes, OK without payload on the session."""
    ws, welcome, sid = _raw_ws_session(_ws(peer))
    lanes = [_raw_ws_lane(_ws(peer), sid, welcome["lanes"]["key"]) for _ in range(2)]
    total = 2 * CHUNK + 123
    data = np.random.default_rng(8).integers(0, 256, total, dtype=np.uint8).tobytes()
    ws.send(codec.packb([[m.UPLOAD, 1, "uint8", [total], 0, None, total]]))
    for lane, off in ((lanes[1], 2 * CHUNK), (lanes[0], CHUNK), (lanes[1], 0)):
        lane.send(codec.data_prefix([m.UPLOAD, 1, "uint8", [total], off, None, total]) + data[off:off + CHUNK])
    ws.send(codec.packb([[m.READ, 5, 1]]))
    got = bytearray(total)
    seen = 0
    stripes = dict(pl.stripe_bounds(total, CHUNK, 2))  # lo -> hi
    for lane in lanes:  # each lane brings one stripe, in order
        end = None
        while end is None or seen_here < end:
            (req, status, (off, _, tot)), payload = codec.decode_data(lane.recv(timeout=10))
            assert req == 5 and status == m.CHUNK and tot == total and off % CHUNK == 0
            if end is None:
                end, seen_here = stripes.pop(off), off
            assert off == seen_here
            got[off:off + len(payload)] = payload
            seen_here += len(payload)
            seen += len(payload)
    assert not stripes
    frame = ws.recv(timeout=5)
    assert codec.is_data(frame)
    (req, status, (dt, shape, tot, _, _)), payload = codec.decode_data(frame)
    assert (req, status, dt, shape, tot, len(payload)) == (5, m.OK, "uint8", [total], total, 0)
    assert seen == total and bytes(got) == data
    for lane in lanes:
        lane.close()
    ws.close()


# ---- downloads between peers ---------------------------------------------------------------------

@pytest.mark.timeout(120)
def test_a_download_between_iroh_peers_is_striped_and_bit_exact(make_peer):
    servers = [make_peer(iroh=True) for _ in range(2)]
    a, b = (ember.connect(_ticket(s)) for s in servers)
    data = np.random.default_rng(6).standard_normal(5 * CHUNK // 8 + 3)
    x = xp.asarray(data, device=a) * 3.0
    y = x.to_device(b)
    assert y.to_numpy().tobytes() == (data * 3.0).tobytes()
    hub = servers[0].transfers.lanes
    assert hub.striped == 1 and hub.served == pl.TRANSFER_LANES - 1
    assert hub.offers == {}  # withdrawn once served
    small = xp.asarray(np.arange(10.0), device=a).to_device(b)  # below STRIPE_MIN: one stream
    np.testing.assert_array_equal(small.to_numpy(), np.arange(10.0))
    assert hub.striped == 1
    a.close()
    b.close()


@pytest.mark.timeout(60)
def test_a_transfer_lane_with_an_unknown_key_is_denied_with_a_reason(peer):
    ticket = _ticket(peer)
    dev = ember.connect(ticket)

    async def go() -> Any:
        conn = await dial(ticket, timeout=10.0, max_frame=m.DEFAULT_MAX_FRAME, kind="transfer")
        try:
            await conn.send(pl.encode_transfer_lane(os.urandom(32), 1))
            return codec.unpackb(await asyncio.wait_for(conn.recv(), 10.0))
        finally:
            await conn.close()
    try:
        reply = run_sync(go(), 20.0, "a transfer lane")
        assert reply == {"type": "denied", "reason": "unknown or expired transfer lane key"}
        _canary(dev)
        assert peer.transfers.lanes.served == 0
    finally:
        dev.close()
