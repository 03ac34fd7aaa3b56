"""Bulk data: data frames (negotiated), the raw TCP transport, zero-copy uploads with backpressure,
reads straight into place, transfers in data frames, progress bars. Real servers on loopback."""

from __future__ import annotations

import asyncio
import os
import re
import socket
import subprocess
import sys
import time

import msgpack
import numpy as np
import pytest

import ember
import ember.array_api as xp
from ember.client.progress import PROGRESS_MIN, Progress, choose, set_progress
from ember.errors import ConnectError, LimitExceeded, RemoteExecutionError, SessionLost
from ember.protocol import codec
from ember.protocol import messages as m
from ember.server import Server
from ember.transport import tcp
from ember.transport.base import PREFAULT_MIN, frame_bytes, frame_parts, receive_buffer

from test_core_sessions import wait_until

SIZES = [0, 1, 65536, 65537, 3 * 2**20 + 5]  # empty, inline, the inline bound, just past it, several chunks


@pytest.fixture(scope="module")
def peer():
    srv = Server(["cpu"], chunk=1 << 20)
    srv.listen_websocket("127.0.0.1", 0)
    srv.listen_tcp("127.0.0.1", 0)
    srv.start_in_thread()
    yield srv
    srv.close()


def _addr(srv: Server, scheme: str) -> str:
    return next(a for a in srv.addresses if a.startswith(scheme + "://"))


# ---- sans-I/O: the data frame envelope ---------------------------------------------------

def test_data_frame_envelope_round_trips_and_is_never_messagepack():
    payload = memoryview(np.arange(10, dtype=np.float64)).cast("B")
    prefix = codec.data_prefix([m.UPLOAD, 7, "float64", [10], 0, None, 80])
    frame = frame_bytes((prefix, payload))
    assert codec.is_data(frame) and not codec.is_data(codec.packb([[m.SYNC, 1]]))
    head, body = codec.decode_data(frame)
    assert head == [m.UPLOAD, 7, "float64", [10], 0, None, 80] and bytes(body) == bytes(payload)
    with pytest.raises(Exception):
        msgpack.unpackb(frame)  # 0xC1 is never a MessagePack start byte
    with pytest.raises(ember.errors.ProtocolError):
        codec.decode_data(frame[:7])


def test_read_frames_cover_every_byte_once():
    flat = memoryview(bytes(range(256)) * 41)
    frames = list(codec.read_frames(3, "uint8", [len(flat)], flat, 1000))
    got = bytearray()
    for prefix, part in frames[:-1]:
        (req, status, (off, _, total)), _ = codec.decode_data(prefix)
        assert (req, status, off, total) == (3, m.CHUNK, len(got), len(flat))
        got += part
    (req, status, (dt, shape, off, _, total)), _ = codec.decode_data(frames[-1][0])
    assert status == m.OK and off == len(got) and shape == [len(flat)]
    got += frames[-1][1]
    assert bytes(got) == bytes(flat)


def test_gathered_frames_flatten_views_of_any_itemsize():
    a = np.arange(6, dtype=np.int32)
    parts = frame_parts((b"ab", memoryview(a)))
    assert [len(p) for p in parts] == [2, 24] and frame_bytes((b"ab", memoryview(a))) == b"ab" + a.tobytes()


# ---- round trips over every transport, with and without data frames --------------------------

@pytest.mark.parametrize("scheme", ["ws", "tcp", "local"])
@pytest.mark.parametrize("data_frames", [True, False])
def test_uploads_and_reads_round_trip(peer, scheme, data_frames):
    addr = "local" if scheme == "local" else _addr(peer, scheme)
    d = ember.connect(addr, data_frames=data_frames)
    try:
        assert d.session.data is data_frames
        rng = np.random.default_rng(1)
        for n in SIZES:
            h = rng.integers(0, 255, n, dtype=np.uint8)
            x = xp.asarray(h, device=d)
            np.testing.assert_array_equal(x.to_numpy(), h)
        f = rng.standard_normal((513, 1031))  # float64, 4.2 MB: 5 chunks, uneven last one
        y = xp.asarray(f, device=d) * 2.0
        np.testing.assert_array_equal(y.to_numpy(), f * 2.0)
        c = (rng.standard_normal(70000) + 1j).astype(np.complex64)
        np.testing.assert_array_equal(xp.asarray(c, device=d).to_numpy(), c)
    finally:
        d.close()


def test_upload_waits_until_its_bytes_left_so_the_array_may_change_after(peer):
    d = ember.connect(_addr(peer, "tcp"))
    try:
        h = np.full(8 * 2**20, 3, dtype=np.uint8)
        x = xp.asarray(h, device=d)  # zero-copy: returns once the last byte has left
        h[:] = 9
        assert int(xp.sum(xp.astype(x, xp.int64))) == 3 * h.size
    finally:
        d.close()


@pytest.mark.timeout(60)
def test_an_upload_read_into_place_by_the_network_loop_is_charged_and_given_back_exactly():
    srv = Server(["cpu"], chunk=1 << 20)  # its own peer: nothing else holds memory on it
    srv.listen_tcp("127.0.0.1", 0)
    srv.start_in_thread()
    try:
        d = ember.connect(srv.addresses[0])
        x = xp.asarray(np.ones(3 * 2**20 + 5, np.uint8), device=d)  # 4 chunks, read into place by the sink
        d.sync()
        s = next(iter(srv.sessions.values()))
        held = srv.memory_stats()["sessions"][0]["held"]
        assert 3 * 2**20 + 5 <= held < 3 * 2**20 + (1 << 16)
        # adopted, not shared (a sync's own batch stays shared-charged a moment after its answer)
        assert wait_until(lambda: s.mem._shared == 0, 30.0)
        assert int(xp.sum(xp.astype(x, xp.int64))) == 3 * 2**20 + 5
        del x
        d.sync()
        assert wait_until(lambda: srv.memory_stats()["sessions"][0]["held"] < 1 << 16, 30.0)
        d.close()
        assert wait_until(lambda: srv.memory_held() == 0, 30.0)  # (conditions: a loaded box is slow, not wrong)
    finally:
        srv.close()


def test_read_arrives_straight_into_place_over_tcp(peer):
    d = ember.connect(_addr(peer, "tcp"))
    try:
        placed = []
        sink = d.session._sink

        def spy(head, n):
            v = sink(head, n)
            placed.append(v is not None)
            return v
        d.session.conn.set_data_sink(spy)
        x = xp.ones((3 * 2**20,), dtype=xp.uint8, device=d)
        d.sync()
        before = d.stats()["bytes_received"]
        out = x.to_numpy()
        assert out.flags.writeable and int(out.sum()) == 3 * 2**20
        assert placed and all(placed)  # every chunk went into the array, not into a frame
        got = d.stats()["bytes_received"] - before
        assert 3 * 2**20 <= got < 3 * 2**20 + 4096, got  # counted once, though no frame carried them
    finally:
        d.close()


@pytest.mark.timeout(60)
def test_large_reads_land_in_prefaulted_buffers_and_stay_ordinary_arrays(peer, monkeypatch):
    small, big = receive_buffer(PREFAULT_MIN - 1), receive_buffer(PREFAULT_MIN)
    assert small.dtype == big.dtype == np.uint8 and (len(small), len(big)) == (PREFAULT_MIN - 1, PREFAULT_MIN)
    big[::4096] = 7  # writable, every page
    assert int(big[::4096].sum()) == 7 * (PREFAULT_MIN // 4096)
    if sys.platform.startswith("linux"):
        assert isinstance(big.base, memoryview) and isinstance(big.base.obj, __import__("mmap").mmap)  # populated
    monkeypatch.setenv("EMBER_PREFAULT", "0")
    assert receive_buffer(PREFAULT_MIN).base is None  # plain np.empty when turned off
    monkeypatch.delenv("EMBER_PREFAULT")
    d = ember.connect(_addr(peer, "tcp"))
    try:
        a = np.random.default_rng(3).integers(0, 1 << 30, PREFAULT_MIN // 4 + 3, dtype=np.int32)
        out = xp.asarray(a, device=d)[1:].to_numpy()
        np.testing.assert_array_equal(out, a[1:])
        out[0] = -1  # the caller owns a writable array, as from np.empty
        assert out.base is not None and (out.reshape(-1, 1) + 0).shape == (len(a) - 1, 1)
    finally:
        d.close()


def test_data_frame_upload_over_max_tensor_poisons_that_tensor_only():
    srv = Server(["cpu"], max_tensor=100_000)
    srv.listen_tcp("127.0.0.1", 0)
    addr = srv.start_in_thread()[0]
    try:
        d = ember.connect(addr)
        with pytest.raises(LimitExceeded, match="max_tensor of 100000 bytes.*nothing was sent"):
            xp.asarray(np.zeros(200_000, dtype=np.uint8), device=d)  # refused by the client, from Welcome
        d.session.max_tensor = None  # a client that ignores the announced limit: the peer refuses it too
        big = xp.asarray(np.zeros(200_000, dtype=np.uint8), device=d)
        small = xp.asarray(np.ones(70_000, dtype=np.uint8), device=d)  # a data frame, under the limit
        with pytest.raises(LimitExceeded, match="max_tensor"):
            big.to_numpy()
        assert int(xp.sum(xp.astype(small, xp.int64))) == 70_000
        d.close()
    finally:
        srv.close()


# ---- the TCP transport against bad input ------------------------------------------------------

def _port(addr: str) -> int:
    return int(addr.rsplit(":", 1)[1])


def test_tcp_garbage_preamble_and_malformed_data_frames_do_not_harm_the_server(peer):
    addr = _addr(peer, "tcp")
    with socket.create_connection(("127.0.0.1", _port(addr)), timeout=10) as s:
        s.sendall(b"GET / HTTP/1.1\r\n\r\n")
        s.settimeout(10)
        assert s.recv(100) == b""  # not an Ember client: closed without an answer

    async def bad_data_frame() -> bytes | None:
        conn = await tcp.dial(addr, timeout=10, max_frame=1 << 20)
        await conn.send(codec.encode_hello(session_id=os.urandom(16), device=0))
        welcome = codec.decode_reply(await conn.recv())
        assert m.DATA_FEATURE in welcome["features"]
        await conn.send((codec.data_prefix([m.SYNC, 5, None]), b"x" * 70000))  # not an upload
        frame = await asyncio.wait_for(conn.recv(), 10)
        await conn.close()
        return frame
    frame = asyncio.run(bad_data_frame())
    (req, status, err), = codec.decode_responses(frame, 1 << 20)
    assert req == 0 and status == m.ERROR and "Upload" in err["message"]
    d = ember.connect(addr)
    assert float(xp.sum(xp.ones(4, device=d))) == 4.0
    d.close()


def test_tcp_frame_over_the_limit_breaks_only_that_connection(peer):
    addr = _addr(peer, "tcp")
    with socket.create_connection(("127.0.0.1", _port(addr)), timeout=10) as s:
        s.sendall(tcp.PREAMBLE + (1 << 31).to_bytes(4, "big"))
        s.settimeout(10)
        assert s.recv(100) == b""
    d = ember.connect(addr)
    assert float(xp.sum(xp.ones(3, device=d))) == 3.0
    d.close()


def test_tcp_addresses_are_checked():
    with pytest.raises(ConnectError, match="malformed TCP address"):
        ember.connect("tcp://nohost")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ConnectError, match="cannot connect"):
        ember.connect(f"tcp://127.0.0.1:{port}", timeout=5)


def test_tcp_session_lost_when_the_server_goes_away():
    srv = Server(["cpu"])
    srv.listen_tcp("127.0.0.1", 0)
    addr = srv.start_in_thread()[0]
    d = ember.connect(addr, read_timeout=10)
    x = xp.ones(4, device=d)
    assert float(xp.sum(x)) == 4.0
    srv.close()
    with pytest.raises(SessionLost):
        for _ in range(50):
            float(xp.sum(x + 1.0))
            time.sleep(0.05)


@pytest.mark.timeout(60)
def test_ember_serve_tcp_with_tls_and_token(tmp_path):
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    ca.issue_cert("127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "server.pem"))
    p = subprocess.Popen([sys.executable, "-m", "ember.cli.main", "serve", "--no-iroh", "--tcp", "127.0.0.1:0",
                          "--tls-cert", str(tmp_path / "server.pem"), "--token", "s3cret"],
                         stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        addr = re.search(r"(tcps://\S+)", p.stdout.readline()).group(1)
        with pytest.raises(ember.errors.AuthorizationError, match="credential"):
            ember.connect(addr, tls_ca=str(tmp_path / "ca.pem"))
        d = ember.connect(addr, tls_ca=str(tmp_path / "ca.pem"), credential="s3cret")
        h = np.arange(300_000, dtype=np.float32)
        np.testing.assert_array_equal((xp.asarray(h, device=d) + 1).to_numpy(), h + 1)
        d.close()
        with pytest.raises(ConnectError, match="certificate"):
            ember.connect(addr)  # the system CAs don't know this test CA
    finally:
        p.kill()
        p.wait(10)


# ---- peer-to-peer transfers in data frames ---------------------------------------------------------

def test_move_between_tcp_peers_in_data_frames():
    a, b = Server(["cpu"]), Server(["cpu"])
    for s in (a, b):
        s.listen_tcp("127.0.0.1", 0)
        s.start_in_thread()
    try:
        da, db = ember.connect(a.addresses[0]), ember.connect(b.addresses[0])
        h = np.random.default_rng(2).standard_normal(600_000)
        y = xp.asarray(h, device=da).to_device(db)
        np.testing.assert_array_equal(y.to_numpy(), h)
        da.close()
        db.close()
    finally:
        a.close()
        b.close()


# ---- progress bars ----------------------------------------------------------------------------

def test_progress_choice(monkeypatch):
    monkeypatch.delenv("EMBER_PROGRESS", raising=False)
    assert choose(False, 1 << 40) is None
    assert isinstance(choose(True, 10), Progress)
    assert choose(None, PROGRESS_MIN) is None  # pytest captures stderr: no terminal, no bar
    monkeypatch.setenv("EMBER_PROGRESS", "1")
    assert isinstance(choose(None, 10), Progress)
    try:
        set_progress(False)
        assert choose(None, 1 << 40) is None and isinstance(choose(True, 1), Progress)
    finally:
        set_progress(None)
    with pytest.raises(TypeError):
        set_progress("yes")  # type: ignore[arg-type]


def test_progress_bars_on_upload_download_and_move(peer, capsys):
    d = ember.connect(_addr(peer, "tcp"))
    try:
        h = np.ones(3 * 2**20, dtype=np.uint8)
        x = xp.asarray(h, device=d, progress=True)
        assert int(x.to_numpy(progress=True).sum()) == h.size
        err = capsys.readouterr().err
        assert "ember: upload 3 MiB" in err and "ember: download 3 MiB" in err and "B/s" in err
        xp.asarray(h, device=d, progress=False).to_numpy(progress=False)
        assert "ember:" not in capsys.readouterr().err
        local = ember.connect("local")
        z = x.to_device(local, progress=True)
        assert int(xp.sum(xp.astype(z, xp.int64))) == h.size
        assert "ember: download" in capsys.readouterr().err
        local.close()
    finally:
        d.close()
