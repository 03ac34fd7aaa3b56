"""A loop that slices a tensor held on the peer at a moving position (``x = data[i:i+n]``, the batches of
pytorch/examples' word_language_model) replays one graph: the offsets of the inputs' layouts travel as values
(GRAPH's ``moving``, REPLAY's ``offsets``; feature ``"offsets"``), each checked against its storage at every
replay. Over a real WebSocket peer the loops are bit-equal to local CPU torch; at the interpreter, an offset
past the storage's end poisons that op alone, and malformed ``moving`` or ``offsets`` are refused."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

import ember  # noqa: E402
import ember.torch  # noqa: E402,F401
from ember.protocol import messages as m  # noqa: E402
from ember.server.execute.program import Program  # noqa: E402
from test_peer_program import floats, interpreter, storage  # noqa: E402

pytestmark = pytest.mark.timeout(120)

F4 = [[4], [1], 0, "float32"]


def window_add(moving: list[int] | None = None) -> list[Any]:
    """GRAPH 5: data[off:off+4] + y (inputs data: 16 floats, y: 4 floats), the first operand's offset moving."""
    kw = {"a": [0, 0, 1], "l": [[[4], [1], 0, "float32"], F4], "o": [[0, [4], [1], 0, "float32", 16]]}
    g = [m.GRAPH, 5, 2, [[1]], [["aten.add.Tensor", [2, 0, 1], 1, kw]], [3], []]
    return g + [[0, 0] if moving is None else moving]


def setup() -> Any:
    it = interpreter()
    it.put(1, storage([float(i) for i in range(16)]), "upload")
    it.put(2, storage([100.0] * 4), "upload")
    it.run_batch([window_add()])
    return it


def test_each_replay_reads_the_window_at_its_offset_through_the_fast_program() -> None:
    it = setup()
    batch = [[m.REPLAY, 5, [1, 2], [10], []]] + [[m.REPLAY, 5, [1, 2], [11 + k], [], [0, 4 * k + 1]]
                                                 for k in range(3)] + [[m.REPLAY, 5, [1, 2], [14], [], []]]
    it.run_batch(batch)
    prog = it.graphs.peek(5).program
    assert type(prog) is Program and prog.n_fast == 1 and prog.fast[0].trusted
    assert floats(it.tensors[10])[:4] == [100.0, 101.0, 102.0, 103.0]  # as registered
    for k in range(3):
        assert floats(it.tensors[11 + k])[:4] == [100.0 + 4 * k + 1 + j for j in range(4)]
    assert floats(it.tensors[14])[:4] == [100.0, 101.0, 102.0, 103.0]  # no offsets: the registered ones again
    # the same offset again makes no new view; another storage under the input gets views at the offset asked
    it.put(1, storage([float(-i) for i in range(16)]), "upload")
    it.run_batch([[m.REPLAY, 5, [1, 2], [15], [], [0, 12]]])
    assert floats(it.tensors[15])[:4] == [100.0 - 12 - j for j in range(4)]


def test_an_offset_past_the_storage_poisons_that_replay_alone() -> None:
    it = setup()
    it.run_batch([[m.REPLAY, 5, [1, 2], [10], [], [0, 13]],  # 13 + 4 floats > 16: past the end
                  [m.REPLAY, 5, [1, 2], [11], [], [0, 12]]])  # the last window: fine
    assert 10 not in it.tensors and "reaches byte 68 of a storage of 64 bytes" in it.poison[10].error["message"]
    assert floats(it.tensors[11])[:4] == [112.0, 113.0, 114.0, 115.0]


def test_in_place_writes_through_a_moving_window_reach_the_base() -> None:
    """data[off:off+4].add_(y) at three offsets: the base storage holds all three writes."""
    it = interpreter()
    it.put(1, storage([0.0] * 16), "upload")
    it.put(2, storage([1.0] * 4), "upload")
    kw = {"a": [0, 0, 1], "l": [[[4], [1], 0, "float32"], F4], "o": []}
    it.run_batch([[m.GRAPH, 6, 2, [[1]], [["aten.add_.Tensor", [2, 0, 1], 0, kw]], [], [], [0, 0]]])
    it.run_batch([[m.REPLAY, 6, [1, 2], [], [], [0, off]] for off in (0, 4, 6)])
    assert floats(it.tensors[1]) == [1.0] * 6 + [2.0, 2.0] + [1.0] * 2 + [0.0] * 6


def reads_an_output() -> list[Any]:
    """window_add, plus a second step whose operand 0 (named moving) is the first step's output."""
    g = window_add([1, 0])
    g[4].append(["aten.add.Tensor", [2, 3, 1], 1, g[4][0][3]])
    g[5] = [4]
    return g


@pytest.mark.parametrize("graph, why", [
    (reads_an_output(), "an operand that is not an input"),
    (window_add([1, 0]), "a step out of range"),
    (window_add([0, 2]), "an operand out of range"),
    (window_add([0, 0, 0, 0]), "the same layout twice"),
    (window_add([0]), "an odd list"),
])
def test_malformed_moving_layouts_are_a_session_error(graph: list[Any], why: str) -> None:
    it = interpreter()
    errors: list[Any] = []
    it.respond = errors.extend
    it.run_batch([graph])
    assert errors and errors[0][:2] == [0, m.ERROR] and "Graph" in errors[0][2]["message"], why
    assert it.graphs.peek(5) is None


@pytest.mark.parametrize("offsets", [[0, -4], [0, 1.5], [1, 4], [0], [0, 1 << 62]])
def test_malformed_offsets_leave_the_replay_unrun_and_the_session_going(offsets: list[Any]) -> None:
    it = setup()
    it.run_batch([[m.REPLAY, 5, [1, 2], [10], [], offsets], [m.REPLAY, 5, [1, 2], [11], [], [0, 8]]])
    assert 10 not in it.tensors and 10 not in it.poison
    assert floats(it.tensors[11])[:4] == [108.0, 109.0, 110.0, 111.0]


def test_offsets_for_a_graph_that_moves_nothing_are_refused() -> None:
    it = interpreter()
    it.put(1, storage([1.0] * 4), "upload")
    it.put(2, storage([1.0] * 4), "upload")
    kw = {"a": [0, 0, 1], "l": [F4, F4], "o": [[0, [4], [1], 0, "float32", 16]]}
    it.run_batch([[m.GRAPH, 8, 2, [[1]], [["aten.add.Tensor", [2, 0, 1], 1, kw]], [3], []],
                  [m.REPLAY, 8, [1, 2], [10], [], [0, 4]]])
    assert 10 not in it.tensors and 10 not in it.poison


def slices(device: str, write: bool) -> tuple[list[float], list[Any], Any]:
    """An MLP trained on windows of a tensor that lives on ``device`` (moving by 7 rows a step), with Adam;
    ``write``: each window is also scaled in place (the base must see it)."""
    torch.manual_seed(0)
    data = torch.randn(400, 8).to(device)
    w1 = torch.randn(8, 16).to(device).requires_grad_()
    w2 = torch.randn(16, 4).to(device).requires_grad_()
    opt = torch.optim.Adam([w1, w2], lr=0.01)
    seen = []
    for step in range(30):
        i = (step * 7) % 380
        x = data[i:i + 10]
        if write:
            x.mul_(0.5)
        loss = ((x @ w1).relu() @ w2).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        seen.append(loss.item())
    return seen, [w1.detach().cpu(), w2.detach().cpu()], data.cpu()


@pytest.mark.parametrize("write", [False, True], ids=["read", "written"])
def test_a_loop_over_windows_of_a_tensor_on_the_peer_replays_bit_equal(torch_peer: str, write: bool) -> None:
    local = slices("cpu", write)
    with ember.connect(torch_peer) as dev:
        got = slices("ember", write)
        stats = dict(dev.session.stats)
        moving = [e for e in dev.session._gtable.entries.values() if len(e.wire) == 8]
    assert got[0] == local[0] and all(torch.equal(a, b) for a, b in zip(got[1], local[1]))
    assert torch.equal(got[2], local[2])
    assert moving and stats["replays"] >= 40, stats  # (without moving layouts: 1 replay in 30 steps)
