"""Compiled graphs on the peer (server/execute/compiled.py): a replayed graph's trusted ATen prefix compiled
with inductor, equal to eager within float tolerance; refused where the peer was not started with it."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from ember.protocol import messages as m  # noqa: E402
from ember.server.execute.backends import make_backend  # noqa: E402
from ember.server.execute.compiled import READY, Compiler  # noqa: E402
from ember.server.execute.interpreter import Interpreter, build_table  # noqa: E402

F = "float32"


def lay(size: list[int], stride: list[int]) -> list[Any]:
    return [size, stride, 0, F]


def out(size: list[int], stride: list[int]) -> list[Any]:
    n = 4
    for s in size:
        n *= s
    return [[0, size, stride, 0, F, n]]


def mlp_graph() -> list[Any]:
    """tanh(relu(x @ w + b)) * (x @ w + b): inputs x (4, 8), w (8, 16), b (16,); scalars [] and [1]."""
    x, w, b = lay([4, 8], [8, 1]), lay([8, 16], [16, 1]), lay([16], [1])
    h = lay([4, 16], [16, 1])
    body = [["aten.mm.default", [3, 0, 1], 1, {"a": [0, 0], "l": [x, w], "o": out([4, 16], [16, 1])}],
            ["aten.add.Tensor", [4, 5, 2], 1, {"a": [0, 0, 1], "l": [h, b], "o": out([4, 16], [16, 1])}],
            ["aten.relu.default", [3, 6], 1, {"a": [0], "l": [h], "o": out([4, 16], [16, 1])}],
            ["aten.tanh.default", [3, 7], 1, {"a": [0], "l": [h], "o": out([4, 16], [16, 1])}],
            ["aten.mul.Tensor", [3, 8, 6], 1, {"a": [0, 0], "l": [h, h], "o": out([4, 16], [16, 1])}]]
    return [m.GRAPH, 1, 3, [[], [1]], body, [9], []]


def interpreter(compiler: Compiler | None) -> Interpreter:
    b = make_backend("torch:cpu")
    it = Interpreter(b, build_table(b), {}, lambda out: None,
                     {"max_frame": 1 << 26, "chunk": 1 << 24, "max_tensor": 1 << 40, "graph_cache": 4})
    it.compiler = compiler
    return it


def as_storage(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8).clone()


@pytest.mark.timeout(400)
def test_a_compiled_graph_equals_eager_within_float_tolerance() -> None:
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(4, 8, generator=g), torch.randn(8, 16, generator=g), torch.randn(16, generator=g)
    compiler = Compiler()
    it = interpreter(compiler)
    it.put(1, as_storage(x), "upload")
    it.put(2, as_storage(w), "upload")
    it.put(3, as_storage(b), "upload")
    it.run_batch([mlp_graph(), [m.REPLAY, 1, [1, 2, 3], [10], []], [m.REPLAY, 1, [1, 2, 3], [11], []]])
    c = it.graphs.peek(1).program.comp  # asked for at the second replay, compiled in the background
    assert c and c.n_ops == 5 and c.done.wait(300), "the compile did not finish"
    assert c.state == READY, c.reason
    it.run_batch([[m.REPLAY, 1, [1, 2, 3], [12], []]])
    assert c.hits == 1
    h = x @ w + b
    want = torch.tanh(torch.relu(h)) * h
    eager, compiled = (it.tensors[i].view(torch.float32).view(4, 16) for i in (10, 12))
    assert torch.equal(eager, want)
    torch.testing.assert_close(compiled, want, rtol=1e-5, atol=1e-5)
    # new storages, an overridden scalar of the prefix (eager), a poisoned input (eager: its poison)
    it.put(1, as_storage(x * 2), "upload")
    it.run_batch([[m.REPLAY, 1, [1, 2, 3], [13], []], [m.REPLAY, 1, [1, 2, 3], [14], [1, [0.5]]],
                  [m.REPLAY, 1, [1, 2, 99], [15], []]])
    assert c.hits == 2
    h2 = (x * 2) @ w
    torch.testing.assert_close(it.tensors[13].view(torch.float32).view(4, 16), torch.tanh(torch.relu(h2 + b)) * (h2 + b))
    assert torch.equal(it.tensors[14].view(torch.float32).view(4, 16), torch.tanh(torch.relu(h2 + 0.5 * b)) * (h2 + 0.5 * b))
    assert 15 not in it.tensors and "99" in it.poison[15].error["message"]
    assert compiler.stats()["compiled"] == 1 and compiler.stats()["replays"] == 2
    # another session registering the same graph gets the same compiled prefix (cached by the graph's hash)
    it2 = interpreter(compiler)
    for i, v in ((1, x), (2, w), (3, b)):
        it2.put(i, as_storage(v), "upload")
    it2.run_batch([mlp_graph()] + [[m.REPLAY, 1, [1, 2, 3], [10 + i], []] for i in range(3)])
    assert it2.graphs.peek(1).program.comp is c and c.hits == 4  # its second and third replays
    torch.testing.assert_close(it2.tensors[12].view(torch.float32).view(4, 16), want)


def mlp_steps(device: str, steps: int, until: Any = None) -> tuple[list[float], list[torch.Tensor]]:
    """A small MLP + SGD, the same batch each step; ``until()`` true: stop early (after ``steps`` at least)."""
    from ember.torch import workloads as W
    torch.manual_seed(0)
    model = W.MLP(8, 16, 4).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    x, y = W.classification_batch(g, 32, (8,), 4)
    x, y = x.to(device), y.to(device)
    losses = []
    for step in range(400):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step + 1 >= steps and (until is None or until()):
            break
    return losses, [p.detach().cpu() for p in model.parameters()]


@pytest.mark.timeout(400)
def test_training_replays_through_the_compiled_path_of_a_peer_started_with_compile() -> None:
    import ember
    import ember.torch  # noqa: F401
    from ember.server import Server
    srv = Server(["torch:cpu"], compile=True)
    srv.listen_tcp("127.0.0.1", 0)
    addr = srv.start_in_thread()[0]
    try:
        with ember.connect(addr, compile=True) as d:
            assert d.session.compiled

            def ready() -> bool:  # waits for a compile once one was asked for (the readiness signal)
                for c in list(srv.compiler.cache.values()):
                    assert c.done.wait(300), "the compile did not finish"
                return srv.compiler.stats()["replays"] >= 20

            remote = mlp_steps("ember", 5, ready)
            states = d.stats()["peer"]["session"]["compiled_graphs"]  # (the session's STATS say so too)
        stats = srv.compiler.stats()
        assert states["ready"] >= 1 and not states["pending"], states
    finally:
        srv.close()
    assert stats["compiled"] >= 1 and stats["replays"] >= 20, stats
    local = mlp_steps("cpu", len(remote[0]))
    torch.testing.assert_close(remote[0], local[0], rtol=1e-4, atol=1e-5)
    for p, q in zip(remote[1], local[1]):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


def test_compiled_graphs_are_refused_by_a_peer_started_without_the_option() -> None:
    import ember
    import ember.torch  # noqa: F401
    from ember.server import Server
    srv = Server(["torch:cpu"])
    srv.listen_tcp("127.0.0.1", 0)
    addr = srv.start_in_thread()[0]
    try:
        with pytest.warns(RuntimeWarning, match="not started with --compile"):
            d = ember.connect(addr, compile=True)
        with d:
            assert not d.session.compiled and srv.compiler is None
            x = torch.arange(4.0).to("ember")
            assert (x * 2 + 1).cpu().tolist() == [1.0, 3.0, 5.0, 7.0]  # the session is served (eagerly)
            assert d.stats()["peer"]["session"]["compiled_graphs"] is None
        with ember.connect(addr) as d:  # not asked: nothing to refuse
            assert not d.session.compiled
    finally:
        srv.close()


@pytest.mark.timeout(400)
def test_compiled_outputs_never_share_memory_with_each_other_or_an_input() -> None:
    """Inductor may return one buffer for two equal results (CSE) or an input itself: each kept output
    still gets storage of its own, as the eager steps give it."""
    x = lay([4, 4], [4, 1])
    one = out([4, 4], [4, 1])
    body = [["aten.relu.default", [1, 0], 1, {"a": [0], "l": [x], "o": one}],
            ["aten.relu.default", [1, 0], 1, {"a": [0], "l": [x], "o": one}],
            ["aten.mul.Tensor", [1, 2, 3], 1, {"a": [0, 0], "l": [x, x], "o": one}]]
    compiler = Compiler()
    it = interpreter(compiler)
    it.put(1, as_storage(torch.arange(-8.0, 8.0)), "upload")
    it.run_batch([[m.GRAPH, 2, 1, [[]], body, [2, 3, 4], []]] + [[m.REPLAY, 2, [1], [10, 11, 12], []]] * 2)
    c = it.graphs.peek(2).program.comp
    assert c and c.done.wait(300) and c.state == READY, getattr(c, "reason", c)
    it.run_batch([[m.REPLAY, 2, [1], [20, 21, 22], []]])
    assert c.hits == 1
    ptrs = {it.tensors[i].untyped_storage().data_ptr() for i in (1, 20, 21, 22)}
    assert len(ptrs) == 4
    r = torch.relu(torch.arange(-8.0, 8.0))
    assert [it.tensors[i].view(torch.float32).tolist() for i in (20, 21, 22)] == [r.tolist(), r.tolist(), (r * r).tolist()]
    it.tensors[20].view(torch.float32).add_(1)  # (what a later in-place op on one of them does)
    assert it.tensors[21].view(torch.float32).tolist() == r.tolist()


@pytest.mark.timeout(600)
def test_a_transformer_trained_through_the_compiled_path_equals_local_within_float_tolerance() -> None:
    """TinyLM + SGD: its forward graph's prefix (embeddings, layer norm, attention without dropout, views
    of results) compiled on the peer; losses and parameters as local CPU torch's, within rounding (SGD:
    AdamW turns the rounding noise of a gradient that is 0 in exact arithmetic, the key bias's, into
    steps of the learning rate's size)."""
    import ember
    import ember.torch  # noqa: F401
    from ember.server import Server
    from ember.torch import workloads as W

    def train(device: str, steps: int) -> Any:
        return W.train(W.TinyLM, device, steps=steps, lm=True, batch=W.lm_batch(), opt="SGD",
                       opt_args={"lr": 0.05, "momentum": 0.9})

    srv = Server(["torch:cpu"], compile=True)
    srv.listen_tcp("127.0.0.1", 0)
    addr = srv.start_in_thread()[0]
    try:
        with ember.connect(addr, compile=True):
            train("ember", 10)  # the graphs registered and replayed, their compiles asked for
        for c in list(srv.compiler.cache.values()):
            assert c.done.wait(400), "the compile did not finish"
        before = srv.compiler.stats()
        with ember.connect(addr, compile=True):  # the same graphs again: compiled already
            remote = train("ember", 16)
        after = srv.compiler.stats()
    finally:
        srv.close()
    assert before["compiled"] >= 1 and after["compiled"] == before["compiled"], (before, after)
    assert after["replays"] - before["replays"] >= 5, (before, after)
    local = train("cpu", 16)
    torch.testing.assert_close(remote[0], local[0], rtol=1e-4, atol=1e-4)
    for p, q in zip(remote[1], local[1]):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-4)


@pytest.mark.timeout(120)
def test_ember_serve_with_compile_grants_the_feature_and_without_refuses_it() -> None:
    import subprocess
    import warnings

    import ember
    from test_core_cli import ENV, address_of, spawn_serve
    for flag in (["--compile"], []):
        p = spawn_serve("--device", "torch:cpu", *flag, "--no-iroh", "--tcp", "127.0.0.1:0", env=ENV,
                        stderr=subprocess.DEVNULL)
        try:
            addr = address_of(p, r"listening on (tcp://\S+)", timeout=60)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with ember.connect(addr, compile=True) as d:
                    granted = d.session.compiled
            assert granted == bool(flag)
            assert any("not started with --compile" in str(w.message) for w in caught) == (not flag)
        finally:
            p.kill()
            p.wait(10)


@pytest.mark.timeout(400)
def test_an_index_out_of_range_inside_a_compiled_graph_gets_the_eager_poison() -> None:
    """The compiled kernel checks its indices (inductor's bounds asserts); a replay it refuses runs
    eagerly, so an out-of-range index is the embedding's own error, never a read outside the weight."""
    w, idx, h = lay([10, 4], [4, 1]), [[3], [1], 0, "int64"], lay([3, 4], [4, 1])
    body = [["aten.embedding.default", [2, 0, 1], 1, {"a": [0, 0, -1, False, False], "l": [w, idx],
                                                        "o": out([3, 4], [4, 1])}],
            ["aten.relu.default", [2, 3], 1, {"a": [0], "l": [h], "o": out([3, 4], [4, 1])}]]
    it = interpreter(Compiler())
    it.put(1, as_storage(torch.arange(40.0)), "upload")
    it.put(2, torch.tensor([1, 2, 3]).view(torch.uint8).clone(), "upload")
    it.put(3, torch.tensor([1, 2, 10 ** 6]).view(torch.uint8).clone(), "upload")
    it.run_batch([[m.GRAPH, 1, 2, [[]], body, [4], []]] + [[m.REPLAY, 1, [1, 2], [10], []]] * 2)
    c = it.graphs.peek(1).program.comp
    assert c and c.done.wait(300) and c.state == READY, getattr(c, "reason", c)
    it.run_batch([[m.REPLAY, 1, [1, 2], [11], []], [m.REPLAY, 1, [1, 3], [12], []]])
    assert c.hits == 1 and it.tensors[11].view(torch.float32).tolist()[:4] == [4.0, 5.0, 6.0, 7.0]
    assert 12 not in it.tensors and "IndexError: index out of range" in it.poison[12].error["message"]


@pytest.mark.timeout(600)
def test_torch_compile_graphs_replay_compiled_on_a_peer_started_with_compile() -> None:
    """torch.compile(backend="ember") on a session that asked: the forward and backward graphs AOTAutograd
    hands over (a transformer's: layer norms and their backward, attention, embeddings), which go out with the
    loss between them as one replayed group (two, split where the loss is read every step: forward and loss,
    then backward and the optimizer's step), are compiled by the peer and replayed through it, the backward's
    layer-norm steps included (checked once, at lowering: step_maker._layouts_pass); losses and parameters
    equal local CPU torch's within float tolerance."""
    import ember
    import ember.torch  # noqa: F401
    from ember.server import Server
    from ember.torch import workloads as W

    def train(device: str, steps: int) -> Any:
        torch.manual_seed(0)
        model = W.TinyLM().to(device)
        run = torch.compile(model, backend="ember") if device == "ember" else model
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(0)
        batch = W.lm_batch()
        losses = []
        for _ in range(steps):
            x, y = batch(g)
            out = run(x.to(device))
            loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.to(device).reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses, [p.detach().cpu() for p in model.parameters()]

    srv = Server(["torch:cpu"], compile=True)
    srv.listen_tcp("127.0.0.1", 0)
    addr = srv.start_in_thread()[0]
    try:
        with ember.connect(addr, compile=True):
            train("ember", 8)  # graphs registered, replayed, their compiles asked for
        for c in list(srv.compiler.cache.values()):
            assert c.done.wait(500), "the compile did not finish"
        before = srv.compiler.stats()
        longest = max(c.n_ops for c in srv.compiler.cache.values())
        with ember.connect(addr, compile=True):
            remote = train("ember", 8)
        after = srv.compiler.stats()
    finally:
        srv.close()
    assert before["ready"] >= 1 and after["replays"] - before["replays"] >= 6, (before, after)
    assert longest >= 20, longest  # a graph's prefix, not only its first steps
    local = train("cpu", 8)
    torch.testing.assert_close(remote[0], local[0], rtol=1e-4, atol=1e-4)
    for p, q in zip(remote[1], local[1]):
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-4)


def test_a_client_s_compiled_call_runs_while_an_in_process_peer_compiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """FX's "tracing" flag is one per process: while an in-process peer's compile thread traces a graph, the
    client's call of its torch.compile'd model in this very process runs as usual and gives eager's result,
    instead of raising "Detected that you are using FX to symbolically trace a dynamo-optimized function".
    The peer's compile is held inside its trace (the flag set, as make_fx sets it) while the client calls."""
    import threading

    import torch.fx._symbolic_trace as fx_trace
    from torch._inductor import compile_fx as inductor

    import ember
    import ember.torch  # noqa: F401
    from ember.server import Server
    from ember.torch import workloads as W

    tracing, release = threading.Event(), threading.Event()
    real = inductor.compile_fx

    def held_compile(gm: Any, examples: Any) -> Any:
        before = fx_trace._is_fx_tracing_flag
        fx_trace._is_fx_tracing_flag = True
        tracing.set()
        release.wait(120)
        fx_trace._is_fx_tracing_flag = before
        return real(gm, examples)
    monkeypatch.setattr(inductor, "compile_fx", held_compile)
    srv = Server(["torch:cpu"], compile=True)
    srv.listen_tcp("127.0.0.1", 0)
    addr = srv.start_in_thread()[0]
    try:
        with ember.connect(addr, compile=True), torch.no_grad():
            torch.manual_seed(0)
            model = W.MLP(16, 32, 4).to("ember")
            run, x = torch.compile(model, backend="ember"), torch.randn(8, 16).to("ember")
            calls = 0
            while not tracing.is_set() and calls < 50:  # (the peer asks for a compile once a graph has replayed)
                run(x).cpu()
                calls += 1
            assert tracing.wait(60), "the peer never compiled"
            got = run(x).cpu()  # the peer's thread is inside its trace now
            release.set()
            assert torch.equal(got, model(x).cpu())
    finally:
        release.set()
        for c in list(srv.compiler.cache.values()):  # (no compile left running into the next test)
            c.done.wait(300)
        srv.close()
