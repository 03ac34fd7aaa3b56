"""The peer works while the client records: a decided step leaves without waiting for a read.

A training loop reads its loss every few steps; between reads, each step's replayed groups must reach
the peer as they are decided, so that the peer runs step k while the caller records step k+1 (before,
ten steps waited in the client for the loss read, and the peer idled until then). Observed on the peer:
its session's finished batches grow with no read from the client and an idle timer that never ticks.
"""

from __future__ import annotations

import threading
from typing import Any, Iterator

import numpy as np
import pytest

import ember
import ember.array_api as xp
from ember.server import Server
from ember.server.guard.memory import keep_freed_pages

from test_core_sessions import wait_until

pytestmark = pytest.mark.timeout(120)
NEVER = 3600.0  # an idle_flush / graph_hold that never elapses within a test


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    srv = Server(["cpu", "torch:cpu"])
    srv.listen_tcp("127.0.0.1", 0)
    srv.listen_websocket("127.0.0.1", 0)
    srv.start_in_thread()
    yield srv
    srv.close()


def _address(srv: Server, scheme: str) -> str:
    return next(a for a in srv.addresses if a.startswith(scheme))


STEPS = 12


def _steps(dev: ember.Device, n: int) -> Any:
    """``STEPS`` steps, each an upload of ``n`` floats (the step's boundary: a message, not a read) and 10 ops
    on it; the last step's result, not read."""
    y = None
    for i in range(STEPS):
        y = xp.asarray(np.full(n, float(i)), device=dev)
        for _ in range(10):
            y = y * 1.5 + 1.0
    return y


def _last_step(n: int) -> np.ndarray:
    """What ``_steps`` computes last, on the host."""
    want = np.full(n, float(STEPS - 1))
    for _ in range(10):
        want = want * 1.5 + 1.0
    return want


def _done(srv: Server) -> int:
    """Batches the peer's sessions have run."""
    return sum(s.done for s in list(srv.live))


def _replayed(srv: Server) -> int:
    """Ops the peer's sessions have run as replays of registered graphs."""
    return sum(s.interp.replayed_ops for s in list(srv.live))


@pytest.mark.parametrize("scheme", ["tcp://", "ws://"])
def test_replayed_groups_reach_the_peer_between_reads(server: Server, scheme: str) -> None:
    """Steps end at an upload (a boundary that sends nothing by itself), so every group is held while it
    matches the previous one and replayed at the next upload. With an idle timer that ticks every 5 ms but a
    hold that never times out, the replays still go out: on TCP from the recording thread at once, on
    WebSocket with the next tick (which before sent nothing while any group was held)."""
    dev = ember.connect(_address(server, scheme), idle_flush=0.005 if scheme == "ws://" else NEVER,
                        graph_hold=NEVER)
    s = dev.session
    try:
        before = _replayed(server)
        y = _steps(dev, 8)
        assert s.stats["replays"] >= 8, s.stats
        # no read yet: the peer has run the steps the client decided (all but the last, still held; 20 ops each)
        assert wait_until(lambda: _replayed(server) - before >= 8 * 20, timeout=30), (_replayed(server) - before, s.stats)
        np.testing.assert_array_equal(y.to_numpy(), _last_step(8))
    finally:
        dev.close()


def test_a_step_with_its_inputs_upload_leaves_from_the_recording_thread_over_tcp(server: Server, monkeypatch) -> None:
    """A step's batch that carries its input (a 32 KiB upload riding in the batch: over ``SMALL_WRITE``)
    is still written by the recording thread when the socket's send queue takes it whole
    (``LARGE_WRITE``), rather than waiting for the I/O loop's thread to get the GIL."""
    from ember.transport import tcp_exchange

    big: list[int] = []
    write = tcp_exchange.CalmLink.write

    def counting(self, frame):
        if len(frame) > tcp_exchange.SMALL_WRITE and threading.current_thread() is threading.main_thread():
            big.append(len(frame))
        return write(self, frame)
    monkeypatch.setattr(tcp_exchange.CalmLink, "write", counting)
    dev = ember.connect(_address(server, "tcp://"), idle_flush=NEVER, graph_hold=NEVER)
    try:
        y = _steps(dev, 4096)  # 32 KiB uploads, each in the batch with the previous step's replay
        assert len(big) >= 8, (big, dev.session.stats)
        np.testing.assert_array_equal(y.to_numpy(), _last_step(4096))
    finally:
        dev.close()


def test_an_optimizer_step_leaves_at_once_over_tcp(server: Server) -> None:
    """Unchanged PyTorch over TCP, an idle timer that never ticks: each step's forward/backward group and its
    optimizer replay reach the peer before any read of the loss (bit-equal to local CPU at the end)."""
    torch = pytest.importorskip("torch")
    import ember.torch  # noqa: F401
    from ember.torch import workloads as W

    dev = ember.connect(_address(server, "tcp://"), device=1, idle_flush=NEVER, graph_hold=NEVER)  # torch:cpu

    def train(device: str, steps: int, check: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        m = W.MLP(8, 16, 4).to(device)
        o = torch.optim.SGD(m.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(1)
        before = _done(server)
        for k in range(steps):
            x, y = W.classification_batch(g, 16, (8,), 4)
            o.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(m(x.to(device)), y.to(device)).backward()
            o.step()
        if check:  # nothing read: the replayed steps were sent as they were decided
            assert wait_until(lambda: _done(server) - before >= steps // 2, timeout=30), _done(server) - before
        return [p.detach().cpu() for p in m.parameters()]

    try:
        with dev:
            remote = train("ember", 12, True)
        local = train("cpu", 12, False)
        for a, b in zip(remote, local):
            assert torch.equal(a, b)
    finally:
        dev.close()


def test_keep_freed_pages_sets_glibc_s_thresholds() -> None:
    """``ember serve`` keeps freed buffers for reuse (glibc mallopt); a no-op returning False elsewhere."""
    import platform
    ok = keep_freed_pages()
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        assert ok
    else:
        assert ok is False


def test_serve_refuses_a_keep_freed_size_it_cannot_read() -> None:
    """``ember serve --keep-freed`` takes a size (``0``: off); anything else is refused with the reason, exit 2."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "ember.cli", "serve", "--keep-freed", "lots", "--no-iroh",
                        "--tcp", "127.0.0.1:0"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--keep-freed" in r.stderr, r.stderr
