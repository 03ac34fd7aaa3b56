"""ember.torch across Ember devices, with ember.array_api, and under graph caching."""

from __future__ import annotations

from typing import Iterator

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ember  # noqa: E402
import ember.array_api as xp  # noqa: E402
import ember.torch  # noqa: E402
from ember.server import Server  # noqa: E402
from ember.torch import workloads as W  # noqa: E402

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def two_peers() -> Iterator[list[Server]]:
    """Two peers over WebSocket; the first hosts two torch devices."""
    a, b = Server(["torch:cpu", "torch:cpu"]), Server(["torch:cpu"])
    for s in (a, b):
        s.listen_websocket("127.0.0.1", 0)
        s.start_in_thread()
    yield [a, b]
    for s in (a, b):
        s.close()


def test_tensors_remember_their_ember_device_and_mixing_two_raises(two_peers: list[Server]) -> None:
    d0 = ember.connect(two_peers[0].addresses[0], device=0)
    d1 = ember.connect(two_peers[1].addresses[0])
    with d0:
        x = torch.ones(3, device="ember")
    with d1:
        y = torch.ones(3, device="ember")
    assert ember.torch.device_of(x) is d0 and ember.torch.device_of(y) is d1
    assert x.device == y.device == torch.device("ember:0")  # torch sees one device
    with pytest.raises(ember.torch.WrongDevice, match=r"two Ember devices.*ws://.*ws://"):
        x + y
    for d in (d0, d1):
        d.close()


def _split_training(a: ember.Device | None, b: ember.Device | None, opt: str) -> tuple[list[float], list[torch.Tensor]]:
    """A model whose first layer lives on ``a`` and second on ``b`` (None: CPU), one optimizer over both, the
    gradients clipped over both: torch calls both Ember devices ember:0, grouping their tensors as one device's."""
    torch.manual_seed(0)
    l1, l2 = torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)
    x = torch.randn(5, 4)
    if a is not None:
        with a:
            l1, x = l1.to("ember"), x.to("ember")
        with b:
            l2 = l2.to("ember")
    params = [*l1.parameters(), *l2.parameters()]
    o = torch.optim.AdamW(params, weight_decay=0.1) if opt == "AdamW" else torch.optim.SGD(params, 0.1, momentum=0.9)
    norms = []
    for _ in range(3):
        h = torch.tanh(l1(x))
        loss = l2(h if a is None else ember.torch.to_device(h, b)).pow(2).sum()
        o.zero_grad()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, 0.5)))
        o.step()
    return norms, [p.detach().cpu() for p in params]


@pytest.mark.parametrize("opt", ["AdamW", "SGD"])
def test_one_optimizer_and_clipping_over_a_model_split_across_two_devices_equal_cpu(two_peers: list[Server],
                                                                                     opt: str) -> None:
    """Each ``_foreach_*`` call over both devices runs as one call per device, and ``clip_grad_norm_``'s total
    gathers the norms on the first tensor's device, as on CUDA with cuda:0 and cuda:1 (``_across_peers.py``);
    they raised WrongDevice."""
    a, b = ember.connect(two_peers[0].addresses[0], device=0), ember.connect(two_peers[1].addresses[0])
    try:
        got = _split_training(a, b, opt)
    finally:
        a.close()
        b.close()
    want = _split_training(None, None, opt)
    assert got[0] == want[0] and all(torch.equal(g, w) for g, w in zip(got[1], want[1]))


@pytest.mark.parametrize("route", ["same-peer", "peer-to-peer", "via-client", "embedded"])
def test_to_device_moves_values_and_gradients(two_peers: list[Server], route: str) -> None:
    a = ember.connect(two_peers[0].addresses[0], device=0)
    if route == "same-peer":
        b = ember.connect(two_peers[0].addresses[0], device=1)
    elif route == "embedded":
        b = ember.torch.current_device()  # the embedded torch:cpu peer: through the client
    else:
        b = ember.connect(two_peers[1].addresses[0])
    opts = {"via_client": True} if route == "via-client" else {}
    with a:
        w = torch.nn.Parameter(torch.arange(6.0).reshape(2, 3).to("ember"))
        h = (w * 2).t()  # a non-contiguous view moves as its values
    moved = ember.torch.to_device(h, b, **opts)
    assert ember.torch.device_of(moved) is b
    assert torch.equal(moved.cpu(), (torch.arange(6.0).reshape(2, 3) * 2).t())
    with b:
        loss = (moved * torch.arange(2.0).to("ember")).sum()
    loss.backward()  # the gradient comes back to w's device
    assert ember.torch.device_of(w.grad) is a
    assert torch.equal(w.grad.cpu(), torch.tensor([[0.0, 0.0, 0.0], [2.0, 2.0, 2.0]]))
    for d in {a, b} - {ember.torch.current_device()}:
        d.close()


def test_array_api_interop_without_moving_data(two_peers: list[Server]) -> None:
    d = ember.connect(two_peers[1].addresses[0])
    a = xp.asarray(np.arange(12, dtype=np.float32).reshape(3, 4), device=d)
    sent = d.session.stats["bytes_sent"]
    reads = d.session.stats["reads"]
    t = ember.torch.from_array(a)
    t2 = (t * 2).t().contiguous()
    back = ember.torch.to_array(t2)
    assert back.shape == (4, 3) and back.dtype == xp.float32
    assert d.session.stats["reads"] == reads and d.session.stats["bytes_sent"] - sent < 1024  # no data moved
    assert np.array_equal(np.asarray(xp.sum(back, axis=0)), (np.arange(12).reshape(3, 4) * 2).sum(axis=1))
    assert torch.equal(t.cpu(), torch.arange(12.0).reshape(3, 4))
    d.close()


def test_a_repeated_training_step_is_replayed_from_the_graph_cache(two_peers: list[Server]) -> None:
    d = ember.connect(two_peers[1].addresses[0])
    s = d.session
    with d:
        torch.manual_seed(0)
        model = W.MLP().to("ember")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(1)
        x, y = W.classification_batch(g, 32, (8,), 4)
        x, y = x.to("ember"), y.to("ember")  # the same batch: the step's ops are all there is on the wire
        per_step = []
        for _ in range(8):
            before = s.stats["bytes_sent"]
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss.item()
            per_step.append(s.stats["bytes_sent"] - before)
    assert s.stats["replays"] >= 5
    first, replayed = per_step[0], max(per_step[-3:])
    assert first >= 10 * replayed, f"wire bytes per step: {per_step}"
    d.close()


def test_copies_and_casts_stay_on_their_tensor_s_device(two_peers: list[Server]) -> None:
    """``clone`` and ``.to(dtype)`` are torch composites that allocate with a factory op: the result
    lives where its operand does, not on the current device."""
    d0 = ember.connect(two_peers[0].addresses[0], device=0)
    d1 = ember.connect(two_peers[1].addresses[0])
    with d0:
        x = torch.arange(6.0, device="ember").reshape(2, 3)
    with d1:  # the current device is another one
        made = {"clone": x.clone(), "half": x.half(), "to(float64)": x.to(torch.float64),
                "contiguous": x.t().contiguous(), "to(int32)": x.to(torch.int32)}
        for name, t in made.items():
            assert ember.torch.device_of(t) is d0, name
            assert t.cpu().tolist() == x.cpu().to(t.dtype).t().tolist() if name == "contiguous" \
                else t.cpu().tolist() == x.cpu().to(t.dtype).tolist(), name
    for d in (d0, d1):
        d.close()


class _ZerosInBackward(torch.autograd.Function):
    """A backward that makes a tensor with a factory op (as some of torch's derivative formulas do)."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        return x * 2

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        return g * 2 + torch.zeros(g.shape, device="ember")


def test_a_backward_on_torch_s_autograd_thread_uses_the_with_device(two_peers: list[Server]) -> None:
    with ember.connect(two_peers[1].addresses[0]) as d:  # not the default device
        w = torch.ones(3, device="ember", requires_grad=True)
        with torch.autocast("ember", dtype=torch.bfloat16):  # casts in the backward too
            y = _ZerosInBackward.apply(torch.nn.functional.linear(w[None], torch.eye(3, device="ember")))
        y.float().sum().backward()
        assert ember.torch.device_of(w.grad) is d
        assert w.grad.cpu().tolist() == [2.0, 2.0, 2.0]


def test_a_cpu_slice_moves_as_one_upload_in_torch_s_layout(monkeypatch) -> None:
    """``idx[:, :-1].to("ember")`` (a training loop's batch, every step): torch makes such a result
    contiguous, and so does one upload of the values (no empty tensor + copy); a dense view (transposed)
    keeps its strides as torch keeps them, through torch's own composite."""
    from ember.torch import _transfer
    composite: list[int] = []
    real = _transfer.copy_from_host
    monkeypatch.setattr(_transfer, "copy_from_host", lambda *a: (composite.append(1), real(*a))[1])
    x = torch.arange(60.0).reshape(3, 4, 5)
    cases = {"x[:, :-1]": (x[:, :-1], True), "x[:, ::2]": (x[:, ::2], True), "x[..., 1:]": (x[..., 1:], True),
             "1-d strided": (torch.arange(10)[::3], True), "transposed": (x.transpose(0, 1), False),
             "permuted": (x.permute(2, 0, 1), False)}
    for name, (v, one_upload) in cases.items():
        composite.clear()
        e = v.to("ember")
        assert e.stride() == torch.empty_like(v).stride(), name
        assert torch.equal(e.cpu(), v), name
        assert (not composite) == one_upload, name
    e = x.transpose(0, 1).to("ember", memory_format=torch.contiguous_format)
    assert e.is_contiguous() and torch.equal(e.cpu(), x.transpose(0, 1))
    e = x[:, :-1].to("ember", dtype=torch.float64)
    assert e.dtype == torch.float64 and e.is_contiguous() and torch.equal(e.cpu(), x[:, :-1].double())
