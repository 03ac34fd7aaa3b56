"""A registered graph lowered into a program (server/execute/program.py): cached input views, trusted steps,
scalar overrides, kernel errors, and a graph registered again unchanged."""

from __future__ import annotations

import gc
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from ember.protocol import messages as m  # noqa: E402
from ember.server.execute.backends import make_backend  # noqa: E402
from ember.server.execute.interpreter import Interpreter, build_table  # noqa: E402
from ember.server.execute.program import Program  # noqa: E402
from ember.server.guard.memory import DeviceMemory  # noqa: E402

pytestmark = pytest.mark.timeout(120)

LAY = [[16], [1], 0, "float32"]
ADD = {"a": [0, 0, 1], "l": [LAY, LAY], "o": [[0, [16], [1], 0, "float32", 64]]}


def interpreter(limit: int = 1 << 30) -> Interpreter:
    b = make_backend("torch:cpu")
    return Interpreter(b, build_table(b), {}, lambda out: None,
                       {"max_frame": 1 << 26, "chunk": 1 << 24, "max_tensor": 1 << 40, "graph_cache": 4},
                       DeviceMemory(limit, "test").session(None, "test"))


def storage(vals: Any) -> torch.Tensor:
    return torch.tensor(vals, dtype=torch.float32).view(torch.uint8).clone()


def floats(buf: torch.Tensor) -> list[float]:
    return buf[:64].view(torch.float32).tolist()


def chain(n: int) -> list[Any]:
    """GRAPH 1: x + y, then + y again n - 1 times (inputs x, y; one scalar list [1]: alpha)."""
    body = [["aten.add.Tensor", [2, 0 if i == 0 else 2 + i, 1], 1, ADD] for i in range(n)]
    return [m.GRAPH, 1, 2, [[1]], body, [2 + n], []]


def live_tensors_on(ptr: int) -> int:
    gc.collect()
    n = 0
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor):
            try:
                n += o.untyped_storage().data_ptr() == ptr
            except RuntimeError:  # (another test's tensor without a real storage: meta, fake, freed)
                pass
    return n


def test_cached_input_views_go_with_the_storage_and_keep_nothing_freed_alive() -> None:
    it = interpreter()
    it.put(1, storage(range(16)), "upload")
    it.put(2, storage([2.0] * 16), "upload")
    it.run_batch([chain(3)])
    base = it.mem.held()
    for out in (10, 11):
        it.run_batch([[m.REPLAY, 1, [1, 2], [out], []]])
    prog = it.graphs.peek(1).program
    assert type(prog) is Program and prog.n_fast == 3 and all(fs.trusted for fs in prog.fast)
    assert prog.bound[1] is it.tensors[2]  # the same storages: the views made at the first replay serve
    assert floats(it.tensors[11]) == [i + 6.0 for i in range(16)]
    ptr = it.tensors[2].untyped_storage().data_ptr()
    assert live_tensors_on(ptr) >= 2  # the storage value and the program's cached view of it
    it.run_batch([[m.DROP, [2, 10, 11]]])
    assert prog.bound[1] is None and live_tensors_on(ptr) == 0  # nothing keeps the freed storage alive
    assert it.mem.held() == base - 64  # its charge is returned
    # the id reused for another storage: new views, right values; then a value replaced under an id
    it.put(2, storage([0.5] * 16), "upload")
    it.run_batch([[m.REPLAY, 1, [1, 2], [12], []]])
    assert floats(it.tensors[12]) == [i + 1.5 for i in range(16)]
    old = it.tensors[1].untyped_storage().data_ptr()
    it.put(1, storage([100.0] * 16), "upload")  # put over a held id: the old value leaves the session
    assert prog.bound[0] is None and live_tensors_on(old) == 0
    it.run_batch([[m.REPLAY, 1, [1, 2], [13], []]])
    assert floats(it.tensors[13]) == [101.5] * 16
    it.clear()
    assert it.mem.held() == 0 and not it._views


def test_program_poison_equals_the_generic_replays() -> None:
    """An index out of range inside a fast step, an override of its scalars, a missing input: each
    replay's values and poison are what the generic replay makes of them."""
    idx_lay = [[2], [1], 0, "int64"]
    sel = {"a": [0, 0, 0], "l": [[[4, 4], [4, 1], 0, "float32"], idx_lay],  # index_select(self, dim=0, index)
           "o": [[0, [2, 4], [4, 1], 0, "float32", 32]]}
    add = {"a": [0, 0, 1], "l": [[[2, 4], [4, 1], 0, "float32"]] * 2, "o": [[0, [2, 4], [4, 1], 0, "float32", 32]]}
    body = [["aten.index_select.default", [2, 0, 1], 1, sel], ["aten.add.Tensor", [3, 4, 4], 1, add]]
    graph = [m.GRAPH, 7, 2, [[], [1]], body, [5], []]
    results = []
    for program in (True, False):
        it = interpreter()
        it.put(1, storage([float(i) for i in range(16)]), "upload")
        it.put(2, torch.tensor([3, 1], dtype=torch.int64).view(torch.uint8).clone(), "upload")
        it.put(3, torch.tensor([3, 9], dtype=torch.int64).view(torch.uint8).clone(), "upload")
        it.run_batch([graph])
        if not program:
            it.graphs.peek(7).program = False
        it.run_batch([[m.REPLAY, 7, [1, 2], [20], []], [m.REPLAY, 7, [1, 3], [21], []],
                      [m.REPLAY, 7, [1, 2], [22], [1, [0.5]]], [m.REPLAY, 7, [1, 99], [23], []],
                      [m.REPLAY, 7, [1, 2], [24], []]])
        if program:
            prog = it.graphs.peek(7).program
            assert type(prog) is Program and prog.n_fast == 2
        results.append(([floats(it.tensors[i]) if i in it.tensors else None for i in range(20, 25)],
                        [it.poison[i].error["message"] if i in it.poison else None for i in range(20, 25)]))
    assert results[0] == results[1]
    vals, errs = results[0]
    assert vals[0] == [24.0, 26.0, 28.0, 30.0, 8.0, 10.0, 12.0, 14.0]
    assert vals[2] == [18.0, 19.5, 21.0, 22.5, 6.0, 7.5, 9.0, 10.5] and vals[4] == vals[0]  # alpha 0.5, then 1
    assert vals[1] is None and "out of range" in errs[1] and "index_select" in errs[1]
    assert vals[3] is None and "99" in errs[3]


def test_a_graph_registered_again_unchanged_keeps_its_program() -> None:
    it = interpreter()
    it.put(1, storage(range(16)), "upload")
    it.put(2, storage([1.0] * 16), "upload")
    it.run_batch([chain(2), [m.REPLAY, 1, [1, 2], [10], []]])
    g = it.graphs.peek(1)
    prog = g.program
    it.run_batch([chain(2), [m.REPLAY, 1, [1, 2], [11], []]])
    assert it.graphs.peek(1) is g and g.program is prog
    it.run_batch([chain(3), [m.REPLAY, 1, [1, 2], [12], []]])  # another body under the same id: lowered anew
    assert it.graphs.peek(1) is not g and it.graphs.peek(1).program is not prog and prog.bound == [None, None]
    assert floats(it.tensors[11]) == [i + 2.0 for i in range(16)]
    assert floats(it.tensors[12]) == [i + 3.0 for i in range(16)]


def test_a_replay_over_the_budget_is_refused_step_by_step_as_before() -> None:
    """The fast steps' outputs charged up front do not fit: every step is charged on its own, and the
    one that does not fit is poisoned with the generic replay's LimitExceeded."""
    n = 1 << 14  # 64 KiB results: each charged on its own
    lay = [[n], [1], 0, "float32"]
    add = {"a": [0, 0, 1], "l": [lay, lay], "o": [[0, [n], [1], 0, "float32", 4 * n]]}
    body = [["aten.add.Tensor", [2, 0 if i == 0 else 2 + i, 1], 1, add] for i in range(4)]
    it = interpreter(limit=4 * n * 4)  # the two inputs and two results
    it.put(1, torch.zeros(4 * n, dtype=torch.uint8), "upload")
    it.put(2, torch.ones(n).view(torch.uint8).clone(), "upload")
    it.run_batch([[m.GRAPH, 1, 2, [[1]], body, [6], []], [m.REPLAY, 1, [1, 2], [10], []]])
    assert 10 not in it.tensors and it.poison[10].error["kind"] == "LimitExceeded"
    it.run_batch([[m.GRAPH, 2, 2, [[1]], body[:1], [3], []], [m.REPLAY, 2, [1, 2], [11], []]])
    assert it.tensors[11][:4 * n].view(torch.float32).tolist() == [1.0] * n


def test_large_intermediates_are_written_into_buffers_kept_across_replays() -> None:
    """A 64 MiB result that never leaves the replay goes into a buffer the program keeps (charged while
    kept): same values as the generic replay, and no page faults for it per replay."""
    import resource
    import threading

    n = 1 << 24
    lay = [[n], [1], 0, "float32"]
    add = {"a": [0, 0, 1], "l": [lay, lay], "o": [[0, [n], [1], 0, "float32", 4 * n]]}
    body = [["aten.add.Tensor", [2, 0 if i == 0 else 2 + i, 1], 1, add] for i in range(3)]
    got: dict[bool, Any] = {}

    def work(program: bool) -> None:
        it = interpreter(limit=1 << 32)
        it.put(1, torch.full((n,), 0.5).view(torch.uint8), "upload")
        it.put(2, torch.ones(n).view(torch.uint8), "upload")
        it.run_batch([[m.GRAPH, 1, 2, [[1]], body, [5], []]])
        if not program:
            it.graphs.peek(1).program = False
        for _ in range(3):
            it.run_batch([[m.REPLAY, 1, [1, 2], [10], []]])
        f0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        for _ in range(3):
            it.run_batch([[m.REPLAY, 1, [1, 2], [10], []]])
        faults = (resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0) / 3
        prog = it.graphs.peek(1).program
        pooled = [fs.i for fs, _ in prog.pooled] if prog else []
        held = it.mem.held()
        it.graphs.clear()  # the kept buffers' charges go with the graph
        got[program] = (it.tensors[10].view(torch.float32)[:4].tolist(), faults, pooled, held - it.mem.held())

    for program in (False, True):
        th = threading.Thread(target=work, args=(program,))
        th.start()
        th.join(100)
    assert got[True][0] == got[False][0] == [3.5] * 4
    assert got[True][2] == [0, 1]  # the kept result (step 2) is not pooled
    assert 2 * 4 * n <= got[True][3] < 2 * 4 * n + (1 << 16)  # (and the graph's own entry)
    assert 2 * got[True][1] < got[False][1]  # fresh pages for the kept result only, not for all three


def layer_norm_backward_graph(mean_rows: int) -> list[Any]:
    """GRAPH 9: native_layer_norm_backward of a (2, 4) input over its last dim; ``mean_rows`` rows of
    mean and rstd (2 is right; another count is what the position check refuses)."""
    f = "float32"
    x, s = [[2, 4], [4, 1], 0, f], [[mean_rows, 1], [1, 1], 0, f]
    w = [[4], [1], 0, f]
    kw = {"a": [0, 0, [4], 0, 0, 0, 0, [True, True, True]], "l": [x, x, s, s, w, w],
          "o": [[0, [2, 4], [4, 1], 0, f, 32], [1, [4], [1], 0, f, 16], [2, [4], [1], 0, f, 16]]}
    body = [["aten.native_layer_norm_backward.default", [6, 0, 1, 2, 3, 4, 5], 3, kw]]
    return [m.GRAPH, 9, 6, [[]], body, [7, 8, 9], []]


def test_a_layout_checked_op_is_checked_once_and_then_runs_as_a_fast_step() -> None:
    """native_layer_norm_backward's position check reads layouts only: a graph's step of it is checked when
    its program is lowered and then runs on the fast path (bit-equal to torch's kernel, and to the generic
    replay); layouts the check refuses make a step that runs the check at every replay, refused as before."""
    g = torch.Generator().manual_seed(0)
    x, w, b, go = (torch.randn(*s, generator=g) for s in ((2, 4), (4,), (4,), (2, 4)))
    _, mean, rstd = torch.native_layer_norm(x, [4], w, b, 1e-5)
    want = torch.ops.aten.native_layer_norm_backward(go, x, [4], mean, rstd, w, b, [True, True, True])
    results = []
    for program in (True, False):
        it = interpreter()
        for i, v in enumerate((go, x, mean, rstd, w, b)):
            it.put(i + 1, v.contiguous().view(-1).view(torch.uint8).clone(), "upload")
        it.run_batch([layer_norm_backward_graph(2)])
        if not program:
            it.graphs.peek(9).program = False
        it.run_batch([[m.REPLAY, 9, [1, 2, 3, 4, 5, 6], [20 + 3 * k, 21 + 3 * k, 22 + 3 * k], []] for k in range(3)])
        if program:
            prog = it.graphs.peek(9).program
            assert type(prog) is Program and prog.fast[0] is not None and prog.fast[0].trusted
        results.append([it.tensors[i].view(torch.float32).tolist() for i in range(20, 29)])
    assert results[0] == results[1]
    assert results[0][6:] == [t.reshape(-1).tolist() for t in want]
    it = interpreter()
    for i, v in enumerate((go, x, torch.zeros(3), torch.zeros(3), w, b)):
        it.put(i + 1, v.contiguous().view(-1).view(torch.uint8).clone(), "upload")
    it.run_batch([layer_norm_backward_graph(3)] + [[m.REPLAY, 9, [1, 2, 3, 4, 5, 6], [30 + k, 40 + k, 50 + k], []]
                                                   for k in range(2)])
    prog = it.graphs.peek(9).program
    assert prog.fast[0].vcheck is not None  # a fast step that runs the check at every replay
    for k in range(2):
        assert 30 + k not in it.tensors and "mean" in it.poison[30 + k].error["message"]


def test_a_pointwise_step_whose_scalars_each_replay_overrides_is_trusted_once_shown_exact() -> None:
    """An optimizer's bias corrections override a step's scalars at every replay: a pointwise step is trusted
    under overrides once one with scalars of the same types was exact (no per-replay check); a scalar of
    another type (int -> float: promotion) is checked again (and refused); arange's end (a scalar that shapes its result)
    is never trusted so: it is a generic step, whose declared output is checked against what the end makes before each
    call runs. Values and poison equal the generic replay's throughout."""
    i32 = [[4], [1], 0, "int32"]
    mul = {"a": [0, 1], "l": [i32], "o": [[0, [4], [1], 0, "int32", 16]]}
    ar = {"a": [1, "int64", None, None, None], "l": [], "o": [[0, [3], [1], 0, "int64", 24]]}
    body = [["aten.mul.Scalar", [1, 0], 1, mul], ["aten.arange.default", [2], 1, ar]]
    graph = [m.GRAPH, 5, 1, [[2], [3]], body, [3, 4], []]
    overrides = [[0, [3], 1, [3]], [0, [5], 1, [3]], [0, [7], 1, [4]], [0, [2.5], 1, [3]], [0, [9], 1, [3]]]
    results = []
    for program in (True, False):
        it = interpreter()
        it.put(1, torch.tensor([1, 2, 3, 4], dtype=torch.int32).view(torch.uint8).clone(), "upload")
        it.run_batch([graph])
        if not program:
            it.graphs.peek(5).program = False
        for k, scal in enumerate(overrides):
            it.run_batch([[m.REPLAY, 5, [1], [10 + 2 * k, 11 + 2 * k], scal]])
            if program and k == 1:
                prog = it.graphs.peek(5).program
                assert prog.fast[0].otypes == (int,) and prog.fast[1] is None
        results.append([(it.tensors[i].view(torch.int32 if i % 2 == 0 else torch.int64).tolist()
                         if i in it.tensors else it.poison[i].error["message"]) for i in range(10, 20)])
    assert results[0] == results[1]
    got = results[0]
    assert got[0] == [3, 6, 9, 12] and got[2] == [5, 10, 15, 20] and got[8] == [9, 18, 27, 36]
    assert "float32" in got[6] and "int32" in got[6]  # 2.5 * int32: a float result, refused against its spec
    assert got[4] == [7, 14, 21, 28] and got[1] == got[3] == [0, 1, 2] and "arange" in got[5]


def test_a_kept_result_read_by_the_next_graph_is_that_typed_tensor_itself() -> None:
    """A fresh contiguous result kept by one graph is stored as a flat uint8 view of itself; the next graph
    reading it in that layout takes the very tensor (in another layout of its dtype, a view of it): no
    storage view per replay. Values equal the generic replays'."""
    f = "float32"
    lay2, flat = [[2, 4], [4, 1], 0, f], [[8], [1], 0, f]
    add = {"a": [0, 0, 1], "l": [lay2, lay2], "o": [[0, [2, 4], [4, 1], 0, f, 32]]}
    addf = {"a": [0, 0, 1], "l": [flat, flat], "o": [[0, [8], [1], 0, f, 32]]}
    first = [m.GRAPH, 1, 2, [[1]], [["aten.add.Tensor", [2, 0, 1], 1, add]], [3], []]
    second = [m.GRAPH, 2, 2, [[1]], [["aten.add.Tensor", [2, 0, 1], 1, add],
                                     ["aten.add.Tensor", [2, 3, 1], 1, addf]], [3, 4], []]
    results = []
    for program in (True, False):
        it = interpreter()
        it.put(1, storage(range(8)), "upload")
        it.put(2, storage([1.0] * 8), "upload")
        it.run_batch([first, second])
        if not program:
            it.graphs.peek(1).program = it.graphs.peek(2).program = False
        for k in range(3):
            it.run_batch([[m.REPLAY, 1, [1, 2], [10 + k], []], [m.REPLAY, 2, [10 + k, 2], [20 + k, 30 + k], []]])
            if program and k == 2:
                typed = it.tensors[12].__dict__.get("_ember_result")
                prog = it.graphs.peek(2).program
                assert typed is not None and typed.shape == (2, 4) and prog.bound[0] is it.tensors[12]
                views = [prog.V0[tr] for tr, _, _ in prog.in_lays[0]]
                assert any(v is typed for v in views)
                assert all(v.untyped_storage().data_ptr() == typed.untyped_storage().data_ptr() for v in views)
        results.append([floats(it.tensors[i])[:8] for i in (10, 11, 12, 20, 21, 22, 30, 31, 32)])
    assert results[0] == results[1]
    assert results[0][0] == [i + 1.0 for i in range(8)] and results[0][3] == [i + 2.0 for i in range(8)]


def test_an_eager_result_is_read_as_itself_by_the_next_call() -> None:
    """An eager call's fresh result is stored as a flat uint8 view of itself that keeps it; the next planned
    call reading it in its layout reads that very tensor, in another layout of its dtype a view of it; a
    layout past its storage is refused as before."""
    f = "float32"
    l2, lt = [[2, 4], [4, 1], 0, f], [[4, 2], [1, 4], 0, f]
    add = {"a": [0, 0, 1], "l": [l2, l2], "o": [[0, [2, 4], [4, 1], 0, f, 32]]}
    neg = {"a": [0], "l": [lt], "o": [[0, [4, 2], [2, 1], 0, f, 32]]}
    far = {"a": [0], "l": [[[4, 4], [4, 1], 0, f]], "o": [[0, [4, 4], [4, 1], 0, f, 64]]}
    it = interpreter()
    it.put(1, storage(range(8)), "upload")
    it.put(2, storage([1.0] * 8), "upload")
    it.run_batch([[m.OP, "aten.add.Tensor", [[1], 1, 2], 1, [3], add]])
    typed = it.tensors[3].__dict__["_ember_result"]
    assert typed.shape == (2, 4) and typed.untyped_storage().data_ptr() == it.tensors[3].data_ptr()
    it.run_batch([[m.OP, "aten.add.Tensor", [[1], 3, 3], 1, [4], add]])
    assert it.tensors[3].__dict__["_ember_typed"][2] is typed
    it.run_batch([[m.OP, "aten.neg.default", [[], 3], 1, [5], neg], [m.OP, "aten.neg.default", [[], 3], 1, [6], far]])
    assert floats(it.tensors[4])[:8] == [2.0 * (i + 1) for i in range(8)]
    assert floats(it.tensors[5])[:8] == [-float(1 + i // 2 + 4 * (i % 2)) for i in range(8)]
    assert 6 not in it.tensors and "reaches byte 64" in it.poison[6].error["message"]


def test_a_step_whose_check_reads_operand_values_checks_them_at_every_replay() -> None:
    """embedding_dense_backward's indices are positions: its step is a fast step that runs the position
    check on every replay's indices; an index out of range is refused with the generic replay's poison,
    and the next valid replay is right again (equal to the generic replay's throughout)."""
    f = "float32"
    g, idx = [[3, 2], [2, 1], 0, f], [[3], [1], 0, "int64"]
    kw = {"a": [0, 0, 4, -1, False], "l": [g, idx], "o": [[0, [4, 2], [2, 1], 0, f, 32]]}
    graph = [m.GRAPH, 3, 2, [[]], [["aten.embedding_dense_backward.default", [2, 0, 1], 1, kw]], [3], []]
    results = []
    for program in (True, False):
        it = interpreter()
        it.put(1, storage(range(6)), "upload")
        for tid, ix in ((2, [0, 3, 0]), (3, [1, 4, 2])):
            it.put(tid, torch.tensor(ix, dtype=torch.int64).view(torch.uint8).clone(), "upload")
        it.run_batch([graph])
        if not program:
            it.graphs.peek(3).program = False
        it.run_batch([[m.REPLAY, 3, [1, i], [10 + k], []] for k, i in enumerate((2, 2, 3, 2))])
        if program:
            fs = it.graphs.peek(3).program.fast[0]
            assert fs is not None and fs.vcheck is not None and fs.trusted
        results.append([floats(it.tensors[i])[:8] if i in it.tensors else it.poison[i].error["message"]
                        for i in range(10, 14)])
    assert results[0] == results[1]
    assert results[0][0] == results[0][3] == [4.0, 6.0, 0.0, 0.0, 0.0, 0.0, 2.0, 3.0]
    assert "indices" in results[0][2] and "[1, 4]" in results[0][2]


def test_a_step_over_a_stride_0_view_is_charged_for_what_it_describes() -> None:
    """``median`` of a stride-0 view of 2^26 floats over 4 bytes holds the whole view while it runs (it copies it):
    sent alone it is charged for that (``sizes.expanded``); as a graph's fast step it was not. Such a step is a
    generic step, charged the same: over a 32 MiB budget, it is refused and its output poisoned."""
    f = "float32"
    kw = {"a": [0], "l": [[[1 << 26], [0], 0, f]], "o": [[0, [], [], 0, f, 4]]}
    graph = [m.GRAPH, 11, 1, [[]], [["aten.median.default", [1, 0], 1, kw]], [2], []]
    it = interpreter(32 << 20)
    it.put(1, storage([2.0]), "upload")
    it.run_batch([graph, [m.REPLAY, 11, [1], [20], []]])
    prog = it.graphs.peek(11).program
    assert prog is False or prog.fast[0] is None  # (no fast step: the graph replays generically)
    assert 20 not in it.tensors and "budget" in it.poison[20].error["message"]
    kw_small = {"a": [0], "l": [[[8], [0], 0, f]], "o": [[0, [], [], 0, f, 4]]}
    it.run_batch([[m.GRAPH, 12, 1, [[]], [["aten.median.default", [1, 0], 1, kw_small]], [2], []],
                  [m.REPLAY, 12, [1], [21], []]])
    assert it.tensors[21].view(torch.float32).tolist() == [2.0]
