"""A read inside a replayed step is answered before the rest of the step (client/grouping.py's
``_split_for_read``): ``loss.item()`` after ``opt.step()`` waits for the forward and the loss, not for the
backward and the optimizer's step, which only read the loss. A value that the rest of the step writes (in
place, through a view) waits for it; a value the step does not write is read before the step. Every loop
here is bit-equal to the same loop on local CPU torch, over a real WebSocket peer."""

from __future__ import annotations

from typing import Any, Callable

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

import ember  # noqa: E402
import ember.torch  # noqa: E402,F401
from ember.torch import workloads as W  # noqa: E402

pytestmark = pytest.mark.timeout(120)

STEPS = 24


def loop(device: str, read: Callable[[dict[str, Any]], float], compiled: bool = False) -> tuple[list[float], list[Any]]:
    """An MLP trained with AdamW, a fresh batch every step and ``read(step_state)`` after the optimizer's step,
    every step; returns what was read and the final parameters."""
    torch.manual_seed(0)
    model = W.MLP(8, 16, 4).to(device)
    run = torch.compile(model, backend="ember") if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    seen: list[float] = []
    state: dict[str, Any] = {"prev": None, "acc": torch.zeros(2, device=device)}
    for _ in range(STEPS):
        x, y = W.classification_batch(g, 16, (8,), 4)
        loss = F.cross_entropy(run(x.to(device)), y.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        state["loss"] = loss
        opt.step()
        seen.append(read(state))
        state["prev"] = loss.detach()
    return seen, [p.detach().cpu() for p in model.parameters()]


def same(a: tuple[list[float], list[Any]], b: tuple[list[float], list[Any]]) -> None:
    assert a[0] == b[0]
    assert all(torch.equal(p, q) for p, q in zip(a[1], b[1]))


def remote(torch_peer: str, read: Callable[[dict[str, Any]], float], **kw: Any) -> tuple[Any, dict[str, int]]:
    with ember.connect(torch_peer) as dev:
        got = loop("ember", read, **kw)
        stats = dict(dev.session.stats)
    return got, stats


def test_a_loss_read_every_step_is_answered_before_the_backward_and_the_step(torch_peer: str) -> None:
    """The step replays as two graphs (forward and loss; backward and optimizer's step) with the READ between
    them, from the third step on; bit-equal to local CPU torch."""
    def read(s: dict[str, Any]) -> float:
        return s["loss"].item()
    got, stats = remote(torch_peer, read)
    same(loop("cpu", read), got)
    assert stats["split_reads"] >= STEPS - 3, stats
    assert stats["replays"] >= 2 * (STEPS - 4), stats


def test_a_compiled_step_splits_at_its_loss_too(torch_peer: str) -> None:
    """Under ``torch.compile(backend="ember")`` the forward and backward graphs join the step's group (a read the
    peer answers early does not pause joining), and the step splits at the loss as in eager."""
    def read(s: dict[str, Any]) -> float:
        return s["loss"].item()
    torch._dynamo.reset()
    got, stats = remote(torch_peer, read, compiled=True)
    with ember.connect(torch_peer):
        eager = loop("ember", read)
    same(eager, got)
    assert stats["split_reads"] >= STEPS - 4, stats
    assert stats["replays"] >= 2 * (STEPS - 6), stats


@pytest.mark.parametrize("where", ["in place", "through a view"])
def test_a_value_the_rest_of_the_step_writes_waits_for_that_write(torch_peer: str, where: str) -> None:
    """The read value is written after the loss (``acc`` takes the loss, then is doubled in place, directly or
    through a view of its storage): the READ waits for that write, and reads the doubled value."""
    def read(s: dict[str, Any]) -> float:
        acc = s["acc"]
        acc.copy_(s["loss"].detach().expand(2))
        opt_free = s["loss"] * 0 + 1  # (an op after the write: the write is not the group's last op)
        target = acc if where == "in place" else acc[1:]
        target.mul_(2)
        opt_free.add_(1)
        return acc[1].item() + acc.sum().item()
    got, _ = remote(torch_peer, read)
    same(loop("cpu", read), got)


def test_a_value_the_step_does_not_write_is_read_before_the_step(torch_peer: str) -> None:
    """The previous step's loss, read after this step: the READ goes before this step's group, which replays
    after it; the values and the training stay bit-equal."""
    def read(s: dict[str, Any]) -> float:
        return s["prev"].item() if s["prev"] is not None else 0.0
    got, stats = remote(torch_peer, read)
    same(loop("cpu", read), got)
    assert stats["split_reads"] >= STEPS - 4, stats


def lm_loop(device: str, late: Callable[[Any, int], float]) -> tuple[list[float], list[Any]]:
    """A small transformer LM trained with AdamW; ``late(loss, step)`` after the optimizer's step reads a value
    the end of the step computes (as a Trainer's ``torch.isnan(loss)`` or a GradScaler's found-inf check)."""
    torch.manual_seed(0)
    model = W.TinyLM().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    batch = W.lm_batch()
    seen: list[float] = []
    for step in range(STEPS):
        x, y = batch(g)
        out = model(x.to(device))
        if step % 7 == 6:  # (now and then a step that is not the others: it leaves the candidate midway)
            out = out * 1.0
        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.to(device).reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        seen.append(late(loss, step))
    return seen, [p.detach().cpu() for p in model.parameters()]


def test_a_step_whose_end_a_read_waits_for_goes_out_in_chunks(torch_peer: str) -> None:
    """``torch.isnan(loss).item()`` after the step is made at its end, by an op whose input is final when the forward
    ends: from the next step on the held step goes out in chunks, each a replayed graph, as it is recorded: the
    forward in two, the second ending with the loss, and the rest at the read, which waits for the forward alone
    (``GroupHolding._chunk_plan``; the peer runs the forward while the backward is recorded). Steps that leave their
    candidate midway send the rest as ops. Bit-equal to local CPU torch, the values read included."""
    def late(loss: Any, step: int) -> float:
        return float(torch.isnan(loss).item()) + (loss * 2).item()
    with ember.connect(torch_peer) as dev:
        got = lm_loop("ember", late)
        stats = dict(dev.session.stats)
        cuts = [c.cut for cl in dev.session._cands.values() for c in cl if c.late]
    same(lm_loop("cpu", late), got)
    assert stats["split_reads"] == 0, stats  # (the read's value is made last: no split)
    # three chunks a step (at least two on average: on a loaded machine a held step may be let go as ops)
    assert stats["replays"] >= 2 * (STEPS - STEPS // 7 - 4), stats
    assert cuts and all(cuts), cuts  # cut where the loss is final


def test_array_api_loops_split_at_their_reads_too(torch_peer: str) -> None:
    """The Array API's ops write none of their arguments (``protocol.ops.writes``): a gradient descent written
    with ``ember.array_api`` that reads its loss every step has it answered before the gradient and the update,
    with the same values as the loop whose reads wait for the whole step."""
    import numpy as np

    import ember.array_api as xp

    def descend(split: bool) -> tuple[list[float], Any, dict[str, int]]:
        rng = np.random.default_rng(0)
        with ember.connect(torch_peer) as dev:
            X = xp.asarray(rng.standard_normal((64, 8)), device=dev)
            y = xp.asarray(rng.standard_normal(64), device=dev)
            w = xp.zeros(8, device=dev, dtype=xp.float64)
            if not split:
                dev.session.op_writes = None  # (as before ops.writes: reads never split the held group)
            seen = []
            for _ in range(STEPS):
                r = X @ w - y
                loss = xp.mean(r * r)
                w = w - 0.05 * (2 * (xp.matrix_transpose(X) @ r) / 64)
                seen.append(float(loss))
            return seen, np.asarray(w), dict(dev.session.stats)
    got, base = descend(True), descend(False)
    assert got[0] == base[0] and np.array_equal(got[1], base[1])
    assert got[2]["split_reads"] >= STEPS - 4 and base[2]["split_reads"] == 0, (got[2], base[2])
    assert got[2]["replays"] >= 2 * (STEPS - 6), got[2]
