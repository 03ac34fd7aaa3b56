"""One round trip on the caller's thread (client/exchange.py, transport/tcp_exchange.py, Session.direct).

Real peers on loopback: an in-process ``Server`` over TCP and WebSocket, the embedded ``local`` peer,
and an ``ember serve`` process where a peer has to die. Over TCP and on the embedded peer a blocking
read is answered on the caller's own thread while the link is calm (``stats["exchanges"]``); it must
give the same answers as the ordinary path, with many threads, next to pipelined work and bulk data,
with errors, with a slow or dying peer, and with heartbeats running.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import ember
import ember.array_api as xp
from ember.embedded import local_server
from ember.errors import RemoteExecutionError, SessionLost
from ember.server import Server
from ember.transport import tcp_exchange

from netfault import DroppingProxy
from test_core_cli import start_serve
from test_core_sessions import wait_until
from test_network_faults import _lose_and_reconnect


def _nap(xp_, x, seconds=0.0):
    time.sleep(seconds)
    return x + 0


def _boom(xp_, x):
    raise ValueError("boom: this op always fails")


def _ops(srv: Server) -> Server:
    srv.register_op("rt_nap", _nap)
    srv.register_op("rt_boom", _boom)
    return srv


@pytest.fixture(scope="module")
def peer_server():
    srv = _ops(Server(["cpu", "torch:cpu"]))
    srv.listen_tcp("127.0.0.1", 0)
    srv.listen_websocket("127.0.0.1", 0)
    srv.start_in_thread()
    yield srv
    srv.close()


@pytest.fixture
def patient(monkeypatch):
    """Callers wait for their answers on their own thread up to 5 s (not 50 ms) before handing the link
    back: tests that count exchanges then count calm links, not a loaded machine's slow moments."""
    monkeypatch.setattr(tcp_exchange, "PATIENCE", 5.0)


def _address(srv: Server, kind: str) -> str:
    return next(a for a in srv.addresses if a.startswith(kind))


@pytest.fixture(params=["tcp", "websocket", "local"])
def peer(request, peer_server):
    """(device, whether its round trips are answered on the caller's thread)."""
    if request.param == "local":
        _ops(local_server())
        d = ember.connect("local")
    else:
        d = ember.connect(_address(peer_server, {"tcp": "tcp://", "websocket": "ws://"}[request.param]))
    yield d, request.param != "websocket"
    d.close()


def _exchanges(d: ember.Device) -> int:
    return d.session.stats["exchanges"]


@pytest.mark.timeout(60)
def test_round_trips_give_the_same_answers_and_take_the_caller_s_thread(peer, patient):
    d, direct = peer
    a = xp.asarray(np.arange(3.0), device=d)
    before = _exchanges(d)
    for i in range(300):
        np.testing.assert_array_equal((a + float(i)).to_numpy(), np.arange(3.0) + i)
    taken = _exchanges(d) - before
    if direct:
        assert taken >= 250, taken  # (the first ones may find the loop's reader still busy)
    else:
        assert taken == 0  # WebSocket: the ordinary path, same answers


@pytest.mark.timeout(90)
def test_many_threads_each_get_their_own_answers(peer, patient):
    d, direct = peer
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def work(k: int) -> None:
        try:
            x = xp.asarray(np.full(4, float(k)), device=d)
            start.wait(10)
            for i in range(120):
                y = x * 2.0 + float(i)
                np.testing.assert_array_equal(y.to_numpy(), np.full(4, 2.0 * k + i))
                if i % 10 == 0:
                    assert float(xp.sum(y)) == 4 * (2.0 * k + i)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors[0]
    assert d.session.lost is None
    if direct:
        assert _exchanges(d) > 0


@pytest.mark.timeout(90)
def test_round_trips_interleave_with_pipelined_work_and_bulk_data(peer):
    d, _ = peer
    rng = np.random.default_rng(0)
    big = rng.standard_normal(300_000)  # 2.4 MB: data frames, read and uploaded by the loop
    stop = threading.Event()
    errors: list[BaseException] = []

    def pipelined() -> None:  # long batches with no read, uploads and large reads meanwhile
        try:
            k = 0
            while not stop.is_set():
                x = xp.asarray(big, device=d)
                acc = x
                for _ in range(700):  # more than a batch: flushed while recording
                    acc = acc + 1.0
                np.testing.assert_allclose(acc.to_numpy(), big + 700.0)
                k += 1
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=pipelined)
    t.start()
    try:
        s = xp.asarray(np.ones(2), device=d)
        for i in range(200):
            s = s + 1.0
            assert s.to_numpy().tolist() == [2.0 + i] * 2
        # this thread's own pipelined ops before a read: the read comes after them
        z = xp.asarray(np.zeros(5), device=d)
        for _ in range(1100):
            z = z + 1.0
        assert z.to_numpy().tolist() == [1100.0] * 5
        assert np.array_equal(xp.asarray(big, device=d).to_numpy(), big)
    finally:
        stop.set()
        t.join(60)
    assert not errors, errors[0]
    assert d.session.lost is None


@pytest.mark.timeout(60)
def test_a_read_after_a_large_upload_still_takes_the_caller_s_thread(peer, patient):
    d, _ = peer
    big = np.arange(200_000, dtype=np.float64)  # data frames, sent by the loop's sender
    before = _exchanges(d)
    for i in range(10):
        x = xp.asarray(big + i, device=d)
        assert float(xp.sum(x)) == float(big.sum() + i * big.size)
    if d.address.startswith("tcp://"):  # an upload awaits no answer: the link calms again at once
        assert _exchanges(d) - before >= 8
    # (the embedded peer runs a read on the caller's thread only once its worker has stored the upload)


@pytest.mark.timeout(60)
def test_errors_come_back_typed_and_the_session_goes_on(peer, patient):
    d, direct = peer
    x = xp.asarray(np.ones(3), device=d)
    bad = ember.custom_op("rt_boom", x, outputs=[((3,), xp.float64)])
    with pytest.raises(RemoteExecutionError, match="boom"):
        bad.to_numpy()
    with pytest.raises(RemoteExecutionError, match="rt_boom"):  # poison follows the data
        (bad + 1.0).to_numpy()
    with pytest.raises(RemoteExecutionError):  # a tensor the peer never had
        from ember.protocol import messages as m
        d.session.request(m.READ, 10 ** 9, timeout=10)
    before = _exchanges(d)
    assert (x + 1.0).to_numpy().tolist() == [2.0] * 3
    assert d.session.lost is None
    if direct:
        assert _exchanges(d) > before


@pytest.mark.timeout(60)
def test_torch_item_round_trips(peer, patient):
    torch = pytest.importorskip("torch")
    import ember.torch  # noqa: F401
    d, direct = peer
    if d.address == "local":
        d = ember.connect("local:torch")
    else:
        d = ember.connect(d.address, device=1)
    try:
        with d:
            a = torch.ones(1, device="ember")
            before = _exchanges(d)
            for i in range(100):
                assert (a + i).item() == 1.0 + i
            loss = (torch.arange(4.0, device="ember") ** 2).sum()
            assert loss.item() == 14.0
        if direct:
            assert _exchanges(d) - before >= 80
    finally:
        if d.address != "local:torch":
            d.close()


@pytest.mark.timeout(60)
def test_a_slow_answer_is_handed_to_the_loop_and_heartbeats_go_on(peer_server):
    d = ember.connect(_address(peer_server, "tcp://"), heartbeat_interval=0.1, heartbeat_timeout=1.0)
    try:
        s = d.session
        calm = s.conn.calm
        x = xp.asarray(np.arange(4.0), device=d)
        assert (x + 1.0).to_numpy().tolist() == [1.0, 2.0, 3.0, 4.0]
        assert wait_until(lambda: calm.parked, timeout=5.0)  # nothing awaited: the loop's reader rests
        backs = calm.handbacks
        # longer than the caller's patience and the heartbeat timeout: the loop waits, pings meanwhile
        slow = ember.custom_op("rt_nap", x, outputs=[((4,), xp.float64)], seconds=1.5)
        assert slow.to_numpy().tolist() == [0.0, 1.0, 2.0, 3.0]
        assert calm.handbacks == backs + 1
        assert s.lost is None
        before = _exchanges(d)
        for i in range(20):
            assert (x + float(i)).to_numpy()[0] == float(i)
        assert _exchanges(d) > before
    finally:
        d.close()


@pytest.mark.timeout(60)
def test_idle_pings_keep_a_calm_session_past_the_peer_s_idle_timeout(patient):
    srv = _ops(Server(["cpu"], idle_timeout=1.0))  # ends sessions silent for 1 s: the client must ping
    srv.listen_tcp("127.0.0.1", 0)
    d = ember.connect(srv.start_in_thread()[0], heartbeat_interval=0.1, heartbeat_timeout=1.0)
    try:
        s = d.session
        x = xp.asarray(np.arange(4.0), device=d)
        for i in range(5):
            assert (x + float(i)).to_numpy()[0] == float(i)
        # idle past the idle timeout: the pings (every 0.25 s, their answers read by the loop although
        # the link is calm) keep the session
        t0 = time.monotonic()
        assert wait_until(lambda: s._pinged - t0 > 1.3 or s.lost is not None, timeout=5.0)
        assert s.lost is None, s.lost
        before = _exchanges(d)
        for i in range(20):
            assert (x + float(i)).to_numpy()[0] == float(i)
        assert _exchanges(d) > before
        assert s.lost is None
    finally:
        d.close()
        srv.close()


@pytest.mark.timeout(60)
def test_a_peer_dying_mid_exchange_gives_session_lost_in_time(monkeypatch):
    monkeypatch.setattr(tcp_exchange, "PATIENCE", 30.0)  # the caller's thread holds the link throughout
    p, addr = start_serve("--tcp", "127.0.0.1:0", "--device", "cpu", pattern=r"listening on (tcp://\S+)")
    try:
        d = ember.connect(addr)
        x = xp.asarray(np.ones((1500, 1500)), device=d)
        assert (xp.asarray(np.ones(1), device=d) + 1.0).to_numpy()[0] == 2.0
        calm = d.session.conn.calm
        y = x
        for _ in range(6):
            y = y @ x / 1500.0  # seconds of work on the peer's worker
        s = d.session
        s.flush()  # sent ahead, so the read finds the link calm and holds it while the peer works
        assert wait_until(lambda: s._parked and not s._frames and calm.parked, timeout=10.0)
        got: list[BaseException] = []
        reader = threading.Thread(target=lambda: got.append(_raises(lambda: y[0, :2].to_numpy())))
        reader.start()
        assert wait_until(lambda: calm.gate.locked(), timeout=10.0), "the exchange never began"
        t0 = time.monotonic()
        p.kill()
        reader.join(10.0)
        assert not reader.is_alive(), "the read hung after its peer died"
        assert time.monotonic() - t0 < 6.0
        assert isinstance(got[0], SessionLost), got
        assert isinstance(s.lost, SessionLost)
    finally:
        p.kill()
        p.wait(10)


@pytest.mark.timeout(60)
def test_an_idle_calm_session_hears_its_peer_die(patient):
    p, addr = start_serve("--tcp", "127.0.0.1:0", "--device", "cpu", pattern=r"listening on (tcp://\S+)")
    try:
        d = ember.connect(addr)
        s = d.session
        x = xp.asarray(np.ones(2), device=d)
        for _ in range(5):
            assert (x + 1.0).to_numpy().tolist() == [2.0, 2.0]
        assert s.stats["exchanges"] > 0
        assert wait_until(lambda: s.conn.calm.parked, timeout=5.0)  # nothing awaited: the loop reads nothing
        p.kill()
        assert wait_until(lambda: s.lost is not None, timeout=5.0), "the loss went unnoticed"
        assert isinstance(s.lost, SessionLost)
    finally:
        p.kill()
        p.wait(10)


def _raises(fn) -> BaseException | None:
    try:
        fn()
    except BaseException as e:  # noqa: BLE001
        return e
    return None


@pytest.mark.timeout(60)
def test_a_silent_tcp_link_mid_exchange_gives_session_lost_then_reconnects(peer_server):
    proxy = DroppingProxy("tcp", int(_address(peer_server, "tcp://").rsplit(":", 1)[1]))
    try:
        _lose_and_reconnect(f"tcp://127.0.0.1:{proxy.port}", proxy, hb=2.0)
    finally:
        proxy.close()


@pytest.mark.timeout(60)
def test_an_unpark_that_finds_a_failing_caller_holding_the_gate_is_not_lost(peer_server, patient):
    """The loop asks for its reader (``unpark``) in the moment a caller's ``begin`` holds the gate and then
    gives up: the caller hands the decision back to the loop (``settle``), which leaves the link calm
    when nothing is awaited, so the next round trip is again the caller's own (not a lost request that
    only an ordinary round trip would clear)."""
    import asyncio

    d = ember.connect(_address(peer_server, "tcp://"))
    try:
        a = xp.asarray(np.arange(4.0), device=d)
        assert float(xp.sum(a)) == 6.0  # the link is calm now: parked, answered on this thread
        s = d.session
        calm = s._calm
        assert calm is not None and calm.parked

        def loop_runs(fn):
            asyncio.run_coroutine_threadsafe(asyncio.sleep(0), s.loop).result(10)  # (callbacks before it ran)
            done = threading.Event()
            s.loop.call_soon_threadsafe(lambda: (fn(), done.set()))
            assert done.wait(10)

        real = calm.gate

        class RacingGate:  # begin takes the gate, the loop's unpark comes, then begin's re-check fails
            def acquire(self, blocking=True):
                got = real.acquire(blocking)
                if got and threading.current_thread() is threading.main_thread():
                    loop_runs(calm.unpark)
                    assert calm.unpark_wanted and calm.parked  # unpark found the gate held: left to us
                return got

            def release(self):
                real.release()

            def locked(self):
                return real.locked()

        calm.gate = RacingGate()
        try:
            assert not calm.begin()
        finally:
            calm.gate = real
        loop_runs(lambda: None)  # the settle the caller asked for has run
        assert not calm.unpark_wanted and calm.parked  # nothing is awaited: the link stays calm
        before = _exchanges(d)
        assert float(xp.sum(a + 1)) == 10.0
        assert _exchanges(d) == before + 1  # the next round trip is the caller's own
    finally:
        d.close()
