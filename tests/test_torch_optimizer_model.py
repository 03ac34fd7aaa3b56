"""Adam, AdamW and SGD steps replayed by a trusted host model, without running the optimizer's Python
(ember/torch/_optfast.py): bit-equal to local CPU torch, and back to guided replays whenever the
Python could take another path."""

from __future__ import annotations

from typing import Any, Callable

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import ember  # noqa: E402
import ember.torch  # noqa: E402,F401
from ember.torch import _optfast  # noqa: E402
from ember.torch import _optstep as O  # noqa: E402
from ember.torch import workloads as W  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def _groups(m: Any) -> list[dict[str, Any]]:
    """Two groups as nanoGPT and the HF Trainer make them: weights decayed, biases not."""
    ps = list(m.parameters())
    return [{"params": [p for p in ps if p.dim() >= 2]}, {"params": [p for p in ps if p.dim() < 2],
                                                           "weight_decay": 0.0}]


def train(device: str, make_opt: Callable[[Any], Any], steps: int,
          change: Callable[[int, Any, Any], None] | None = None) -> tuple[list[Any], list[float], list[int]]:
    """(parameters and state on the CPU, every loss, the steps the host model replayed)."""
    torch.manual_seed(0)
    m = W.MLP(16, 32, 4).to(device)
    o = make_opt(_groups(m))
    sched = torch.optim.lr_scheduler.LambdaLR(o, lambda k: 1.0 / (1 + 0.05 * k))  # a new lr every step
    g = torch.Generator().manual_seed(1)
    losses, modelled = [], []
    for k in range(steps):
        x, y = W.classification_batch(g, 32, (16,), 4)
        o.zero_grad(set_to_none=True)
        loss = F.cross_entropy(m(x.to(device)), y.to(device))
        loss.backward()
        if change is not None:
            change(k, m, o)
        before = O.stats["modelled"]
        o.step()
        sched.step()
        if O.stats["modelled"] > before:
            modelled.append(k)
        losses.append(loss.item())
    state = [v.cpu() if isinstance(v, torch.Tensor) else v for st in o.state.values() for v in st.values()]
    return [p.detach().cpu() for p in m.parameters()] + state, losses, modelled


def same(a: list[Any], b: list[Any]) -> None:
    assert len(a) == len(b)
    for p, q in zip(a, b):
        assert p.dtype == q.dtype and p.shape == q.shape and torch.equal(p, q), f"{p} differs from {q}"


@pytest.mark.parametrize("path", ["foreach", "fused"])
@pytest.mark.parametrize("cls", ["Adam", "AdamW"])
def test_modelled_steps_are_bit_equal_to_local_cpu(peer: ember.Device, cls: str, path: str) -> None:
    def make_opt(groups: Any) -> Any:
        return getattr(torch.optim, cls)(groups, lr=1e-2, weight_decay=0.05,
                                          **({"fused": True} if path == "fused" else {}))
    cpu = train("cpu", make_opt, 100)
    remote = train("ember", make_opt, 100)
    assert remote[1] == cpu[1]
    same(remote[0], cpu[0])
    # guided on steps 1 and 2 (state made, then recorded), trusted after AGREE guided replays that agreed
    assert remote[2] == list(range(2 + _optfast.AGREE, 100)), remote[2]


def _changes(k: int, m: Any, o: Any) -> None:
    """What a training script may do between steps; each makes the next step's Python differ, or binds other
    tensors (done the same way on both devices)."""
    p0 = m[0].weight
    if k == 20:
        o.param_groups[0]["betas"] = (0.8, 0.99)
    elif k == 30:
        o.state[p0]["exp_avg"] = torch.zeros_like(p0)  # a new storage, same layout
    elif k == 40:
        o.load_state_dict(o.state_dict())  # every state tensor anew
    elif k == 50:
        o.param_groups[0]["weight_decay"] = 0.0  # a call fewer
    elif k == 60:
        with torch.no_grad():
            p0.data = p0.data.t().contiguous().t()  # another layout (strides) for one parameter
    elif k == 70:
        p0.grad = p0.grad.contiguous()  # (autograd made it in the parameter's column-major layout)


def test_changes_between_steps_fall_back_to_guided_replays_bit_equal(peer: ember.Device) -> None:
    def make_opt(groups: Any) -> Any:
        return torch.optim.AdamW(groups, lr=1e-2)
    cpu = train("cpu", make_opt, 90, _changes)
    remote = train("ember", make_opt, 90, _changes)
    assert remote[1] == cpu[1]
    same(remote[0], cpu[0])
    modelled = set(remote[2])
    # betas, weight decay and the layouts change the step: guided there; a new moment buffer or a reloaded
    # state binds the new storages and stays modelled
    assert {20, 50, 60, 70}.isdisjoint(modelled), sorted(modelled)
    assert {30, 31, 40, 41} <= modelled, sorted(modelled)
    assert len(modelled) >= 60, sorted(modelled)


@pytest.mark.parametrize("kw", [{}, {"momentum": 0.9}, {"momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
                                {"momentum": 0.9, "dampening": 0.1}])
def test_modelled_sgd_steps_are_bit_equal_to_local_cpu(peer: ember.Device, kw: dict[str, Any]) -> None:
    def make_opt(groups: Any) -> Any:
        return torch.optim.SGD(groups, lr=0.05, **kw)
    cpu = train("cpu", make_opt, 60)
    remote = train("ember", make_opt, 60)
    assert remote[1] == cpu[1]
    same(remote[0], cpu[0])
    first = 1 if not kw else 2  # (with momentum, the first step makes the buffers)
    assert remote[2] == list(range(first + _optfast.AGREE, 60)), remote[2]


@pytest.mark.parametrize("variant", [{"amsgrad": True}, {"maximize": True}, {"foreach": False}, {"fused": False},
                                     {"subclass": True}])
def test_steps_the_model_does_not_know_replay_guided_bit_equal(variant: dict[str, bool]) -> None:
    class MyAdamW(torch.optim.AdamW):
        pass

    def make_opt(groups: Any) -> Any:
        kw = dict(variant)
        cls = MyAdamW if kw.pop("subclass", False) else torch.optim.AdamW
        return cls(groups, lr=1e-2, **kw)
    with ember.connect("local:torch"):
        cpu = train("cpu", make_opt, 30)
        replays = O.stats["replays"]
        remote = train("ember", make_opt, 30)
    assert remote[1] == cpu[1]
    same(remote[0], cpu[0])
    assert remote[2] == []
    assert O.stats["replays"] >= replays + 27  # (guided: as before the model)


def test_a_grad_scale_on_the_optimizer_is_not_modelled() -> None:
    """torch's foreach Adam refuses ``grad_scale``: a modelled step must not step past that refusal."""
    with ember.connect("local:torch"):
        torch.manual_seed(0)
        m = W.MLP(16, 32, 4).to("ember")
        o = torch.optim.Adam(m.parameters(), lr=1e-2)
        for k in range(8):
            F.cross_entropy(m(torch.randn(8, 16).to("ember")), torch.zeros(8, dtype=torch.long).to("ember")).backward()
            if k == 7:
                o.grad_scale = torch.ones((), device="ember")
                with pytest.raises(AssertionError, match="grad_scale"):
                    o.step()
            else:
                o.step()


def test_switched_off_every_step_runs_the_python() -> None:
    """``EMBER_OPTIMIZER_MODEL=0`` sets this switch: guided replays only."""
    _optfast.ON[0] = False
    try:
        with ember.connect("local:torch"):
            remote = train("ember", lambda groups: torch.optim.AdamW(groups, lr=1e-2), 20)
    finally:
        _optfast.ON[0] = True
    assert remote[2] == []


def test_two_patterns_of_grads_each_get_a_model_bit_equal() -> None:
    """Every third step leaves the first layer without grads (another recording, another model); the last
    modelled plan is tried first each step and refuses the other pattern without being dropped."""
    def freeze(k: int, m: Any, o: Any) -> None:
        if k % 3 == 1:
            m[0].weight.grad = m[0].bias.grad = None

    def make_opt(groups: Any) -> Any:
        return torch.optim.AdamW(groups, lr=1e-2)
    with ember.connect("local:torch"):
        cpu = train("cpu", make_opt, 60, freeze)
        remote = train("ember", make_opt, 60, freeze)
    assert remote[1] == cpu[1]
    same(remote[0], cpu[0])
    modelled = set(remote[2])
    assert {k for k in range(30, 60) if k % 3 == 1} <= modelled and {k for k in range(30, 60) if k % 3 != 1} <= modelled
