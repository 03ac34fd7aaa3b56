"""torch.compile(model, backend="ember"): each compiled graph recorded once per layout, then replayed
(ember/torch/_compile.py) — bit-equal to eager, which equals local CPU torch."""

from __future__ import annotations

from typing import Any, Callable

import pytest

torch = pytest.importorskip("torch")
nn, F = torch.nn, torch.nn.functional

import ember  # noqa: E402
import ember.torch  # noqa: E402,F401
from ember.torch import _compile as C  # noqa: E402
from ember.torch import workloads as W  # noqa: E402

pytestmark = pytest.mark.timeout(180)


def _lm_loss(out: Any, y: Any) -> Any:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


WORKLOADS: dict[str, tuple[Callable[[], Any], Callable[[Any], Any], Callable[[Any, Any], Any]]] = {
    "mlp": (lambda: W.MLP(16, 32, 4), lambda g: W.classification_batch(g, 32, (16,), 4), F.cross_entropy),
    "transformer": (W.TinyLM, W.lm_batch(), _lm_loss),
    "cnn-batchnorm-dropout": (W.CNN, W.image_batch(8), F.cross_entropy),
}


def train(device: str, name: str, backend: str | None, steps: int = 4, reseed_at: int = -1) -> tuple[list[float], list[Any]]:
    make, batch, loss_fn = WORKLOADS[name]
    torch.manual_seed(0)
    model = make().to(device)
    run = torch.compile(model, backend=backend) if backend else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    x, y = (t.to(device) for t in batch(g))
    losses = []
    for step in range(steps):
        if step == reseed_at:
            torch.manual_seed(123)  # reaches the peer before its next random op, compiled or not
        loss = loss_fn(run(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().cpu() for p in model.parameters()]


def _eager_then_compiled(run: Callable[[bool], Any]) -> dict[str, int]:
    """``run(False)`` then ``run(True)`` on the embedded peer, bit-equal; the compile stats between the two."""
    with ember.connect("local:torch"):
        eager = run(False)
        before = dict(C.stats)
        compiled = run(True)
    same(eager, compiled)
    return before


def same(a: Any, b: Any) -> None:
    assert a[0] == b[0], f"losses differ: {a[0]} vs {b[0]}"
    for p, q in zip(a[1], b[1]):
        assert torch.equal(p, q), f"parameters differ by {(p - q).abs().max().item()}"


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_compiled_training_replays_and_is_bit_equal_to_eager(torch_peer: str, name: str) -> None:
    with ember.connect(torch_peer):
        eager = train("ember", name, None, reseed_at=2)
        before = dict(C.stats)
        compiled = train("ember", name, "ember", reseed_at=2)
        aot = train("ember", name, "aot_eager", reseed_at=2)
    same(eager, compiled)
    same(eager, aot)
    assert C.stats["captures"] > before["captures"]  # forward and backward, once per layout
    assert C.stats["replays"] >= before["replays"] + 2 * 2  # later steps: no per-op dispatch
    if name != "cnn-batchnorm-dropout":  # (dropout draws on the peer's generator, not local CPU's)
        same(train("cpu", name, None, reseed_at=2), compiled)


def test_a_graph_with_a_cpu_input_runs_eagerly_and_a_new_layout_is_captured_anew() -> None:
    with ember.connect("local:torch"):
        torch.manual_seed(0)
        lin = nn.Linear(4, 3).to("ember")
        scale = torch.tensor(2.0)  # a CPU tensor: the graph runs as eager does (uploads it), every time

        def f(x: Any) -> Any:
            return lin(x) * scale

        compiled = torch.compile(f, backend="ember")
        eager0 = C.stats["eager"]
        for n in (8, 8, 8, 16, 16, 16, 16, 16):
            x = torch.arange(n * 4.0).reshape(n, 4).to("ember")
            with torch.no_grad():
                assert torch.equal(compiled(x).cpu(), f(x).cpu())
        before = dict(C.stats)
        plain = torch.compile(lambda x: lin(x).relu(), backend="ember")
        with torch.no_grad():
            for n in (5, 5, 5):
                x = torch.ones(n, 4).to("ember")
                assert torch.equal(plain(x).cpu(), lin(x).relu().cpu())
        assert C.stats["captures"] == before["captures"] + 1 and C.stats["replays"] >= before["replays"] + 2
        assert C.stats["eager"] >= eager0 + 8  # (counted where it ran eagerly)


def test_a_capture_that_reseeds_is_captured_again_and_random_ops_match_eager() -> None:
    def f(x: Any) -> Any:
        return F.dropout(x * 3.0, 0.5, training=True)

    with ember.connect("local:torch"):
        x = torch.ones(64).to("ember")
        torch.manual_seed(5)
        want = [f(x).cpu() for _ in range(4)]
        compiled = torch.compile(f, backend="ember")
        before = dict(C.stats)
        torch.manual_seed(5)  # the first capture records the peer's reseed: not replayable, tried again
        got = [compiled(x).cpu() for _ in range(4)]
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert C.stats["eager"] == before["eager"] + 1 and C.stats["captures"] == before["captures"] + 1
    assert C.stats["replays"] == before["replays"] + 2


class _Checkpointed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.drop = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4), torch.nn.Dropout(0.3)

    def block(self, x: Any) -> Any:
        return self.drop(torch.relu(self.a(x)))

    def forward(self, x: Any) -> Any:
        return self.b(torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False))


def _checkpointed_steps(device: str, compiled: bool) -> tuple[list[float], list[Any]]:
    torch.manual_seed(0)
    x = torch.randn(16, 8)
    m = _Checkpointed().to(device)
    f = torch.compile(m, backend="ember" if device == "ember" else "aot_eager") if compiled else m
    x = x.to(device)
    torch.manual_seed(1)  # (after every CPU draw: the peer's stream and the CPU's start alike)
    losses = []
    for _ in range(3):
        loss = f(x).pow(2).mean()
        loss.backward()
        losses.append(loss.item())
    return losses, [p.grad.cpu() for p in m.parameters()]


def test_a_compiled_checkpointed_region_with_dropout_replays_its_mask_as_cpu() -> None:
    """torch.compile turns a checkpointed region's random ops into torch's ``run_and_save_rng_state`` /
    ``run_with_rng_state``, whose kernels know cpu/cuda/hpu/xpu only ("Backend not supported for ember"
    before): ember's save and restore the peer's stream (``_rng.install_compiled``). Equal to eager ember and
    to CPU, gradients included (the recompute draws the forward's mask)."""
    with ember.connect("local:torch"):
        got, eager = _checkpointed_steps("ember", True), _checkpointed_steps("ember", False)
    want = _checkpointed_steps("cpu", True)
    for other in (eager, want):
        assert got[0] == other[0] and all(torch.equal(a, b) for a, b in zip(got[1], other[1]))


def test_a_compiled_optimizer_step_keeps_its_writes_in_the_graph_and_replays() -> None:
    """torch.compile(opt.step): an inference graph that writes its inputs (parameters, state) in place;
    the writes stay in the graph (keep_inference_input_mutations), one REPLAY per step, bit-equal."""
    def run(compiled: bool) -> tuple[list[float], list[Any]]:
        torch.manual_seed(0)
        model = W.MLP(16, 32, 4).to("ember")
        o = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2, device="ember"), capturable=True)
        stepper = torch.compile(o.step, backend="ember") if compiled else o.step
        g = torch.Generator().manual_seed(0)
        losses = []
        for _ in range(10):
            x, y = W.classification_batch(g, 32, (16,), 4)
            o.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x.to("ember")), y.to("ember"))
            loss.backward()
            stepper()
            losses.append(loss.item())
        return losses, [p.detach().cpu() for p in model.parameters()]
    before = _eager_then_compiled(run)
    assert C.stats["replays"] >= before["replays"] + 8


def test_a_compiled_graph_is_one_replay_per_call_without_dispatch() -> None:
    with ember.connect("local:torch") as dev:
        s = dev.session
        torch.manual_seed(0)
        model = W.MLP(16, 32, 4).to("ember")
        run = torch.compile(model, backend="ember")
        x = torch.randn(8, 16).to("ember")
        with torch.no_grad():
            want = model(x).cpu()
            for _ in range(3):
                run(x)
            dev.sync()
            r0, ops0, m0 = s.stats["replays"], ember.torch.counters["ops"], s.stats["ops"]
            outs = [run(x) for _ in range(10)]
            dev.sync()
        assert s.stats["replays"] == r0 + 10 and ember.torch.counters["ops"] == ops0
        assert s.stats["ops"] - m0 <= 10 + 2  # one REPLAY each (and the SYNC; drops ride along)
        assert all(torch.equal(o.cpu(), want) for o in outs)


def test_ember_s_own_kernels_are_never_compiled_by_dynamo() -> None:
    """An LSTM under ``torch.compile`` runs ember's kernels (its AutogradPrivateUse1 LSTM, the dispatch fallback)
    in the compiled region's eager part, where Dynamo's frame hook is armed: Dynamo compiles the model's frame
    and none of ember's (before: ~140 frames of ember's dispatch code, its recompile limit hit, the step 0.3x)."""
    from torch._dynamo.utils import counters

    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn, self.lin = torch.nn.LSTM(8, 8, 2, batch_first=True), torch.nn.Linear(8, 4)

        def forward(self, x: Any) -> Any:
            return self.lin(self.rnn(x)[0])

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    m = M().to("ember")
    f = torch.compile(m, backend="ember")
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        f(torch.randn(2, 5, 8, generator=g).to("ember")).sum().backward()
    assert counters["frames"]["total"] <= 4, dict(counters["frames"])
    assert m.lin.weight.grad is not None and torch.isfinite(m.lin.weight.grad.cpu()).all()


def _replays_per_step(dev: Any, steps: int, read_every: int, late: bool = False) -> tuple[list[float], list[Any],
                                                                                         float, float]:
    """The MLP trained ``steps`` steps under torch.compile on ``dev`` (one batch, uploaded every step), its loss
    read every ``read_every`` steps (``late``: as ``loss * 1``, a value the end of the step computes);
    the losses read, the parameters, and the session's REPLAYs and replayed ops per step over the last 60."""
    s = dev.session
    make, batch, loss_fn = WORKLOADS["mlp"]
    torch.manual_seed(0)
    model = make().to("ember")
    run = torch.compile(model, backend="ember")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    xc, yc = batch(torch.Generator().manual_seed(0))
    losses: list[float] = []
    for step in range(steps):
        if step == steps - 60:
            r0, n0 = s.stats["replays"], s.stats["replayed_ops"]
        x, y = xc.to("ember"), yc.to("ember")  # (uploaded every step, as a loader's batches are)
        loss = loss_fn(run(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % read_every == read_every - 1:
            losses.append((loss * 1 if late else loss).item())
    return losses, [p.detach().cpu() for p in model.parameters()], (s.stats["replays"] - r0) / 60, \
        (s.stats["replayed_ops"] - n0) / 60


def test_a_compiled_training_step_goes_out_as_one_replay_with_its_loss(torch_peer: str) -> None:
    """A training step's forward and backward graphs go into the session's op group with the eager loss between
    them, and the optimizer's replayed step after them: per step one REPLAY of forward, loss, backward and
    optimizer (the tensors the forward saves for the backward never get an id on the peer). A loop that reads its
    loss every step splits it: the peer answers after forward and loss, then runs the rest. Where the group has
    no room for a graph (a session whose groups hold at most 2 ops), or the loop reads every step a value the end
    of the step computes (a held group would start on the peer only at the read), each graph is a REPLAY of its
    own, sent at once. All bit-equal to eager and to local CPU torch over 100 steps."""
    with ember.connect(torch_peer) as dev:
        grouped = _replays_per_step(dev, 100, read_every=10)
        synced = _replays_per_step(dev, 100, read_every=1)
        late = _replays_per_step(dev, 100, read_every=1, late=True)
    with ember.connect(torch_peer, graph_max_ops=2) as dev:
        alone = _replays_per_step(dev, 100, read_every=10)
    with ember.connect(torch_peer) as dev:
        eager = train("ember", "mlp", None, steps=100)
    local = train("cpu", "mlp", None, steps=100)
    # forward, loss, backward and the optimizer's step; the step that reads its loss: forward and loss, then the rest
    assert grouped[2] == 1.1, grouped[2:]
    assert synced[2] == 2, synced[2:]  # forward and loss; backward and optimizer's step (the READ between them)
    assert late[2] == 3, late[2:]  # forward, backward, (loss, optimizer's step and the value read)
    assert alone[2] == 3, alone[2:]  # forward, backward, the optimizer's step (the loss's ops go as they are)
    assert grouped[3] > alone[3]  # the loss's ops are replayed too
    assert local[0] == synced[0] == late[0] and local[0][9::10] == grouped[0] == alone[0], (local[0], grouped[0])
    for got in (grouped, synced, late, alone, eager):
        same((local[0][:0], local[1]), (got[0][:0], got[1]))


def test_graphs_with_dynamic_shapes_still_replay(torch_peer: str) -> None:
    """A model called with a second batch size (a loader's last, smaller batch) is recompiled by Dynamo with a
    symbolic batch dimension: its forward then also returns that size for the backward. Each batch size is
    captured once and replayed (the size is a constant of the inputs' layouts), never run eagerly for good; and
    the training is bit-equal to eager's."""
    def run(backend: str | None) -> tuple[list[float], list[Any]]:
        torch.manual_seed(0)
        model = W.MLP(16, 32, 4).to("ember")
        fwd = torch.compile(model, backend=backend) if backend else model
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(0)
        losses = []
        for step in range(16):
            x, y = W.classification_batch(g, 8 if step % 4 == 3 else 32, (16,), 4)
            loss = F.cross_entropy(fwd(x.to("ember")), y.to("ember"))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses, [p.detach().cpu() for p in model.parameters()]

    torch._dynamo.reset()
    with ember.connect(torch_peer):
        eager = run(None)
        before = dict(C.stats)
        compiled = run("ember")
    assert C.stats["eager"] == before["eager"], (before, C.stats)
    assert C.stats["replays"] - before["replays"] >= 16  # (of 32 calls: the rest are captures, per graph and size)
    same(eager, compiled)


@torch.library.custom_op("embertest::segment_sums", mutates_args=())
def _segment_sums(x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """A custom op whose Python reads its offsets (as transformers' grouped_mm_fallback does) and slices by them."""
    parts, start = [], 0
    for end in offs.tolist():
        parts.append(x[start:end].sum())
        start = end
    return torch.stack(parts)


@_segment_sums.register_fake
def _(x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return x.new_empty(offs.shape[0])


def test_a_graph_that_reads_a_value_while_it_runs_is_never_replayed() -> None:
    """A compiled graph whose custom op reads its offsets (``.tolist()``) makes other ops for other offsets:
    replaying the first call's ops gave the first call's slices (Hugging Face's Mixtral under torch.compile
    trained 3e-3 off). Such a graph runs op by op, every call, equal to eager."""
    f = torch.compile(lambda x, offs: _segment_sums(x * 2, offs) + 1, backend="ember")
    x = torch.arange(8.0)
    with ember.connect("local:torch"):
        before = dict(C.stats)
        for offs in ([2, 5, 8], [1, 1, 8], [4, 6, 8], [8, 8, 8]):
            o = torch.tensor(offs)
            want = _segment_sums(x * 2, o) + 1
            assert torch.equal(f(x.to("ember"), o.to("ember")).cpu(), want), offs
        assert C.stats["replays"] == before["replays"]


@pytest.mark.parametrize("kw", [{"mode": "reduce-overhead"}, {"mode": "max-autotune"},
                                {"options": {"trace.enabled": False}}],
                         ids=["reduce-overhead", "max-autotune", "options"])
def test_inductor_s_modes_and_options_are_accepted_and_ignored(kw: dict[str, Any]) -> None:
    """As ``aot_eager`` does (they raised TypeError inside the backend): every mode replays the recorded graph."""
    torch._dynamo.reset()
    with ember.connect("local:torch"):
        m = torch.nn.Linear(4, 2).to("ember")
        x = torch.randn(3, 4).to("ember")
        assert torch.equal(torch.compile(m, backend="ember", **kw)(x).cpu(), m(x).cpu())


@pytest.mark.parametrize("opt", ["Adam", "AdamW", "SGD"])
def test_a_compiled_optimizer_step_at_the_default_foreach_equals_cpu_s(opt: str) -> None:
    """``torch.compile(opt.step)`` with ``foreach`` left None: ember's choice of path ran its own code in the
    traced step (a graph break, then Adam's non-capturable path failed: "Expected scalars to be on CPU, got meta").
    Traced, torch's own choice is made (the multi-tensor path, as in eager on ember): equal to CPU's aot_eager on
    that path."""
    def run(device: str, backend: str) -> list[Any]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        m = torch.nn.Linear(4, 2).to(device)
        kw = {"momentum": 0.9} if opt == "SGD" else {}
        o = getattr(torch.optim, opt)(m.parameters(), lr=1e-2, **kw, **({"foreach": True} if device == "cpu" else {}))
        step = torch.compile(o.step, backend=backend)
        x = torch.randn(3, 4)
        for _ in range(4):
            m(x.to(device)).pow(2).sum().backward()
            step()
            o.zero_grad()
        return [p.detach().cpu() for p in m.parameters()]
    want = run("cpu", "aot_eager")
    with ember.connect("local:torch"):
        got = run("ember", "ember")
    assert all(torch.equal(a, b) for a, b in zip(want, got))


class _Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)

    def forward(self, x: Any) -> Any:
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 8).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_dynamic_shapes_through_attention_compile_one_graph() -> None:
    """``dynamic=True`` over ``scaled_dot_product_attention``: asking the peer which kernel it takes made a
    tensor of the traced sizes, which pinned them, so each new sequence length compiled a new graph (4-20 s each
    for GPT-2, eager after 8). The stand-in now takes this call's sizes without a guard: one graph, equal to CPU."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    m = _Attention()
    xs = [torch.randn(2, n, 16) for n in (8, 12, 16, 20)]
    want = [m(x) for x in xs]
    with ember.connect("local:torch"):
        m.to("ember")
        f = torch.compile(m, backend="ember", dynamic=True)
        got = [f(x.to("ember")).cpu() for x in xs]
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert counters["stats"]["unique_graphs"] == 1


class _WithConstant(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: Any) -> Any:
        empty = torch.tensor([], dtype=x.dtype, device=x.device)  # (as Hugging Face's DynamicCache starts a layer)
        return torch.cat([empty, self.lin(x).flatten()]).pow(2).sum()


def test_a_graph_holding_a_tensor_constant_replays() -> None:
    """A tensor made in the forward (``torch.tensor([])``: every Hugging Face model's default KV cache, in training
    too) is a constant AOTAutograd lifts into the graph: a storage neither input nor fresh, so the graph ran op by
    op on every call. The graph's constants are now named by the replay as its inputs are: equal to eager."""
    def run(compiled: bool) -> tuple[list[float], list[Any]]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        m = _WithConstant().to("ember")
        f = torch.compile(m, backend="ember") if compiled else m
        o = torch.optim.SGD(m.parameters(), lr=0.01)
        losses = []
        for k in range(6):
            loss = f(torch.full((4, 8), 0.1 * k).to("ember"))
            loss.backward()
            o.step()
            o.zero_grad()
            losses.append(loss.item())
        return losses, [p.detach().cpu() for p in m.parameters()]
    before = _eager_then_compiled(run)
    assert C.stats["eager"] == before["eager"] and C.stats["replays"] >= before["replays"] + 8
