"""Optimizer steps on ember devices replayed against their recording (ember/torch/_optstep.py), with no
change to user code — bit-equal to eager steps (parameters and optimizer state, the host-side step counts
included) over 100 steps, on the embedded peer and over TCP to ``ember serve``."""

from __future__ import annotations

import os
import subprocess
import warnings
from typing import Any, Callable, Iterator

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import ember  # noqa: E402
import ember.torch  # noqa: E402,F401
from ember.torch import _capture as C  # noqa: E402
from ember.torch import _optstep as O  # noqa: E402
from ember.torch import workloads as W  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(autouse=True)
def switched_on() -> Iterator[None]:
    ember.torch.capture_optimizer_steps(True)
    yield
    ember.torch.capture_optimizer_steps(True)


def _mlp() -> Any:
    return W.MLP(16, 32, 4)


def _lambda_lr(o: Any) -> Any:
    return torch.optim.lr_scheduler.LambdaLR(o, lambda k: 1.0 / (1 + 0.05 * k))  # a new lr every step


#: name -> (model, optimizer, scheduler or None)
CASES: dict[str, tuple[Callable[[], Any], Callable[[Any], Any], Callable[[Any], Any] | None]] = {
    "mlp-adamw": (lambda: W.MLP(16, 32, 4), lambda ps: torch.optim.AdamW(ps, lr=1e-2), None),
    "mlp-sgd-momentum": (lambda: W.MLP(16, 32, 4), lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9), None),
    "mlp-adam-schedule": (lambda: W.MLP(16, 32, 4), lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=1e-3),
                          _lambda_lr),
}


def train(case: str, replayed: bool, steps: int = 100, model: Any = None, opt: Any = None,
          frozen_at: Callable[[int], bool] | None = None) -> tuple[list[Any], list[Any]]:
    """The usual loop, unchanged: (parameters and optimizer state on the CPU, losses every 10 steps)."""
    make, make_opt, sched = CASES[case] if case in CASES else (model, opt, None)
    ember.torch.capture_optimizer_steps(replayed)
    torch.manual_seed(0)
    m = make().to("ember")
    o = make_opt(m.parameters())
    s = sched(o) if sched is not None else None
    g = torch.Generator().manual_seed(1)
    losses = []
    lm = isinstance(m, W.TinyLM)
    for k in range(steps):
        x, y = (W.lm_batch(40, 4, 16) if lm else lambda gen: W.classification_batch(gen, 32, (16,), 4))(g)
        o.zero_grad(set_to_none=True)
        out = m(x.to("ember"))
        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.to("ember").reshape(-1))
        loss.backward()
        if frozen_at is not None and frozen_at(k):
            m[0].weight.grad = None  # this step leaves the first layer alone
        o.step()
        if s is not None:
            s.step()
        if k % 10 == 9:
            losses.append(loss.item())
    state = [v.cpu() if isinstance(v, torch.Tensor) else v for st in o.state.values() for v in st.values()]
    return [p.detach().cpu() for p in m.parameters()] + state, losses


def same(a: tuple[list[Any], list[Any]], b: tuple[list[Any], list[Any]]) -> None:
    assert a[1] == b[1], f"losses differ: {a[1]} vs {b[1]}"
    assert len(a[0]) == len(b[0])
    for p, q in zip(a[0], b[0]):
        if isinstance(p, torch.Tensor):
            assert p.dtype == q.dtype and p.device == q.device and torch.equal(p, q), f"{p} differs from {q}"
        else:
            assert p == q


@pytest.mark.parametrize("case", sorted(CASES))
def test_replayed_optimizer_steps_are_bit_equal_to_eager_over_100_steps(peer: ember.Device, case: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", C.CaptureWarning)
        eager = train(case, False)
        before = dict(O.stats)
        replayed = train(case, True)
    same(eager, replayed)
    assert O.stats["replays"] >= before["replays"] + 97  # recorded on steps 1 (state made) and 2 only
    assert O.stats["diverged"] == before["diverged"]


def test_a_replayed_step_joins_the_training_step_s_op_group(peer: ember.Device) -> None:
    """After an eager forward and backward, the replayed step's ops go into the session's op group rather than
    out as a REPLAY of their own: the whole training step (forward, loss, backward, AdamW) is one REPLAY, with
    the same ops replayed as when the optimizer is dispatched op by op; and the result is eager's."""
    def run(replayed: bool) -> tuple[float, float, list[Any]]:
        ember.torch.capture_optimizer_steps(replayed)
        s = peer.session
        torch.manual_seed(0)
        m = _mlp().to("ember")
        o = torch.optim.AdamW(m.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(1)
        for k in range(40):
            if k == 10:
                r0, n0, o0 = s.stats["replays"], s.stats["replayed_ops"], O.stats["replays"]
            x, y = W.classification_batch(g, 32, (16,), 4)
            o.zero_grad(set_to_none=True)
            F.cross_entropy(m(x.to("ember")), y.to("ember")).backward()
            o.step()
        assert (O.stats["replays"] - o0 == 30) is replayed
        return (s.stats["replays"] - r0) / 30, (s.stats["replayed_ops"] - n0) / 30, \
            [p.detach().cpu() for p in m.parameters()]
    s = peer.session
    held = s.graph_hold, s.graph_hold_max, s._hold_s
    s.graph_hold = s.graph_hold_max = s._hold_s = 2.0  # (a loaded box may take more than 20 ms to record a step:
    try:                                                #  the group, given up, would go op by op that step)
        replayed, dispatched = run(True), run(False)
    finally:
        s.graph_hold, s.graph_hold_max, s._hold_s = held
    assert replayed[0] == 1 and replayed[:2] == dispatched[:2], (replayed[:2], dispatched[:2])
    assert all(torch.equal(p, q) for p, q in zip(replayed[2], dispatched[2]))


@pytest.mark.parametrize("variant", [{"fused": True}, {"foreach": False}, {"capturable": True}, {"amsgrad": True}])
def test_fused_for_loop_and_capturable_variants_replay_bit_equal(variant: dict[str, bool]) -> None:
    with ember.connect("local:torch"):
        make_opt = lambda ps: torch.optim.AdamW(ps, lr=1e-2, **variant)  # noqa: E731
        eager = train("", False, 30, _mlp, make_opt)
        before = dict(O.stats)
        replayed = train("", True, 30, _mlp, make_opt)
    same(eager, replayed)
    assert O.stats["replays"] >= before["replays"] + 27


def test_a_gpt_with_adamw_replays_its_step_bit_equal() -> None:
    def make() -> Any:
        return W.TinyLM(vocab=40, d=32, heads=4, layers=2, ctx=16)
    with ember.connect("local:torch"):
        eager = train("", False, 100, make, lambda ps: torch.optim.AdamW(ps, lr=3e-3))
        before = dict(O.stats)
        replayed = train("", True, 100, make, lambda ps: torch.optim.AdamW(ps, lr=3e-3))
    same(eager, replayed)
    assert O.stats["replays"] >= before["replays"] + 97


def test_grads_that_are_none_on_some_steps_bind_the_grads_there_are(peer: ember.Device) -> None:
    frozen = lambda k: k % 3 == 1  # noqa: E731 (two programs: every param stepped, and all but one)
    make_opt = lambda ps: torch.optim.AdamW(ps, lr=1e-2)  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("error", C.CaptureWarning)
        eager = train("", False, 60, _mlp, make_opt, frozen)
        before = dict(O.stats)
        replayed = train("", True, 60, _mlp, make_opt, frozen)
    same(eager, replayed)
    assert O.stats["replays"] >= before["replays"] + 50


def test_step_hooks_run_around_replayed_steps_and_a_closure_runs_eagerly() -> None:
    with ember.connect("local:torch"):
        torch.manual_seed(0)
        m = W.MLP().to("ember")
        o = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        seen: list[str] = []
        o.register_step_pre_hook(lambda opt, a, k: seen.append("pre") and None)
        o.register_step_post_hook(lambda opt, a, k: seen.append("post") and None)
        x, y = torch.randn(8, 8).to("ember"), torch.randint(0, 4, (8,)).to("ember")

        def closure() -> Any:
            o.zero_grad()
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            return loss
        for _ in range(6):
            closure()
            o.step()
        assert seen == ["pre", "post"] * 6
        r0 = O.stats["replays"]
        assert O.stats["replays"] >= 3
        loss = o.step(closure)  # the closure's forward and backward: eager
        assert O.stats["replays"] == r0 and loss.item() > 0 and seen[-2:] == ["pre", "post"]


def test_switched_off_for_all_or_for_one_optimizer_nothing_replays() -> None:
    with ember.connect("local:torch"):
        for off in ("all", "one"):
            torch.manual_seed(0)
            m = W.MLP().to("ember")
            o = torch.optim.AdamW(m.parameters(), lr=1e-2)
            ember.torch.capture_optimizer_steps(off != "all")
            if off == "one":
                ember.torch.capture_optimizer_steps(False, optimizer=o)
            r0 = O.stats["replays"]
            for _ in range(5):
                F.cross_entropy(m(torch.randn(8, 8).to("ember")), torch.randint(0, 4, (8,)).to("ember")).backward()
                o.step()
            assert O.stats["replays"] == r0


def test_the_environment_variable_switches_it_off() -> None:
    code = ("import ember.torch, ember.torch._optstep as O; import sys; sys.exit(0 if O._enabled[0] is False else 1)")
    env = {**os.environ, "EMBER_CAPTURE_OPTIMIZER": "0", "EMBER_OFFLINE": "1"}
    assert subprocess.run([os.sys.executable, "-c", code], env=env, timeout=120).returncode == 0


class _Reads(torch.optim.SGD):
    """An optimizer whose step reads a value from the peer: never replayable."""

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        norm = sum(float(p.grad.norm()) for g in self.param_groups for p in g["params"] if p.grad is not None)
        assert norm >= 0
        return super().step(closure)


def test_a_step_that_reads_a_value_runs_eagerly_for_good_with_one_warning() -> None:
    with ember.connect("local:torch"):
        torch.manual_seed(0)
        m = W.MLP().to("ember")
        o = _Reads(m.parameters(), lr=0.1)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            for _ in range(O.TRIES + 4):
                F.cross_entropy(m(torch.randn(8, 8).to("ember")), torch.randint(0, 4, (8,)).to("ember")).backward()
                o.step()
        said = [str(x.message) for x in w if issubclass(x.category, C.CaptureWarning)]
        assert len(said) == 1 and "_Reads.step() runs eagerly from now on" in said[0] and "reads a value" in said[0]


def test_a_step_inside_a_capture_is_held_by_the_capture_not_replayed_twice() -> None:
    with ember.connect("local:torch"):
        torch.manual_seed(0)
        m = W.MLP().to("ember")
        o = torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)

        @ember.torch.capture
        def step(x: Any, y: Any) -> Any:
            o.zero_grad(set_to_none=True)
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            o.step()
            return loss
        r0, c0 = O.stats["replays"], C.stats["replays"]
        for _ in range(8):
            step(torch.randn(8, 8).to("ember"), torch.randint(0, 4, (8,)).to("ember")).item()
        assert O.stats["replays"] == r0 and C.stats["replays"] >= c0 + 4


@pytest.mark.parametrize("fused", [False, True])
def test_a_grad_scaler_step_replays_bit_equal(fused: bool) -> None:
    """GradScaler reads found_inf outside the step (plain AdamW) or hands grad_scale and found_inf to a
    fused step as ember tensors (graph inputs)."""
    def run(replayed: bool) -> tuple[list[Any], float]:
        ember.torch.capture_optimizer_steps(replayed)
        torch.manual_seed(0)
        m = _mlp().to("ember")
        o = torch.optim.AdamW(m.parameters(), lr=1e-2, fused=fused)
        scaler = torch.amp.GradScaler("ember", init_scale=2.0 ** 14)
        g = torch.Generator().manual_seed(0)
        for _ in range(30):
            x, y = W.classification_batch(g, 32, (16,), 4)
            o.zero_grad(set_to_none=True)
            with torch.autocast("ember", dtype=torch.float16):
                loss = F.cross_entropy(m(x.to("ember")), y.to("ember"))
            scaler.scale(loss).backward()
            scaler.step(o)
            scaler.update()
        state = [v.cpu() for st in o.state.values() for v in st.values()]
        return [p.detach().cpu() for p in m.parameters()] + state, scaler.get_scale()
    with ember.connect("local:torch"):
        eager = run(False)
        before = dict(O.stats)
        replayed = run(True)
    assert eager[1] == replayed[1]
    same((eager[0], []), (replayed[0], []))
    assert O.stats["replays"] >= before["replays"] + 27


class _Flips(torch.optim.Optimizer):
    """A step that makes temporaries, then takes one of two paths: a replay that meets the other path has
    handed placeholders to the step's Python, which must become real tensors with the right values."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.1})
        self.flip = False

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        for g in self.param_groups:
            ps = [p for p in g["params"] if p.grad is not None]
            tmp = torch._foreach_mul([p.grad for p in ps], 2.0)
            torch._foreach_add_(tmp, 1.0)
            if self.flip:
                torch._foreach_mul_(tmp, 0.5)
            torch._foreach_add_(ps, tmp, alpha=-g["lr"])
        return None


def test_a_step_that_leaves_its_recording_midway_finishes_eagerly_bit_equal() -> None:
    def run(replayed: bool) -> list[Any]:
        ember.torch.capture_optimizer_steps(replayed)
        torch.manual_seed(0)
        m = _mlp().to("ember")
        o = _Flips(m.parameters())
        g = torch.Generator().manual_seed(0)
        for k in range(12):
            o.flip = k in (5, 9, 10)
            x, y = W.classification_batch(g, 32, (16,), 4)
            o.zero_grad(set_to_none=True)
            F.cross_entropy(m(x.to("ember")), y.to("ember")).backward()
            o.step()
        return [p.detach().cpu() for p in m.parameters()]
    with ember.connect("local:torch"):
        eager = run(False)
        before = dict(O.stats)
        replayed = run(True)
    for p, q in zip(eager, replayed):
        assert torch.equal(p, q)
    assert O.stats["diverged"] >= before["diverged"] + 2 and O.stats["replays"] >= before["replays"] + 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.NAdam(ps), lambda ps: torch.optim.NAdam(ps, decoupled_weight_decay=True, weight_decay=0.1),
    lambda ps: torch.optim.RAdam(ps), lambda ps: torch.optim.ASGD(ps), lambda ps: torch.optim.AdamW(ps),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True), lambda ps: torch.optim.RMSprop(ps),
    lambda ps: torch.optim.Adagrad(ps), lambda ps: torch.optim.Adamax(ps)],
    ids=["nadam", "nadam-decoupled", "radam", "asgd", "adamw", "sgd-nesterov", "rmsprop", "adagrad", "adamax"])
def test_optimizers_left_at_their_defaults_step_as_on_cpu(make: Callable[[Any], Any], dtype: Any) -> None:
    """torch takes the multi-tensor path on any accelerator, the single-tensor one on the CPU; NAdam, RAdam and
    ASGD round otherwise in the two, and in half precision most optimizers do (found by sweeps of Hugging Face
    models trained with them): on a CPU peer they take CPU's path there, bit-equal, NaNs included."""
    def run(device: str) -> list[Any]:
        torch.manual_seed(0)
        ps = [torch.randn(16, 9).to(dtype).to(device).requires_grad_(), torch.randn(7).to(dtype).to(device)
              .requires_grad_()]
        opt, g = make(ps), torch.Generator().manual_seed(1)
        for _ in range(4):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g).to(dtype).to(device)
            opt.step()
        return [p.detach().cpu() for p in ps]
    with ember.connect("local:torch"):
        want, got = run("cpu"), run("ember")
    assert all(torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
               for a, b in zip(want, got))


@pytest.mark.parametrize("make", [
    lambda ps, d: torch.optim.Adam(ps, lr=torch.tensor(0.01).to(d), fused=True),
    lambda ps, d: torch.optim.AdamW(ps, lr=torch.tensor(0.01).to(d), fused=True),
    lambda ps, d: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True),
    lambda ps, d: torch.optim.SGD(ps, lr=torch.tensor(0.1).to(d), momentum=0.9, fused=True),
    lambda ps, d: torch.optim.Adagrad(ps, lr=0.1, fused=True)],
    ids=["adam-tensor-lr", "adamw-tensor-lr", "sgd", "sgd-tensor-lr", "adagrad"])
def test_fused_steps_torch_has_no_meta_kernel_for_run_as_on_cpu(make: Callable[[Any, str], Any]) -> None:
    """Fused Adam/AdamW with a tensor learning rate, fused SGD and fused Adagrad have no meta kernel: the client took
    them for data-dependent ops and the peer failed reading back a result they do not have. They write their operands
    and return nothing; each trains bit-equal to CPU."""
    def run(device: str) -> Any:
        torch.manual_seed(0)
        m = torch.nn.Linear(4, 2).to(device)
        opt = make(m.parameters(), device)
        for _ in range(3):
            opt.zero_grad()
            m(torch.ones(3, 4).to(device)).sum().backward()
            opt.step()
        return m.weight.detach().cpu()
    with ember.connect("local:torch"):
        assert torch.equal(run("cpu"), run("ember"))
