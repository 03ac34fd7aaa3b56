"""Peer CPU per replayed ATen op, sans I/O: a torch:cpu interpreter replays a chain of small ``aten.add.Tensor``.

    python bench/bench_peer_replay.py [--ops 200] [--replays 300] [--no-compile]

Prints thread CPU µs per replayed op with the graph lowered into a program (server/execute/program.py)
and without (the generic kernel per call), next to the kernel alone, measured in the same run (best of
5 rounds); and whether both replays gave the same bytes. Then a chain of 64 MiB results, program (its
intermediates in buffers kept across replays) vs generic: ms and page faults per op. Then the small
chain compiled by the peer
(server/execute/compiled.py, inductor) once the background compile is ready.
"""

from __future__ import annotations

import argparse
import resource
import time
from typing import Any

import torch

from ember.protocol import messages as m
from ember.server.execute.backends import make_backend
from ember.server.execute.interpreter import Interpreter, build_table


FAULTS: list[float] = []


def replay_cost(program: bool, n: int, replays: int, compiler: Any = None, numel: int = 16) -> tuple[float, Any]:
    """µs of thread CPU per replayed op, and the chain's result storage (``compiler``: replayed through
    the peer's compiled prefix once it is ready); ``numel`` floats per operand. Page faults per replayed
    op land in ``FAULTS``."""
    b = make_backend("torch:cpu")
    it = Interpreter(b, build_table(b), {}, lambda out: None,
                     {"max_frame": 1 << 26, "chunk": 1 << 24, "max_tensor": 1 << 40, "graph_cache": 4})
    lay = [[numel], [1], 0, "float32"]
    kw = {"a": [0, 0, 1], "l": [lay, lay], "o": [[0, [numel], [1], 0, "float32", 4 * numel]]}
    body = [["aten.add.Tensor", [2, 0 if i == 0 else 2 + i, 1], 1, kw] for i in range(n)]
    it.tensors.update({1: torch.zeros(4 * numel, dtype=torch.uint8), 2: torch.ones(numel).view(torch.uint8)})
    it.run_batch([[m.GRAPH, 1, 2, [[1]], body, [2 + n], []]])
    if not program:
        it.graphs.peek(1).program = False  # the generic replay: each step through its kernel's checks
    it.compiler = compiler
    msg = [m.REPLAY, 1, [1, 2], [10], []]
    for _ in range(10):
        it.replay(msg, [])
    if compiler is not None:
        c = it.graphs.peek(1).program.comp
        assert c and c.done.wait(600) and c.state == "ready", getattr(c, "reason", c)
    best = float("inf")
    f0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for _ in range(5):
        t = time.thread_time_ns()
        for _ in range(replays // 5):
            it.replay(msg, [])
        best = min(best, (time.thread_time_ns() - t) / (replays // 5) / n / 1e3)
    FAULTS.append((resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0) / (replays // 5 * 5) / n)
    return best, it.tensors[10].clone()


def _time(fn: Any, n: int = 4000) -> float:
    t = time.thread_time_ns()
    for _ in range(n):
        fn()
    return (time.thread_time_ns() - t) / n / 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", type=int, default=200)
    ap.add_argument("--replays", type=int, default=300)
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled replay (inductor)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    x, y, op = torch.zeros(16), torch.ones(16), torch.ops.aten.add.Tensor
    kernel = min(_time(lambda: op(x, y, alpha=1)) for _ in range(5))
    handle = min(_time(lambda: op._op(x, y, alpha=1)) for _ in range(5))  # the C++ handle, no Python wrapper
    generic, r0 = replay_cost(False, a.ops, a.replays)
    prog, r1 = replay_cost(True, a.ops, a.replays)
    print(f"per replayed aten.add.Tensor (16 floats), thread CPU: kernel alone {kernel:.2f} µs (its C++ handle "
          f"{handle:.2f} µs), generic "
          f"{generic:.2f} µs, program {prog:.2f} µs ({generic / prog:.2f}x; overhead beyond the kernel's handle "
          f"{prog - handle:.2f} µs); same bytes: {torch.equal(r0, r1)}")
    big = 1 << 24
    g_big, rg = replay_cost(False, 4, 10, numel=big)
    p_big, rp = replay_cost(True, 4, 10, numel=big)
    print(f"64 MiB results (4-step chain, 3 intermediates): generic {g_big / 1e3:.1f} ms and {FAULTS[-2]:.0f} page "
          f"faults per op, program {p_big / 1e3:.1f} ms and {FAULTS[-1]:.0f} (intermediates in buffers kept across "
          f"replays); same bytes: {torch.equal(rg, rp)}")
    if not a.no_compile:
        from ember.server.execute.compiled import Compiler
        comp = Compiler()
        compiled, r2 = replay_cost(True, a.ops, a.replays, comp)
        st = comp.stats()
        print(f"compiled (inductor, {a.ops} steps fused): {compiled:.2f} µs per replayed op "
              f"({prog / compiled:.1f}x the program); compile {st['compile_seconds']:.1f} s in the background, "
              f"{st['replays']} compiled replays; same values: {torch.allclose(r0.view(torch.float32), r2.view(torch.float32))}")


if __name__ == "__main__":
    main()
