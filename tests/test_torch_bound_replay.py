"""Pre-bound replay (server/execute/bound.py): a graph's ATen steps bound once still check every binding."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

import ember  # noqa: E402
import ember.torch  # noqa: E402,F401
from ember.protocol import messages as m  # noqa: E402
from ember.server.execute.backends import make_backend  # noqa: E402
from ember.server.execute.program import Program  # noqa: E402
from ember.server.execute.interpreter import Interpreter, build_table  # noqa: E402
from ember.torch import workloads as W  # noqa: E402

LAY = [[16], [1], 0, "float32"]


def storage(vals: Any, nbytes: int | None = None) -> torch.Tensor:
    """A peer storage (flat uint8) holding float32 ``vals``, ``nbytes`` long."""
    raw = torch.tensor(vals, dtype=torch.float32).view(torch.uint8)
    buf = torch.zeros(nbytes if nbytes is not None else raw.numel(), dtype=torch.uint8)
    n = min(raw.numel(), buf.numel())
    buf[:n] = raw[:n]
    return buf


def floats(buf: torch.Tensor) -> list[float]:
    return buf[:64].view(torch.float32).tolist()


def test_a_bound_step_checks_each_replays_storages_and_poisons_what_it_cannot_run() -> None:
    b = make_backend("torch:cpu")
    it = Interpreter(b, build_table(b), {}, lambda out: None,
                     {"max_frame": 1 << 26, "chunk": 1 << 24, "max_tensor": 1 << 40, "graph_cache": 4})
    it.tensors.update({1: storage(range(16)), 2: storage([2.0] * 16), 3: storage([1.0, 2.0]), 4: storage([5.0] * 16)})
    add = {"a": [0, 0, 1], "l": [LAY, LAY], "o": [[0, [16], [1], 0, "float32", 64]]}
    add_ = {"a": [0, 0, 1], "l": [LAY, LAY], "o": []}  # writes its first operand (input register 0)
    it.run_batch([[m.GRAPH, 1, 2, [[1]], [["aten.add.Tensor", [2, 0, 1], 1, add]], [3], []],
                  [m.GRAPH, 2, 2, [[1]], [["aten.add_.Tensor", [2, 0, 1], 0, add_]], [], []]])
    it.run_batch([[m.REPLAY, 1, [1, 2], [10], []],
                  [m.REPLAY, 1, [1, 3], [11], []],    # an 8-byte storage bound where the layout needs 64
                  [m.REPLAY, 1, [3, 2], [12], []],
                  [m.REPLAY, 1, [1, 4], [13], []],    # back to a storage that holds the layout
                  [m.REPLAY, 2, [3, 2], [], []],      # written in place: the too-small storage is poisoned
                  [m.REPLAY, 2, [4, 2], [], []]])
    assert all(type(it.graphs.peek(g).program) is Program and it.graphs.peek(g).program.n_fast == 1 for g in (1, 2))
    assert floats(it.tensors[10]) == [i + 2.0 for i in range(16)]
    for tid in (11, 12):
        assert tid not in it.tensors and "reaches byte 64 of a storage of 8 bytes" in it.poison[tid].error["message"]
    assert floats(it.tensors[13]) == [i + 5.0 for i in range(16)]
    assert 3 not in it.tensors and "reaches byte 64" in it.poison[3].error["message"]
    assert floats(it.tensors[4]) == [7.0] * 16
    it.run_batch([[m.REPLAY, 1, [3, 2], [14], []]])  # a consumer of the poisoned storage: its poison
    assert it.poison[14] is it.poison[3]


def mlp_run(device: str, steps: int) -> tuple[list[float], list[torch.Tensor]]:
    """A small MLP + AdamW; every step a new batch, and every few steps another layout of it (a strided
    view of a wider tensor, a smaller batch), so replays bind other storages of other sizes."""
    torch.manual_seed(0)
    model = W.MLP(8, 16, 4).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    losses = []
    for step in range(steps):
        n = 32 if step % 20 < 14 else 16
        wide, y = W.classification_batch(g, n, (12,), 4)
        x = wide.to(device)[:, :8] if step % 10 >= 5 else wide[:, :8].contiguous().to(device)
        loss = torch.nn.functional.cross_entropy(model(x), y.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().cpu() for p in model.parameters()]


@pytest.mark.timeout(240)
def test_replayed_mlp_steps_on_new_storages_and_layouts_equal_local_cpu_bit_for_bit() -> None:
    local = mlp_run("cpu", 110)
    with ember.connect("local:torch") as d:
        remote = mlp_run("ember", 110)
        replays = d.session.stats["replays"]
    assert replays >= 50
    assert local[0] == remote[0]
    assert all(torch.equal(p, q) for p, q in zip(local[1], remote[1]))
