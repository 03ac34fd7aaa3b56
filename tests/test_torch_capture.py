"""ember.torch.capture(step): a whole training step recorded twice, then one REPLAY per call
(ember/torch/_capture.py) — bit-equal to the same step run eagerly, on the embedded peer and over TCP."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Iterator

import pytest

torch = pytest.importorskip("torch")
nn, F = torch.nn, torch.nn.functional

import ember  # noqa: E402
import ember.torch  # noqa: E402,F401
from ember.torch import _capture as C  # noqa: E402
from ember.torch import workloads as W  # noqa: E402

pytestmark = pytest.mark.timeout(240)


class LSTMLM(nn.Module):
    """Embedding, a 2-layer LSTM whose state is carried from step to step, a linear decoder."""

    def __init__(self, vocab: int = 30, d: int = 12) -> None:
        super().__init__()
        self.emb, self.rnn, self.dec = nn.Embedding(vocab, d), nn.LSTM(d, d, 2, batch_first=True), nn.Linear(d, vocab)

    def forward(self, idx: Any, state: Any) -> Any:
        out, state = self.rnn(self.emb(idx), state)
        return self.dec(out), state


def _lm_loss(out: Any, y: Any) -> Any:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


#: name -> (model, batch, loss, optimizer)
WORKLOADS: dict[str, tuple[Callable[[], Any], Callable[[Any], Any], Callable[[Any, Any], Any], Callable[..., Any]]] = {
    "mlp-adamw": (lambda: W.MLP(16, 32, 4), lambda g: W.classification_batch(g, 32, (16,), 4), F.cross_entropy,
                  lambda ps: torch.optim.AdamW(ps, lr=1e-2, capturable=True)),
    "gpt": (lambda: W.TinyLM(vocab=40, d=32, heads=4, layers=2, ctx=16), W.lm_batch(40, 4, 16), _lm_loss,
            lambda ps: torch.optim.AdamW(ps, lr=3e-3, fused=True)),
    "cnn-batchnorm": (W.CNN, W.image_batch(4), F.cross_entropy,
                      lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)),
    "lstm": (LSTMLM, W.lm_batch(30, 4, 6), _lm_loss, lambda ps: torch.optim.SGD(ps, lr=0.5)),
}


def train(name: str, captured: bool, steps: int = 100, batches: Callable[[int], Any] | None = None,
          lr_at: int = -1) -> tuple[list[float], list[Any]]:
    """The same loop eagerly or with the step captured: losses read every 10 steps, final params."""
    make, batch, loss_fn, opt = WORKLOADS[name]
    torch.manual_seed(0)
    model = make().to("ember")
    torch.manual_seed(1)
    o = opt(model.parameters())
    lstm = name == "lstm"

    def step(x: Any, y: Any, *state: Any) -> Any:
        o.zero_grad(set_to_none=True)
        if lstm:
            out, state = model(x, state)
            loss = loss_fn(out, y)
        else:
            loss = loss_fn(model(x), y)
        loss.backward()
        o.step()
        return (loss, *(s.detach() for s in state)) if lstm else loss
    run = ember.torch.capture(step) if captured else step
    g = torch.Generator().manual_seed(2)
    state = tuple(torch.zeros(2, 4, 12).to("ember") for _ in range(2)) if lstm else ()
    losses = []
    for k in range(steps):
        if k == lr_at:
            for group in o.param_groups:
                group["lr"] *= 0.5
        x, y = batches(k) if batches is not None else batch(g)
        res = run(x.to("ember"), y.to("ember"), *state)
        loss, state = (res[0], res[1:]) if lstm else (res, ())
        if k % 10 == 9:
            losses.append(loss.item())
    return losses, [p.detach().cpu() for p in [*model.parameters(), *model.buffers()]]


def _training_step(forward: Callable[[Any], Any], opt: Any, loss_fn: Callable[[Any, Any], Any] = F.cross_entropy
                   ) -> Callable[[Any, Any], Any]:
    """The step these tests run, eagerly or captured: gradients cleared, the loss of ``forward(x)``, backward, the
    optimizer's step; the loss returned."""
    def step(x: Any, y: Any) -> Any:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(forward(x), y)
        loss.backward()
        opt.step()
        return loss
    return step


def same(a: Any, b: Any) -> None:
    assert a[0] == b[0], f"losses differ: {a[0]} vs {b[0]}"
    assert len(a[1]) == len(b[1])
    for p, q in zip(a[1], b[1]):
        assert torch.equal(p, q), f"parameters differ by {(p.double() - q.double()).abs().max().item()}"


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_captured_steps_are_bit_equal_to_eager_over_100_steps(peer: ember.Device, name: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", C.CaptureWarning)  # every workload is held: no fallback
        eager = train(name, False)
        before = dict(C.stats)
        captured = train(name, True)
    same(eager, captured)
    assert C.stats["captures"] == before["captures"] + 1
    assert C.stats["replays"] >= before["replays"] + 95  # recorded at most 3 times, replayed from then on


def test_a_new_learning_rate_or_layout_is_recorded_again(peer: ember.Device) -> None:
    g = torch.Generator().manual_seed(3)
    data = [W.classification_batch(g, 32 if k < 20 else 16, (16,), 4) for k in range(40)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", C.CaptureWarning)
        eager = train("mlp-adamw", False, 40, batches=data.__getitem__, lr_at=10)
        before = dict(C.stats)
        captured = train("mlp-adamw", True, 40, batches=data.__getitem__, lr_at=10)
    same(eager, captured)
    assert C.stats["captures"] == before["captures"] + 3  # batch 32, then a new lr, then batch 16
    assert C.stats["replays"] >= before["replays"] + 40 - 3 * 3


def test_messages_per_replayed_step_do_not_grow_with_the_model(tcp_peer: str) -> None:
    per_step = {}
    with ember.connect(tcp_peer) as dev:
        s = dev.session
        for name in ("mlp-adamw", "gpt"):
            make, batch, loss_fn, opt = WORKLOADS[name]
            model = make().to("ember")
            o = opt(model.parameters())

            step = ember.torch.capture(_training_step(model, o, loss_fn))
            x, y = (t.to("ember") for t in batch(torch.Generator().manual_seed(0)))
            for _ in range(4):
                step(x, y)
            dev.sync()
            m0, r0, ops0 = s.stats["ops"], C.stats["replays"], ember.torch.counters["ops"]
            for _ in range(20):
                loss = step(x, y)
            loss.item()
            assert C.stats["replays"] == r0 + 20 and ember.torch.counters["ops"] == ops0  # no op dispatched
            per_step[name] = (s.stats["ops"] - m0) / 20
    # one REPLAY and the previous loss's DROP per step (plus the READ): whatever the model's op count
    assert per_step["mlp-adamw"] <= 3 and per_step["gpt"] <= 3, per_step


def test_a_step_that_reads_a_value_runs_eagerly_with_one_warning(peer: ember.Device) -> None:
    torch.manual_seed(0)
    lin = nn.Linear(4, 2).to("ember")
    o = torch.optim.SGD(lin.parameters(), lr=0.1)

    def step(x: Any) -> float:
        o.zero_grad()
        loss = lin(x).square().mean()
        loss.backward()
        o.step()
        return loss.item()  # a read inside the step: the capture cannot hold it
    run = ember.torch.capture(step)
    x = torch.ones(3, 4).to("ember")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [run(x) for _ in range(8)]
    said = [w for w in caught if issubclass(w.category, C.CaptureWarning)]
    assert len(said) == 1 and "reads a value" in str(said[0].message)
    torch.manual_seed(0)
    lin2 = nn.Linear(4, 2).to("ember")
    o = torch.optim.SGD(lin2.parameters(), lr=0.1)
    lin = lin2
    assert got == [step(x) for _ in range(8)]  # what eager computes


def test_a_non_capturable_adam_is_refused_with_a_hint(peer: ember.Device) -> None:
    torch.manual_seed(0)
    lin = nn.Linear(4, 2).to("ember")
    o = torch.optim.Adam(lin.parameters(), lr=0.1)  # its step count lives on the host: new scalars each step

    @ember.torch.capture
    def step(x: Any) -> Any:
        o.zero_grad()
        loss = lin(x).square().mean()
        loss.backward()
        o.step()
        return loss
    x = torch.ones(3, 4).to("ember")
    with pytest.warns(C.CaptureWarning, match="capturable=True"):
        for _ in range(8):
            step(x)
    assert step.why is not None


@pytest.mark.parametrize("kind", ["sequential", "linear"])
def test_a_compiled_model_inside_a_captured_step_is_recorded_into_its_graph(kind: str) -> None:
    """torch.compile's graphs (forward here, backward on autograd's device thread) re-record their ops
    while a capture records, so the captured graph holds all of them: bit-equal to eager. (A compiled
    ``nn.Linear``: the capture's module hook asked ``bool()`` of it, which its ``len`` refuses, then Dynamo
    traced the hook.)"""
    def run(captured: bool) -> tuple[list[float], list[Any]]:
        torch.manual_seed(0)
        model = (W.MLP(16, 32, 4) if kind == "sequential" else torch.nn.Linear(16, 4)).to("ember")
        fwd = torch.compile(model, backend="ember")
        o = torch.optim.AdamW(model.parameters(), lr=1e-2, capturable=True)

        step = _training_step(fwd, o)
        run_step = ember.torch.capture(step) if captured else step
        g = torch.Generator().manual_seed(0)
        losses = []
        for _ in range(12):
            x, y = W.classification_batch(g, 32, (16,), 4)
            losses.append(run_step(x.to("ember"), y.to("ember")).item())
        return losses, [p.detach().cpu() for p in model.parameters()]
    with ember.connect("local:torch"):
        eager = run(False)
        before = dict(C.stats)
        captured = run(True)
    same(eager, captured)
    assert C.stats["replays"] >= before["replays"] + 8


def test_state_a_step_rebinds_is_read_then_rewritten_in_place(peer: ember.Device) -> None:
    """An attribute rebound every step (a running average of the loss) is the previous call's leftover:
    the replay reads it and rewrites it under the id the client holds, so the Python object sees it."""
    def run(captured: bool) -> tuple[list[float], float]:
        torch.manual_seed(0)
        lin = nn.Linear(4, 2).to("ember")
        o = torch.optim.SGD(lin.parameters(), lr=0.1)
        keep = {"avg": torch.zeros(()).to("ember")}

        def step(x: Any) -> Any:
            o.zero_grad(set_to_none=True)
            loss = (lin(x) - 1).square().mean()
            loss.backward()
            o.step()
            keep["avg"] = keep["avg"] * 0.9 + loss.detach() * 0.1  # rebound: a new tensor every step
            return loss
        run_step = ember.torch.capture(step) if captured else step
        x = torch.arange(12.0).reshape(3, 4).to("ember") / 10
        losses = [run_step(x).item() for _ in range(12)]
        return losses, keep["avg"].item()
    eager = run(False)
    before = dict(C.stats)
    assert run(True) == eager
    assert C.stats["replays"] >= before["replays"] + 8


def test_zero_grad_outside_the_step_runs_eagerly_and_says_why(peer: ember.Device) -> None:
    torch.manual_seed(0)
    lin = nn.Linear(4, 2).to("ember")
    o = torch.optim.SGD(lin.parameters(), lr=0.1)

    @ember.torch.capture
    def step(x: Any) -> Any:
        loss = lin(x).square().mean()
        loss.backward()  # new .grad tensors every call, freed by zero_grad outside: nothing to rewrite
        o.step()
        return loss
    x = torch.ones(3, 4).to("ember")
    with pytest.warns(C.CaptureWarning, match="zero_grad"):
        losses = []
        for _ in range(8):
            o.zero_grad(set_to_none=True)
            losses.append(step(x).item())
    assert losses[0] > losses[-1] and step.why is not None


def test_a_schedule_on_a_tensor_learning_rate_replays_without_recording_again(peer: ember.Device) -> None:
    """lr as an ember tensor: the scheduler writes it in place between steps, the graph reads it (a graph
    input, not a scalar): a cosine schedule changes it every step and the step is captured once."""
    def run(captured: bool) -> tuple[list[float], list[Any]]:
        torch.manual_seed(0)
        model = W.MLP(16, 32, 4).to("ember")
        o = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-2, device="ember"), capturable=True)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=30)

        step = _training_step(model, o)
        run_step = ember.torch.capture(step) if captured else step
        g = torch.Generator().manual_seed(0)
        losses = []
        for _ in range(30):
            x, y = W.classification_batch(g, 32, (16,), 4)
            losses.append(run_step(x.to("ember"), y.to("ember")).item())
            sched.step()
        return losses, [p.detach().cpu() for p in model.parameters()]
    eager = run(False)
    before = dict(C.stats)
    same(eager, run(True))
    assert C.stats["captures"] == before["captures"] + 1 and C.stats["replays"] >= before["replays"] + 26


def test_a_step_that_returns_a_gradient_it_keeps_runs_eagerly(peer: ember.Device) -> None:
    torch.manual_seed(0)
    lin = nn.Linear(4, 2).to("ember")
    o = torch.optim.SGD(lin.parameters(), lr=0.1)

    @ember.torch.capture
    def step(x: Any) -> Any:
        o.zero_grad(set_to_none=True)
        lin(x).square().mean().backward()
        o.step()
        return lin.weight.grad  # also held by the parameter: a replay could not give both a new value
    x = torch.ones(3, 4).to("ember")
    with pytest.warns(C.CaptureWarning, match="also keeps"):
        grads = [step(x).cpu() for _ in range(6)]
    assert step.why is not None and not torch.equal(grads[0], grads[-1])


def test_a_captured_decode_step_with_a_static_cache_is_one_replay_and_one_read_per_token(peer: ember.Device) -> None:
    """HF GPT-2 with a StaticCache (written in place at a cache_position tensor): the decode step has
    fixed layouts, so it is captured; greedy tokens equal local CPU generate()'s."""
    tf = pytest.importorskip("transformers")
    tf.utils.logging.set_verbosity_error()
    cfg = tf.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=60, n_positions=48, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    ref = tf.GPT2LMHeadModel(cfg).eval()
    prompt = torch.randint(0, 60, (1, 6))
    want = ref.generate(prompt, max_new_tokens=16, do_sample=False, pad_token_id=0, cache_implementation="static")
    model = tf.GPT2LMHeadModel(cfg).eval()
    model.load_state_dict(ref.state_dict())
    model = model.to("ember")
    cache = tf.StaticCache(config=cfg, max_cache_len=32)

    @ember.torch.capture
    def decode(tok: Any, pos: Any) -> Any:
        return model(input_ids=tok, cache=cache, cache_position=pos, use_cache=True).logits[:, -1:].argmax(-1)
    s = peer.session
    with torch.no_grad():
        logits = model(input_ids=prompt.to("ember"), cache=cache, cache_position=torch.arange(6).to("ember"),
                       use_cache=True).logits
        tok = logits[:, -1:].argmax(-1)
        toks = [tok.cpu()]
        before, reads = dict(C.stats), s.stats["reads"]
        for i in range(15):
            if i == 3:
                m0 = s.stats["ops"]
            tok = decode(tok, torch.tensor([6 + i]).to("ember"))
            toks.append(tok.cpu())  # the one read per token
    assert torch.equal(torch.cat([prompt, *toks], 1), want)
    assert C.stats["replays"] >= before["replays"] + 12 and s.stats["reads"] == reads + 15
    assert (s.stats["ops"] - m0) / 12 <= 5  # upload of the position, REPLAY, READ, DROPs


def test_an_eager_lstm_step_longer_than_a_batch_is_held_whole_and_replayed(tcp_peer: str) -> None:
    """Without capture: the op-graph cache holds a step of ~1000 ops (groups up to 4096) and, when the
    step takes longer to record than the hold, learns a longer hold: the step replays. (oneDNN off: the
    LSTM takes CPU's per-step cells, ~20 ops a time step, not two ops per layer. The
    optimizer's own replay is off here: its REPLAY would end the group before the step's end, see _optstep.)"""
    ember.torch.capture_optimizer_steps(False)
    with ember.connect(tcp_peer) as dev, torch.backends.mkldnn.flags(enabled=False), \
            _finally(lambda: ember.torch.capture_optimizer_steps(True)):
        s = dev.session
        torch.manual_seed(0)
        model = LSTMLM().to("ember")
        o = torch.optim.SGD(model.parameters(), lr=0.5)
        g = torch.Generator().manual_seed(0)
        state = tuple(torch.zeros(2, 4, 12).to("ember") for _ in range(2))
        for k in range(14):
            if k == 4:
                r0, ops0 = s.stats["replays"], s.stats["replayed_ops"]
            x, y = (t.to("ember") for t in W.lm_batch(30, 4, 40)(g))  # (uploads: the group's boundaries)
            o.zero_grad(set_to_none=True)
            out, _ = model(x, state)
            loss = _lm_loss(out, y)
            loss.backward()
            o.step()
            if k % 5 == 4:
                loss.item()
        n = s.stats["replays"] - r0
        assert n >= 6 and (s.stats["replayed_ops"] - ops0) / n > 512, (n, s.stats)


@contextlib.contextmanager
def _finally(undo: Callable[[], Any]) -> Iterator[None]:
    try:
        yield
    finally:
        undo()


def test_autocast_on_or_off_is_a_different_program() -> None:
    torch.manual_seed(0)
    with ember.connect("local:torch"):
        lin = nn.Linear(8, 8).to("ember")
        run = ember.torch.capture(lambda x: lin(x).float().sum())
        x = torch.randn(4, 8).to("ember")
        with torch.no_grad():
            plain = [run(x).item() for _ in range(4)]
            with torch.autocast("ember", dtype=torch.bfloat16):
                low = [run(x).item() for _ in range(4)]
                want_low = lin(x).float().sum().item()
            want = lin(x).float().sum().item()
    assert plain == [want] * 4 and low == [want_low] * 4 and want != want_low


def test_a_float_learning_rate_changed_every_step_says_to_use_a_tensor() -> None:
    torch.manual_seed(0)
    with ember.connect("local:torch"):
        lin = nn.Linear(4, 2).to("ember")
        o = torch.optim.SGD(lin.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.9)

        @ember.torch.capture
        def step(x: Any) -> Any:
            o.zero_grad(set_to_none=True)
            loss = lin(x).square().mean()
            loss.backward()
            o.step()
            return loss
        x = torch.ones(3, 4).to("ember")
        with pytest.warns(C.CaptureWarning, match="lr=torch.tensor"):
            for _ in range(6):
                step(x)
                sched.step()


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.d, self.o = torch.nn.Dropout(0.0), torch.nn.Linear(8, 2)

    def forward(self, x: Any) -> Any:
        return self.o(self.d(torch.relu(self.b(torch.relu(self.a(x))))))


def _changed_between_steps(device: str, captured: bool, change: Callable[[Any], None]) -> list[Any]:
    torch.manual_seed(0)
    m = _Net().to(device)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)

    step = _training_step(m, opt)
    run = ember.torch.capture(step) if captured else step
    g = torch.Generator().manual_seed(1)
    losses = []
    for k in range(8):
        if k == 4:
            change(m)
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 2, (16,), generator=g)
        torch.manual_seed(100 + k)
        losses.append(run(x.to(device), y.to(device)).cpu())
    return losses + [p.detach().cpu() for p in m.parameters()]


def _add_hook(m: Any) -> None:
    m.b.register_forward_hook(lambda mod, args, out: out * 0.5)


@pytest.mark.parametrize("change", [lambda m: m.a.requires_grad_(False), lambda m: setattr(m.d, "p", 0.5),
                                    _add_hook, lambda m: setattr(m.b, "weight", m.a.weight)],
                         ids=["freeze", "dropout-p", "hook", "re-tie"])
def test_a_captured_step_records_again_when_a_module_changes(change: Callable[[Any], None]) -> None:
    """A replay runs the program recorded before: a layer frozen since (``requires_grad_(False)``), a dropout's
    new ``p``, a new hook or a parameter re-tied would be ignored (the frozen layer kept training). Each module's
    plain attributes, parameter objects and their ``requires_grad``, buffers and hooks are guarded: the step records
    again, bit-equal to eager and to local CPU."""
    with ember.connect("local:torch"):
        before = dict(ember.torch.capture_stats)
        want, eager, got = (_changed_between_steps(d, c, change) for d, c in (("cpu", False), ("ember", False),
                                                                              ("ember", True)))
        assert ember.torch.capture_stats["replays"] > before["replays"]  # (it did replay before the change)
    for a, b, c in zip(want, eager, got):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_a_step_that_checks_a_known_mask_is_captured_and_a_written_input_is_forgotten() -> None:
    """A Hugging Face step checks its attention mask (``mask.to(torch.bool)``, ``sum() == numel()``): values the
    client knows, so the step is captured; a replay forgets only the inputs its ops may write (the mask stays
    known for the next recording), and an input it writes (a step counter) is read from the peer afterwards."""
    torch.manual_seed(0)
    with ember.connect("local:torch") as dev:
        lin = nn.Linear(4, 2).to("ember")
        o = torch.optim.SGD(lin.parameters(), lr=0.1)
        count = torch.zeros((), dtype=torch.long).to("ember")

        def step(x: Any, mask: Any, count: Any) -> Any:
            m = mask.to(torch.bool)
            full = bool(m.sum() == m.numel())  # (transformers' fast_all: known, no round trip)
            loss = (lin(x) * (1.0 if full else 0.5)).pow(2).sum()
            loss.backward()
            o.step()
            o.zero_grad(set_to_none=True)
            count.add_(1)
            return loss
        run = ember.torch.capture(step)
        x = torch.randn(3, 4).to("ember")
        mask = torch.tensor([[1, 1, 0]]).to("ember")
        before = dict(C.stats)
        for _ in range(5):
            run(x, mask, count)
        assert C.stats["replays"] >= before["replays"] + 2 and C.stats["eager"] == before["eager"]
        reads = dev.session.stats["reads"]
        assert int(count) == 5 and dev.session.stats["reads"] == reads + 1  # (written by the replays: asked)
        assert bool(mask.to(torch.bool).any()) and dev.session.stats["reads"] == reads + 1  # (read only: known)
