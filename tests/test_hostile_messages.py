"""Hostile messages the fuzzer (or a reviewer) found: each answered with a typed error, the peer unharmed."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Iterator

import msgpack
import numpy as np
import pytest
import websockets
from websockets.sync.client import connect as ws_connect

import ember
import ember.array_api as xp
from ember.array_api._array import RemoteArray
from ember.errors import LimitExceeded, TransferError
from ember.protocol import codec
from ember.protocol import messages as m
from ember.server import Server

from test_memory_budgets import answers, raw_session, wait_until


@pytest.fixture
def peer() -> Iterator[Server]:
    srv = Server(["cpu"], session_memory="256MiB", max_wait=1.0)
    srv.listen_websocket("127.0.0.1", 0)
    srv.start_in_thread()
    yield srv
    srv.close()


@pytest.fixture
def errors(caplog) -> Iterator[list]:
    """Errors the peer logged (a batch that raised, a handler that failed): there must be none."""
    import logging
    caplog.set_level(logging.ERROR)
    found: list = []
    yield found
    found.extend(r for r in caplog.records if r.name.startswith(("ember", "websockets", "asyncio")))
    assert not found, [r.getMessage() for r in found]


def still_serves(srv: Server) -> None:
    d = ember.connect(srv.addresses[0])
    assert float(xp.sum(xp.arange(10, device=d))) == 45
    d.close()


HOSTILE_BATCHES = {
    "empty batch": [],
    "unhashable op name (inline path)": [[m.OP, ["add"], [1, 1], 0, [9], None]],
    "unhashable ids": [[m.OP, "add", [{"a": 1}, [2]], 0, [[9]], None], [m.DROP, [[1], {}]]],
    "non-int smask": [[m.OP, "add", [1, 1], "x", [9], None]],
    "kwargs not a dict": [[m.OP, "sum", [1], 0, [9], [1, 2]]],
    "object dtype upload": [[m.UPLOAD, 9, "O", [1], 0, b"\0" * 8, 8]],
    "structured dtype upload": [[m.UPLOAD, 9, [["a", "f8"]], [1], 0, b"\0" * 8, 8]],
    "upload offset past total": [[m.UPLOAD, 9, "uint8", [4], 2 ** 40, b"xx", 4]],
    "upload shape lies": [[m.UPLOAD, 9, "float64", [10 ** 9], 0, b"\0" * 8, 8]],
    "capability of 10 GB as an int": [[m.EXPOSE, 1, 10 ** 10, None, 1, 1.0], [m.MOVE, 1, 10 ** 10]],
    "nan ttl, negative downloads": [[m.EXPOSE, 1, os.urandom(32), None, -5, float("nan")]],
    "fetch forever": [[m.FETCH, 9, None, os.urandom(32), 1e308]],
    "replay of a non-int graph": [[m.REPLAY, [1], [], [], []]],
    "ping without a request id": [[m.PING]],
    "reserved kinds": [[m.ATEN, 1, 2], [m.STATS]],
    "deep nesting": [[m.SYNC, msgpack.unpackb(b"\x91" * 1000 + b"\xc0")]],
    "broadcast then read everything": [[m.OP, "broadcast_to", [1], 0, [9], {"shape": [1 << 16, 1 << 16]}],
                                       [m.READ, 5, 9]],
    "arange lying about its length": [[m.OP, "arange", [0, 1e15, 1], 7, [9], {"num": 1, "dtype": "float64"}]],
    "nonzero over a huge broadcast": [[m.OP, "broadcast_to", [1], 0, [9], {"shape": [1 << 14, 1 << 14]}],
                                      [m.OP, "nonzero", [9], 0, [10, 11], None]],
}


@pytest.mark.parametrize("name", sorted(HOSTILE_BATCHES))
def test_hostile_batch_is_answered_and_the_session_survives(peer, errors, name):
    ws, _ = raw_session(peer.addresses[0])
    ws.send(codec.packb([[m.UPLOAD, 1, "float64", [4], 0, np.arange(4.0).tobytes(), 32]]))
    t0 = time.monotonic()
    ws.send(codec.packb(HOSTILE_BATCHES[name] + [[m.SYNC, 77]]) if HOSTILE_BATCHES[name] else codec.packb([]))
    ws.send(codec.packb([[m.READ, 78, 1]]))
    got = answers(ws, 78)
    assert time.monotonic() - t0 < 10
    final = got[-1]
    assert final[1] == m.OK and np.frombuffer(final[2][3], np.float64).tolist() == [0.0, 1.0, 2.0, 3.0]
    for r in got:
        if r[1] == m.ERROR:
            assert r[2]["kind"] in ("ProtocolError", "LimitExceeded", "RemoteExecutionError", "TransferError")
    ws.close()
    still_serves(peer)
    assert wait_until(lambda: peer.memory_held() == 0)


def test_a_malformed_graph_ends_that_session_only(peer, errors):
    """A graph of a million registers (its register file alone would take 8 MB per replay)."""
    other = ember.connect(peer.addresses[0])
    ws, _ = raw_session(peer.addresses[0])
    ws.send(codec.packb([[m.GRAPH, 5, 0, [], [["ones", [], 65535, None]] * 17, [], []], [m.SYNC, 3]]))
    err = answers(ws, 0)[0]
    assert err[1] == m.ERROR and err[2]["kind"] == "ProtocolError" and "registers" in err[2]["message"]
    with pytest.raises(websockets.ConnectionClosed):
        while True:
            ws.recv(timeout=5)
    assert float(xp.sum(xp.ones(4, device=other))) == 4
    other.close()
    assert wait_until(lambda: peer.memory_held() == 0)


def test_a_frame_of_nested_empty_arrays_is_refused_before_it_costs_70x(peer, errors):
    ws, _ = raw_session(peer.addresses[0])
    n = 4 << 20
    bomb = b"\xdd" + n.to_bytes(4, "big") + b"\x90" * n  # 4 MiB: 4M empty arrays, ~300 MB decoded
    ws.send(bomb)
    err = answers(ws, 0)[0]
    assert err[2]["kind"] == "LimitExceeded" and "arrays and maps" in err[2]["message"]
    with pytest.raises(websockets.ConnectionClosed):
        ws.recv(timeout=5)
    still_serves(peer)


def test_many_reads_in_one_batch_go_out_in_frames_of_about_a_chunk(peer, errors):
    ws, _ = raw_session(peer.addresses[0])
    x = np.ones(1 << 14)  # 128 KiB
    ws.send(codec.packb([[m.UPLOAD, 1, "float64", [1 << 14], 0, x.tobytes(), x.nbytes]]))
    ws.send(codec.packb([[m.READ, i + 1, 1] for i in range(100)] + [[m.SYNC, 500]]))  # 12.5 MiB of answers
    biggest, seen = 0, 0
    while True:
        frame = ws.recv(timeout=10)
        biggest = max(biggest, len(frame))
        rs = msgpack.unpackb(frame)
        seen += sum(1 for r in rs if r[0] != 500)
        if any(r[0] == 500 for r in rs):
            break
    assert seen == 100 and biggest < 2 * (1 << 20) + 4096
    ws.close()


def test_transfer_requests_with_hostile_fields_are_denied(peer, errors):
    for request in ({"type": "transfer", "capability": os.urandom(32), "wait": "forever"},
                    {"type": "transfer", "capability": 12, "wait": 1.0},
                    {"type": "transfer", "capability": os.urandom(32), "wait": -1}):
        ws = ws_connect(peer.addresses[0])
        ws.send(codec.packb(request))
        reply = msgpack.unpackb(ws.recv(timeout=10))
        assert reply["type"] == "denied" and reply["reason"]
        ws.close()
    still_serves(peer)


def test_exposures_per_session_are_bounded(peer, errors):
    ws, _ = raw_session(peer.addresses[0])
    ws.send(codec.packb([[m.UPLOAD, 1, "float64", [4], 0, np.arange(4.0).tobytes(), 32]]))
    ws.send(codec.packb([[m.EXPOSE, 1, os.urandom(32), None, 1, 60.0] for _ in range(400)] + [[m.SYNC, 9]]))
    answers(ws, 9)
    assert peer.transfers.exposed_count() == 256
    ws.close()
    assert wait_until(lambda: peer.transfers.exposed_count() == 0)  # withdrawn with their session
    assert wait_until(lambda: peer.memory_held() == 0)


def test_a_hostile_source_peer_cannot_make_the_target_allocate(peer, errors):
    """FETCH from a 'peer' whose header claims a terabyte: refused before the buffer exists."""
    import threading

    from websockets.asyncio.server import serve
    headers = [{"type": "ok", "dtype": "uint8", "shape": [1 << 40], "total": 1 << 40},
               {"type": "ok", "dtype": "float64", "shape": [3], "total": 7},
               {"type": "ok", "dtype": "O", "shape": [1], "total": 8}]
    ready, stop, port = threading.Event(), threading.Event(), []

    async def fake(ws) -> None:
        await ws.recv()
        await ws.send(codec.packb(headers.pop(0)))
        await asyncio.sleep(5)

    async def main() -> None:
        async with serve(fake, "127.0.0.1", 0) as s:
            port.append(s.sockets[0].getsockname()[1])
            ready.set()
            while not stop.is_set():
                await asyncio.sleep(0.05)
    t = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    t.start()
    ready.wait(10)
    d = ember.connect(peer.addresses[0])
    s = d.session
    try:
        for kind in (LimitExceeded, TransferError, TransferError):
            tid = next(s.ids)
            s.record([m.FETCH, tid, f"ws://127.0.0.1:{port[0]}", os.urandom(32), 1.0])
            with pytest.raises(kind):
                RemoteArray(tid, (1,), xp.uint8, d, s).to_numpy()
        assert float(xp.sum(xp.ones(2, device=d))) == 2
    finally:
        stop.set()
        d.close()
    assert wait_until(lambda: peer.memory_held() == 0)
