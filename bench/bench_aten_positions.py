"""Fuzz the operands a CPU ATen kernel may trust as memory positions, over the overloads a peer runs.

    python bench/bench_aten_positions.py [--ops max_pool2d,nn.functional.embedding] [--sizes] [--limit 4]

Every ATen call an embedded peer runs for PyTorch's OpInfo samples (forward, gradients, variants: what a
client sends, captured at ``AtenKernel.run``) is replayed on CPU with
each integer tensor operand filled with an out-of-range value (``2**20``, ``-2**20``) and, with ``--sizes``,
each tensor operand shrunk to one element. Each mutated call runs twice in a forked child: the bare CPU kernel
(does torch itself check? a crash, an error, or it ran) and the peer's position check then the kernel
(``ember.server.execute.positions``). A row is UNSAFE when the bare kernel crashed, or ran with an
out-of-range position-like operand, and the peer's check did not refuse it; such a row needs a check in
``positions.py``. Exit status 1 when any row is UNSAFE.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections import defaultdict
from typing import Any

os.environ.setdefault("EMBER_OFFLINE", "1")

import torch  # noqa: E402
from torch.utils._pytree import tree_map  # noqa: E402

from ember.server.execute import positions  # noqa: E402
from ember.server.execute.aten import refusal  # noqa: E402

POSITION_NAMES = {"indices", "index", "offsets", "lengths", "offset2bag", "bag_size", "maximum_indices", "target",
                  "targets", "input_lengths", "target_lengths", "pivots", "LU_pivots", "sorter", "repeats",
                  "random_samples", "batch_sizes", "sorted_indices", "unsorted_indices", "crow_indices",
                  "col_indices", "boundaries", "src_lengths"}
VALUES = (1 << 20, -(1 << 20))


class Capture:
    """Keeps the first ``limit`` calls of each overload a peer ran (arguments cloned)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.calls: dict[str, list[tuple[Any, list[Any], dict[str, Any]]]] = defaultdict(list)

    def __enter__(self) -> "Capture":
        from ember.server.execute import aten as peer_aten
        self._kernel, self._run = peer_aten.AtenKernel, peer_aten.AtenKernel.run
        cap, run = self, self._run

        def spy(kernel: Any, args: list[Any], kwargs: dict[str, Any], *rest: Any) -> Any:
            if len(cap.calls[kernel.name]) < cap.limit:
                clone = lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t  # noqa: E731
                cap.calls[kernel.name].append((kernel.op, tree_map(clone, list(args)), tree_map(clone, kwargs)))
            return run(kernel, args, kwargs, *rest)
        self._kernel.run = spy
        return self

    def __exit__(self, *exc: Any) -> None:
        self._kernel.run = self._run


def capture(names: set[str] | None, limit: int) -> Capture:
    """The ATen calls an embedded peer runs for the OpInfo samples (forward, gradients, variants): exactly
    the overloads and arguments a client sends."""
    import ember.torch  # noqa: F401 - the ember device and its embedded peer
    from ember.bench import opinfo as O
    with Capture(limit) as cap:
        for op in O.op_db():
            if names is not None and op.name not in names:
                continue
            for pass_ in ("forward", "grad", "variants"):
                if O.applies(op, pass_):
                    O.run_op(op, pass_, limit_s=30)
    return cap


def _in_child(fn: Any, timeout: int = 20) -> str:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(r)
        import faulthandler
        faulthandler.disable()  # a crash is the finding: reported by the parent, not dumped
        signal.alarm(timeout)
        try:
            fn()
            msg = "ran"
        except positions.PositionError:
            msg = "refused"
        except BaseException as e:  # noqa: BLE001
            msg = "error " + type(e).__name__
        os.write(w, msg.encode())
        os._exit(0)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    msg = os.read(r, 200).decode()
    os.close(r)
    if os.WIFSIGNALED(status):
        return f"CRASH signal {os.WTERMSIG(status)}"
    return msg or f"exit {os.WEXITSTATUS(status)}"


def mutations(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], sizes: bool) -> Any:
    """(operand name, mutation, args, kwargs) for each position-like or (with ``sizes``) any tensor operand."""
    schema = func._schema.arguments
    def read(a: Any) -> bool:  # an out= operand is overwritten: its values are no positions
        return a.alias_info is None or not a.alias_info.is_write
    named = [(a.name, i, False) for i, a in enumerate(schema) if not a.kwarg_only and i < len(args) and read(a)]
    named += [(a.name, a.name, True) for a in schema if a.name in kwargs and read(a)]
    for name, where, kw in named:
        t = kwargs[where] if kw else args[where]
        if not isinstance(t, torch.Tensor) or t.numel() == 0:
            continue
        muts = []
        if not (t.is_floating_point() or t.is_complex() or t.dtype is torch.bool):
            muts += [(f"fill {v}", torch.full_like(t, v)) for v in VALUES if torch.iinfo(t.dtype).min <= v]
        elif name == "random_samples":  # the one floating-point operand read as positions
            muts += [("fill nan", torch.full_like(t, float("nan"))), ("fill 1e9", torch.full_like(t, 1e9))]
        if sizes and t.numel() > 1:
            muts.append(("one element", t.reshape(-1)[:1].clone().reshape([1] * max(t.dim(), 1))))
        for what, m in muts:
            a2, k2 = list(args), dict(kwargs)
            if kw:
                k2[where] = m
            else:
                a2[where] = m
            yield name, what, tuple(a2), k2


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", default="", help="OpInfo names (comma-separated); default: the whole database")
    p.add_argument("--sizes", action="store_true", help="also shrink every tensor operand to one element")
    p.add_argument("--limit", type=int, default=2, help="calls kept per overload")
    p.add_argument("--all", action="store_true", help="print every row, not only the unsafe and the refused")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    cap = capture(set(a.ops.split(",")) if a.ops else None, a.limit)
    unsafe = rows = 0
    counts: dict[str, int] = defaultdict(int)
    for name, calls in sorted(cap.calls.items()):
        if refusal(name) is not None:
            continue
        check = positions.checker(calls[0][0])
        for func, args, kwargs in calls:
            for operand, what, a2, k2 in mutations(func, args, kwargs, a.sizes):
                bare = _in_child(lambda: func(*a2, **k2))
                if check is None:
                    peer = bare
                else:
                    peer = _in_child(lambda: (check(list(a2), k2), func(*a2, **k2)))
                rows += 1
                bad = peer.startswith("CRASH") or peer == "ran" and (
                    bare.startswith("CRASH") or operand in POSITION_NAMES and what.startswith("fill"))
                counts["unsafe" if bad else peer.split(" ")[0]] += 1
                unsafe += bad
                if bad or a.all or peer == "refused":
                    print(f"{'UNSAFE ' if bad else ''}{name} {operand} {what}: bare kernel {bare}; on a peer {peer}",
                          flush=True)
    print(f"{rows} mutated calls over {len(cap.calls)} overloads: " + ", ".join(f"{k} {v}" for k, v in
                                                                              sorted(counts.items())))
    return 1 if unsafe else 0


if __name__ == "__main__":
    sys.exit(main())
