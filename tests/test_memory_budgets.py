"""Memory budgets on real peers: refused with LimitExceeded before allocating, others served, all returned."""

from __future__ import annotations

import os
import threading
import time

import msgpack
import numpy as np
import pytest
from websockets.sync.client import connect as ws_connect

import ember
import ember.array_api as xp
from ember.array_api._array import RemoteArray
from ember.errors import LimitExceeded
from ember.protocol import codec
from ember.protocol import messages as m
from ember.server import Server
from ember.server.guard.memory import DeviceMemory, format_bytes, parse_size

GiB = 1 << 30


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def wait_until(pred, timeout=10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def raw_session(address: str):
    ws = ws_connect(address, max_size=None)
    ws.send(codec.encode_hello(session_id=os.urandom(16), device=0, features=[]))  # plain MessagePack frames
    welcome = msgpack.unpackb(ws.recv(timeout=5))
    assert welcome["type"] == "welcome"
    return ws, welcome


def answers(ws, req: int, timeout: float = 10.0) -> list:
    """Every response up to and including the one for ``req``."""
    got = []
    deadline = time.monotonic() + timeout
    while True:
        for r in msgpack.unpackb(ws.recv(timeout=max(0.01, deadline - time.monotonic()))):
            got.append(r)
            if r[0] == req:
                return got


def remote(dev: ember.Device, tid: int, shape, dtype) -> RemoteArray:
    return RemoteArray(tid, shape, dtype, dev, dev.session)


def test_upload_bomb_is_refused_while_another_client_computes(make_peer):
    srv = make_peer(session_memory="256MiB")
    addr = srv.addresses[0]
    other = ember.connect(addr)
    before = rss()
    ws, welcome = raw_session(addr)
    assert welcome["limits"]["session_memory"] == 256 << 20
    for i in range(3):  # ~40-byte frames declaring 4 GiB each, one byte of data
        ws.send(codec.packb([[m.UPLOAD, 10 + i, "uint8", [4 * GiB], 0, b"x", 4 * GiB]]))
    total = 0.0
    for k in range(20):  # the other client is served meanwhile
        total += float(xp.sum(xp.ones(1000, device=other) * k))
    assert total == 1000 * sum(range(20))
    ws.send(codec.packb([[m.READ, 1, 10], [m.SYNC, 2]]))
    err = answers(ws, 2)[0]
    assert err[0] == 1 and err[1] == m.ERROR and err[2]["kind"] == "LimitExceeded"
    msg = err[2]["message"]
    assert "upload of tensor 10" in msg and "4.0 GiB" in msg and "session memory budget of 256.0 MiB" in msg
    assert "this session holds" in msg and "--session-memory" in msg
    assert rss() - before < 64 << 20  # nothing was allocated for the declared totals
    assert srv.memory_held() < 1 << 20
    ws.close()
    other.close()
    assert wait_until(lambda: srv.memory_held() == 0)


def test_declared_totals_are_charged_at_the_first_chunk_and_pages_follow_the_data(make_peer):
    srv = make_peer(memory_limit="6GiB")
    before = rss()
    ws, _ = raw_session(srv.addresses[0])
    ws.send(codec.packb([[m.UPLOAD, 10, "uint8", [4 * GiB], 0, b"x" * 1024, 4 * GiB]]))
    ws.send(codec.packb([[m.UPLOAD, 11, "uint8", [4 * GiB], 0, b"x" * 1024, 4 * GiB]]))
    ws.send(codec.packb([[m.READ, 1, 11], [m.SYNC, 2]]))
    err = answers(ws, 2)[0][2]
    assert err["kind"] == "LimitExceeded" and "host memory budget of 6.0 GiB" in err["message"]
    assert "held by 1 session" in err["message"]
    assert wait_until(lambda: srv.memory_held() >= 4 * GiB)  # the first is charged in full...
    assert rss() - before < 64 << 20                         # ...but costs only the bytes that came
    ws.send(codec.packb([[m.DROP, [10]], [m.SYNC, 3]]))      # dropping a half-sent upload frees it
    answers(ws, 3)
    assert wait_until(lambda: srv.memory_held() < 1 << 20)
    ws.close()


def test_huge_zeros_names_the_request_the_budget_and_the_holdings(make_peer):
    srv = make_peer(session_memory="1GiB")
    a, b = ember.connect(srv.addresses[0]), ember.connect(srv.addresses[0])
    keep = xp.ones(1000, device=a)
    z = xp.zeros((20000, 20000), device=a)
    t0 = time.monotonic()
    with pytest.raises(LimitExceeded) as ei:
        z.to_numpy()
    assert time.monotonic() - t0 < 5  # refused before allocating 3.2 GB
    text = str(ei.value)
    assert "zeros(shape=[20000, 20000], dtype=float64) needs 3.0 GiB" in text
    assert "session memory budget of 1.0 GiB" in text and "this session holds" in text
    assert float(xp.sum(keep)) == 1000.0  # the session carries on
    assert float(xp.sum(xp.arange(10, device=b))) == 45  # and so does every other
    a.close(), b.close()


def test_budgets_return_to_zero_after_drop_and_close(make_peer):
    srv = make_peer()
    d = ember.connect(srv.addresses[0])
    x = xp.asarray(np.ones((512, 1024)), device=d)  # 4 MiB
    y = x * 2.0
    d.sync()
    sessions = srv.memory_stats()["sessions"]
    assert len(sessions) == 1 and sessions[0]["held"] >= 8 << 20
    dev_stats = srv.memory_stats()["devices"][0]
    assert dev_stats["budget"] == "host" and dev_stats["held"] >= 8 << 20 and dev_stats["limit"] > 0
    del y
    float(xp.sum(x))  # the drop travels with the next batch
    assert wait_until(lambda: srv.memory_stats()["sessions"][0]["held"] < 5 << 20)
    d.close()
    assert wait_until(lambda: srv.memory_held() == 0)
    assert srv.memory_stats()["sessions"] == []


def test_the_device_budget_is_shared_and_one_client_freeing_lets_another_in(make_peer):
    srv = make_peer(memory_limit="64MiB")
    a, b = ember.connect(srv.addresses[0]), ember.connect(srv.addresses[0])
    big = xp.ones((6 << 20,), device=a)  # 48 MiB
    float(big[0])
    y = xp.ones((4 << 20,), device=b)    # 32 MiB: over what is left
    with pytest.raises(LimitExceeded, match=r"host memory budget of 64.0 MiB.*held by 2 sessions"):
        y.to_numpy()
    del big
    float(xp.sum(xp.ones(2, device=a)))  # the drop reaches the peer
    assert wait_until(lambda: srv.memory_held() < 16 << 20)  # (its release lands on a loaded box a moment later)
    y = xp.ones((4 << 20,), device=b)
    assert float(xp.sum(y)) == 4 << 20
    a.close(), b.close()


def test_amplifying_ops_are_refused_before_they_allocate(make_peer):
    srv = make_peer(session_memory="64MiB")
    d = ember.connect(srv.addresses[0])
    col = xp.ones((8192, 1), device=d)
    row = xp.ones((1, 8192), device=d)
    before = rss()
    for bad in (col + row, col @ row, xp.tile(col, (1, 8192)), xp.exp(xp.broadcast_to(col, (8192, 8192)))):
        with pytest.raises(LimitExceeded, match="needs 512.0 MiB"):
            bad.to_numpy()
    view = xp.broadcast_to(col, (8192, 8192))  # a view: costs nothing on the peer...
    assert float(view[5, 5]) == 1.0
    with pytest.raises(LimitExceeded, match="host copy"):  # ...but reading it all would copy 512 MiB
        view.to_numpy()
    assert rss() - before < 128 << 20
    assert float(xp.sum(col)) == 8192.0
    d.close()


def test_views_cost_their_buffer_once_and_keep_it_charged(make_peer):
    srv = make_peer()
    d = ember.connect(srv.addresses[0])
    a = xp.ones((1 << 20,), device=d)  # 8 MiB
    b = xp.reshape(a, (1024, 1024))
    c = a[::2]
    d.sync()

    def held() -> int:
        return srv.memory_stats()["sessions"][0]["held"]
    assert 8 << 20 <= held() < 9 << 20  # three tensors, one buffer
    del a, b
    d.sync()
    assert 8 << 20 <= held() < 9 << 20  # the slice keeps its base alive: still charged
    del c
    float(xp.sum(xp.ones(1, device=d)))
    assert wait_until(lambda: held() < 1 << 20)
    d.close()


def test_graph_cache_entries_and_replays_are_charged_and_returned(make_peer):
    srv = make_peer()
    d = ember.connect(srv.addresses[0])
    w = xp.ones((8,), device=d)
    for _ in range(40):  # a recurring step: registered once, then replayed
        w = xp.tanh(w * 0.5 + 0.1) * 2.0 - w * 0.01 + xp.sin(w) * 0.1
        float(xp.sum(w))
    assert d.stats()["replays"] > 0
    s = srv.memory_stats()["sessions"][0]
    assert s["held"] > 1024  # compiled graphs are charged, not only tensors
    d.close()
    assert wait_until(lambda: srv.memory_held() == 0)


def test_tensors_per_session_limit(make_peer):
    srv = make_peer(max_tensors=50)
    d = ember.connect(srv.addresses[0])
    keep = [xp.ones(2, device=d) for _ in range(50)]
    extra = xp.ones(2, device=d)
    with pytest.raises(LimitExceeded, match="already holds 50 tensors"):
        extra.to_numpy()
    del keep[:10]
    d.sync()  # the drops travel with this batch
    assert float(xp.sum(xp.ones(3, device=d))) == 3.0
    d.close()


def test_concurrent_chunked_uploads_limit(make_peer):
    srv = make_peer(max_uploads=2)
    ws, welcome = raw_session(srv.addresses[0])
    assert welcome["limits"]["max_uploads"] == 2
    for i in range(3):
        ws.send(codec.packb([[m.UPLOAD, 20 + i, "float64", [1000], 0, b"\0" * 800, 8000]]))
    ws.send(codec.packb([[m.READ, 1, 22], [m.SYNC, 2]]))
    err = answers(ws, 2)[0][2]
    assert err["kind"] == "LimitExceeded" and "more than 2 chunked uploads" in err["message"]
    ws.close()


def test_the_client_refuses_an_upload_over_the_announced_budget(make_peer):
    srv = make_peer(session_memory="1MiB")
    d = ember.connect(srv.addresses[0])
    sent = d.session.stats["bytes_sent"]
    with pytest.raises(LimitExceeded, match="session memory budget of 1048576 bytes.*nothing was sent"):
        xp.asarray(np.zeros(1 << 18), device=d)  # 2 MiB
    assert d.session.stats["bytes_sent"] == sent
    assert float(xp.sum(xp.asarray(np.ones(10), device=d))) == 10
    d.close()


def test_budget_accounting_is_exact_under_concurrency():
    dev = DeviceMemory(1 << 30, "test memory")
    sessions = [dev.session(None, f"s{i}") for i in range(8)]
    refused = []

    def work(s) -> None:
        for k in range(2000):
            try:
                s.charge(1 << 20, "a test charge")
            except LimitExceeded:
                refused.append(1)
                continue
            s.hold(k % 7, 4096, "a buffer")
            s.unhold(k % 7)
            s.release(1 << 20)
    threads = [threading.Thread(target=work, args=(s,)) for s in sessions]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert dev.held() == 0 and all(s.held() == 0 for s in sessions)
    assert dev.peak <= 1 << 30
    sessions[0].charge(100, "x")
    sessions[0].close()
    assert dev.held() == 0 and sessions[0].held() == 0


def test_sizes_parse_and_print():
    assert parse_size("16GiB") == 16 << 30 and parse_size("512 MB") == 512 * 10**6 and parse_size(4096) == 4096
    assert parse_size("1.5g") == 1_500_000_000
    for bad in ("lots", "-1GiB", "12 parsecs"):
        with pytest.raises(ValueError, match="not a size"):
            parse_size(bad)
    assert format_bytes(3 << 30) == "3.0 GiB (3221225472 bytes)" and format_bytes(12) == "12 bytes"


@pytest.mark.timeout(120)
def test_pytorch_frontend_storages_are_charged_refused_and_returned():
    torch = pytest.importorskip("torch")
    import ember.torch  # noqa: F401
    srv = Server(["torch:cpu"], session_memory="64MiB")
    srv.listen_websocket("127.0.0.1", 0)
    srv.start_in_thread()
    try:
        d = ember.connect(srv.addresses[0])
        with d:
            x = torch.ones(1 << 20, device="ember")  # a 4 MiB storage
            y = (x * 2).sum()
            assert float(y.cpu()) == 2.0 * (1 << 20)
            held = srv.memory_stats()["sessions"][0]["held"]
            assert 4 << 20 <= held < 16 << 20
            big = torch.zeros(1 << 25, device="ember")  # 128 MiB: over the session budget
            with pytest.raises(LimitExceeded, match="session memory budget of 64.0 MiB"):
                big.cpu()
            grown = torch.ones(4, device="ember")
            grown.resize_(1 << 25)  # a storage that grows in place is charged for what it became
            with pytest.raises(Exception, match="session memory budget"):
                grown.cpu()
            assert float((x + 1).sum().cpu()) == 2.0 * (1 << 20)  # the session carries on
        d.close()
        assert wait_until(lambda: srv.memory_held() == 0)
    finally:
        srv.close()
