"""``loss.item()`` / ``(a + 1).item()``: one round trip on the caller's thread, with the op that precedes it.

On the embedded peer (``Session.direct``) and over TCP (``CalmLink``) the op and the read leave in one
batch, answered on the caller's thread (``stats["exchanges"]``); the peer runs the op through its
eager plan (``server/execute/eager.py``), reading the operand through the typed view it kept. The
fast path must change nothing else: values bit-equal to local torch, a read never before the ops
recorded ahead of it, a failed op's error at the read (and the session going on), a lost peer
raising ``SessionLost`` instead of hanging.
"""

from __future__ import annotations

import gc
import struct
import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import ember  # noqa: E402
import ember.torch  # noqa: E402
from ember.errors import RemoteExecutionError, SessionLost  # noqa: E402
from ember.server import Server  # noqa: E402
from ember.server.execute import eager  # noqa: E402
from ember.transport import tcp_exchange  # noqa: E402

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def patient(monkeypatch: Any) -> None:
    """A caller waits for its answer on its own thread up to 5 s before handing the link to the loop, so a
    loaded machine's slow moment does not take a round trip off the counted path."""
    monkeypatch.setattr(tcp_exchange, "PATIENCE", 5.0)


@pytest.fixture
def dev(embedded_or_tcp: ember.Device, patient: None) -> ember.Device:
    return embedded_or_tcp


def test_op_then_item_is_one_caller_thread_round_trip_and_bit_equal(dev: ember.Device) -> None:
    s = dev.session
    g = torch.Generator().manual_seed(0)
    with dev:
        for dtype in (torch.float32, torch.float64, torch.int64, torch.float16, torch.bool):
            host = (torch.randn(1, generator=g) * 100).to(dtype)
            a = host.to("ember")
            assert a.item() == host.item()
            before, batches, known = s.stats["exchanges"], s.stats["batches"], s.stats["known_reads"]
            for i in range(50):
                k = i % 2 == 0 if dtype is torch.bool else i
                got, want = (a + k).item(), (host + k).item()
                assert type(got) is type(want)
                assert struct.pack("d", float(got)) == struct.pack("d", float(want))  # bit-equal
            if dtype in (torch.int64, torch.bool):  # an upload's integer value and what follows from it: the
                assert s.stats["known_reads"] - known == 50  # client knows them (torch/_known.py), no round trip
                continue
            # each op went out with its read, answered on this thread (a loaded machine's idle tick may
            # send an op ahead now and then, and that read take the ordinary way)
            assert s.stats["exchanges"] - before >= 40
            assert s.stats["batches"] - batches <= 60


def test_the_planned_op_reads_its_operand_through_a_kept_typed_view() -> None:
    dev = ember.torch.current_device()
    with dev:
        a = torch.full((1,), 3.0, device="ember")
        for i in range(3):
            assert (a + i).item() == 3.0 + i
        sid = ember.torch._storage.ref_of(a).sid
    interp = next(x for x in gc.get_objects()
                  if type(x).__name__ == "Interpreter" and sid in getattr(x, "tensors", {})
                  and x.tensors[sid].__dict__.get(eager._VIEW) is not None)
    lay, _, view = interp.tensors[sid].__dict__[eager._VIEW]
    assert view.dtype is torch.float32 and view.tolist() == [3.0] and lay[0] is torch.float32


def test_a_read_never_passes_the_ops_recorded_before_it(dev: ember.Device) -> None:
    with dev:
        b, host = torch.zeros(1, device="ember"), torch.zeros(1)
        for i in range(40):
            b.add_(i).mul_(0.5)  # in place: only the order of the ops gives the value
            host.add_(i).mul_(0.5)
            if i % 3 == 0:
                assert b.item() == host.item()
        c = b * 2 + 1
        b.fill_(-1.0)  # after c was recorded: c keeps the value from before
        assert (c.item(), b.item()) == ((host * 2 + 1).item(), -1.0)


def test_a_failed_op_raises_at_its_item_and_the_fast_path_goes_on(dev: ember.Device) -> None:
    s = dev.session
    with dev:
        x = torch.zeros(3, device="ember")
        bad = x[torch.tensor([5]).to("ember")]  # meta cannot know the index is out of range
        for _ in range(2):
            with pytest.raises(RemoteExecutionError, match=r"aten\.index\.Tensor.*index 5 is out of bounds"):
                (bad + 1).item()  # the error of the op the read's value depends on
        a = torch.ones(1, device="ember")
        before = s.stats["exchanges"]
        for i in range(20):
            assert (a + i).item() == 1.0 + i
        assert s.stats["exchanges"] - before >= 15
        assert s.lost is None


def test_item_on_a_lost_tcp_peer_raises_session_lost(patient: None) -> None:
    srv = Server(["torch:cpu"])
    srv.listen_tcp("127.0.0.1", 0)
    d = ember.connect(srv.start_in_thread()[0])
    try:
        with d:
            a = torch.ones(1, device="ember")
            for i in range(5):
                assert (a + i).item() == 1.0 + i
            assert d.session.stats["exchanges"] >= 1  # (the reads took the caller's thread)
            srv.close()
            t0 = time.monotonic()
            with pytest.raises(SessionLost):
                for i in range(1000):  # the loss may be heard at once, or at this read's own exchange
                    (a + i).item()
            assert time.monotonic() - t0 < 10.0
            with pytest.raises(SessionLost):
                (a + 1).item()
    finally:
        d.close()
        srv.close()


def _mlp_loss(device: str) -> Any:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
    m, x, y = m.to(device), x.to(device), y.to(device)
    return lambda: torch.nn.functional.cross_entropy(m(x), y).item()


def test_small_reductions_and_losses_before_item_take_the_caller_s_thread_on_the_embedded_peer() -> None:
    """Not only pointwise ops: what precedes ``loss.item()`` (a matmul, a reduction, a loss) on small
    layouts runs on the caller's thread too (``Interpreter.cheap(direct=True)``), with the same values."""
    dev = ember.torch.current_device()
    s = dev.session
    with dev:
        local, remote = _mlp_loss("cpu"), _mlp_loss("ember")
        want = local()
        remote()
        a, m = torch.arange(6.0, device="ember"), torch.ones(4, 4, device="ember")
        before, tick = s.stats["exchanges"], s.idle_flush
        s.idle_flush = 1.0  # (a loaded machine's slow recording would let the 2 ms idle tick send ops ahead)
        try:
            for _ in range(10):
                assert remote() == want
                assert a.sum().item() == 15.0
                assert (m @ m).mean().item() == 4.0
        finally:
            s.idle_flush = tick
        assert s.stats["exchanges"] - before >= 15  # (of 30: the idle tick may still send an op ahead)


def test_a_users_autocast_or_inference_mode_around_the_read_never_reaches_the_peer_s_kernels() -> None:
    dev = ember.torch.current_device()
    s = dev.session
    with dev:
        m = torch.full((4, 4), 1.0 + 2 ** -10, device="ember")  # bfloat16 would round it to 1.0
        want = ((torch.full((4, 4), 1.0 + 2 ** -10) @ torch.full((4, 4), 1.0 + 2 ** -10)).sum()).item()
        assert (m @ m).sum().item() == want
        with torch.autocast("cpu", dtype=torch.bfloat16):  # (a CPU region: ember tensors are not autocast)
            before = s.stats["exchanges"]
            assert (m @ m).sum().item() == want  # the peer's mm ran as float32: on its worker, not this thread
            assert s.stats["exchanges"] == before
        tick = s.idle_flush
        s.idle_flush = 1.0  # (a loaded machine's slow recording would let the 2 ms idle tick send ops ahead)
        try:
            with torch.inference_mode():  # the caller's thread runs them, with inference mode off
                before = s.stats["exchanges"]
                for _ in range(5):  # (an op the tick sent ahead makes that read take the worker)
                    r = m @ m
                    assert r.sum().item() == want
                assert s.stats["exchanges"] > before
        finally:
            s.idle_flush = tick
        assert (r * 2).sum().item() == 2 * want  # made under inference mode, used after it


def test_a_users_dispatch_mode_does_not_see_the_peer_s_cpu_kernels() -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: list[str] = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if any(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in args):
                seen.append(str(func))
            return func(*args, **(kwargs or {}))

    dev = ember.torch.current_device()
    with dev:
        m = torch.ones(4, 4, device="ember")
        with Spy():
            assert (m @ m).sum().item() == 64.0
    assert not any("mm" in f or "sum" in f for f in seen), seen


def test_small_reads_copy_their_bytes_straight_from_the_storage():
    """A torch CPU peer answers a small read with a copy of the value's own bytes (``Backend.small_bytes``): the
    dtype, shape and bytes the general way (a NumPy view) gives, for a storage value at any offset of its storage
    and for a typed value (an Array API result, a loss); anything else goes the general way (None)."""
    import numpy as np

    from ember.server.execute.backends import make_backend
    f = make_backend("torch:cpu").small_bytes(64)
    base = torch.arange(100, dtype=torch.uint8)
    for v in (base[:8], base[10:50], base[:0], base[3:67], base.view(torch.int8)[:8],
              torch.zeros(2, 2, dtype=torch.uint8), torch.tensor(2.5, dtype=torch.float64),
              torch.arange(6, dtype=torch.float32).reshape(2, 3)[1], torch.tensor([True, False]),
              torch.tensor([1 + 2j], dtype=torch.complex64)):
        h = np.asarray(v)
        assert f(v) == (h.dtype.name, list(h.shape), h.tobytes())
    assert f(base[:65]) is None  # over the limit
    assert f(base[::2][:8]) is None  # not contiguous
    c = torch.tensor([1 + 2j], dtype=torch.complex64)
    assert f(c.conj()) is None and f(torch.ones(2)._neg_view()) is None  # (its bytes are not its value)
    assert f(torch.ones(2, requires_grad=True)) is None and f(torch.ones(2, dtype=torch.bfloat16)) is None
    assert make_backend("cpu").small_bytes(64) is None  # (NumPy devices read through to_host)
