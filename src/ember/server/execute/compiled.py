"""Compiled graphs on the peer (``Server(compile=True)``, ``ember serve --compile``; wire feature ``"compile"``).

A session that agreed on the feature replays its registered graphs through the peer's compiler: once a
graph's program (:mod:`.program`) has shown its first steps to be exact (trusted: vetted ATen calls
whose results need no check), the longest such prefix without writes, random draws or views made
between steps is built into an FX graph of those ATen overloads, and nothing else: the client's code
never runs on the peer, only vetted ATen ops with the template's literals. Inductor compiles it in a
background thread (C++/OpenMP on a CPU peer, Triton on a GPU); meanwhile, and whenever the compiled
prefix cannot serve a replay (an input poisoned or not a storage that holds its layout, a scalar of the
prefix overridden, an error inside it), the program replays eagerly. Compiled prefixes are cached per
process by the GRAPH message's hash and the device: a graph registered again, or by another session,
is compiled once. Results are the compiled kernels' (fused: equal to eager within float rounding, not
bit for bit), each stored in the layout its output spec names.
"""

from __future__ import annotations

import contextlib
import operator
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

PENDING, READY, FAILED = "pending", "ready", "failed"
#: A prefix shorter than this many steps is not worth a compile.
MIN_STEPS = 2
#: Compiled prefixes one peer process keeps (least recently added dropped first).
MAX_ENTRIES = 256


class Compiled:
    """One graph prefix: compiling, ready (``fn``), or failed (``reason``)."""

    __slots__ = ("state", "fn", "reason", "seconds", "p", "in_trs", "outs", "sregs", "hits", "done", "n_ops")

    def __init__(self, p: int, in_trs: list[int], outs: list[Any], sregs: set[int]) -> None:
        self.state, self.fn, self.reason, self.seconds, self.hits = PENDING, None, "", 0.0, 0
        self.p, self.in_trs, self.outs, self.sregs, self.n_ops = p, in_trs, outs, sregs, p
        self.done = threading.Event()

    def run(self, prog: Any, V: list[Any]) -> int:
        """Run the compiled prefix over the typed registers ``V``: how many steps it stood for (0: it
        could not serve this replay; the program runs them)."""
        args = [V[tr] for tr in self.in_trs]
        if any(a is None for a in args):  # (not `None in`: tensor == None raises inside torch, slowly)
            return 0
        try:
            outs = self.fn(*args)
        except Exception:  # noqa: BLE001 - e.g. an index out of range: the eager steps say what is wrong
            return 0
        torch = prog.torch
        seen = {t.untyped_storage().data_ptr() for t in args}  # an output sharing memory is copied
        for (tro, size, stride, off, dt, nb, d), r in zip(self.outs, outs):
            st = r.untyped_storage()
            ptr = st.data_ptr()
            if not (r.dtype is dt and r.shape == size and r.stride() == stride and r.storage_offset() == off
                    and st.nbytes() == nb and (ptr not in seen or not nb)):  # as the spec says, its own memory
                buf = torch.zeros(nb, dtype=torch.uint8, device=r.device)
                t = torch.empty((0,), dtype=dt, device=r.device).set_(buf.untyped_storage(), off, size, stride)
                t.copy_(r)
                r = t
            seen.add(r.untyped_storage().data_ptr())
            V[tro] = r
            if d:
                prog._derive(V, r, d)
        self.hits += 1
        return self.p


_fx = {"compiles": 0}  # compiles under way in this process (each traces its graph with FX)
_fx_lock = threading.Lock()
_fx_here = threading.local()  # ``on``: this thread is one of them


@contextlib.contextmanager
def _tracing_with_fx() -> Iterator[None]:
    """While a compile traces its graph with FX (see :func:`_fx_flag_per_thread`)."""
    with _fx_lock:
        _fx["compiles"] += 1
    _fx_here.on = True
    try:
        yield
    finally:
        _fx_here.on = False
        with _fx_lock:
            _fx["compiles"] -= 1


def _fx_flag_per_thread() -> None:
    """FX's "symbolically tracing" flag is one per process. While a peer's compile thread traces a graph, a client
    of that peer in the same process (the embedded peer, a test's in-thread server) that calls its
    ``torch.compile``'d model would get "Detected that you are using FX to symbolically trace a dynamo-optimized
    function". So Dynamo's view of the flag leaves out the traces of this process's compile threads, seen from
    any other thread. (Dynamo reads the predicate when ``torch.compile`` wraps a function: models compiled
    before the first peer with compiled graphs was made in this process keep torch's own.)"""
    import torch.fx._symbolic_trace as fx_trace
    torch_s = fx_trace.is_fx_symbolic_tracing
    if getattr(torch_s, "_ember", False):
        return

    def is_fx_symbolic_tracing() -> bool:
        return torch_s() and not (_fx["compiles"] and not getattr(_fx_here, "on", False))
    is_fx_symbolic_tracing._ember = True  # type: ignore[attr-defined]
    fx_trace.is_fx_symbolic_tracing = is_fx_symbolic_tracing


class Compiler:
    """A peer's compiled prefixes (one per Server with ``compile=True``), compiled by one background thread."""

    def __init__(self) -> None:
        self.cache: dict[tuple[bytes, str], Compiled] = {}
        self.lock = threading.Lock()
        self.pool: ThreadPoolExecutor | None = None
        self.compiles = self.failures = 0
        self.compile_seconds = 0.0
        _fx_flag_per_thread()

    def stats(self) -> dict[str, Any]:
        with self.lock:
            hits = sum(c.hits for c in self.cache.values())
            ready = sum(1 for c in self.cache.values() if c.state == READY)
        return {"compiled": self.compiles, "failed": self.failures, "ready": ready, "replays": hits,
                "compile_seconds": round(self.compile_seconds, 3)}

    def lookup(self, prog: Any, g: Any) -> Compiled | None:
        """The compiled prefix of ``g`` (compiling it in the background if new), or None: nothing to compile."""
        key = (g.digest, str(prog.device))
        with self.lock:
            c = self.cache.get(key)
        if c is not None:
            return c
        plan = prefix(prog, g)
        if plan is None:
            return None
        p, in_trs, outs, sregs, gm, examples = plan
        c = Compiled(p, in_trs, outs, sregs)
        with self.lock:
            if key in self.cache:
                return self.cache[key]
            while len(self.cache) >= MAX_ENTRIES:
                self.cache.pop(next(iter(self.cache)))
            self.cache[key] = c
            if self.pool is None:
                self.pool = ThreadPoolExecutor(1, thread_name_prefix="ember-compile")
        self.pool.submit(self._compile, c, gm, examples)
        return c

    def _compile(self, c: Compiled, gm: Any, examples: list[Any]) -> None:
        import torch
        t = time.perf_counter()
        try:
            from torch._inductor import config
            from torch._inductor.compile_fx import compile_fx
            # indices are checked in the kernels (an out-of-range one raises: the replay runs eagerly)
            with torch.no_grad(), config.patch({"assert_indirect_indexing": True}), _tracing_with_fx():
                fn = compile_fx(gm, examples)
                fn(*examples)  # the first call finishes loading the kernels
            c.fn, c.state = fn, READY
        except Exception as e:  # noqa: BLE001 - the eager program serves the graph
            c.reason, c.state = f"{type(e).__name__}: {str(e)[:300]}", FAILED
        c.seconds = time.perf_counter() - t
        with self.lock:
            self.compile_seconds += c.seconds
            if c.state == READY:
                self.compiles += 1
            else:
                self.failures += 1
        c.done.set()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)


def build(prog: Any, steps: list[Any], in_trs: list[int], in_lays: dict[int, Any], outs: list[int],
          views: dict[int, tuple[int, Any, int, Any]]) -> Any:
    """The FX graph of ``steps`` (fast steps of ``prog``): placeholders for ``in_trs``, the ATen overloads
    with the templates' literals and scalars, ``views`` (typed register -> (the contiguous result it views,
    its layout, the result's numel, the order of its dims in memory)) as ``aten.view`` or ``aten.as_strided``
    of the result (of a contiguous copy of it in its memory order, where that is not its logical order), an output per typed register of ``outs``."""
    import torch
    graph = torch.fx.Graph()
    env: dict[Any, Any] = {tr: graph.placeholder(f"in{j}") for j, tr in enumerate(in_trs)}

    def val(fs: Any, p: tuple[str, Any]) -> Any:
        kind, x = p
        if kind == "t":
            return env[fs.trs[x]]
        if kind == "s":
            return fs.baked[x]
        if kind == "l":
            return [val(fs, q) for q in x]
        return x

    aten = torch.ops.aten
    for fs in steps:
        for tr in fs.trs:
            if tr not in env and tr in views:
                src, (size, stride, off, _), n, order = views[tr]
                base = env[src]
                if list(order) != sorted(order):  # memory order: a fresh contiguous buffer of the same bytes
                    key = ("dense", src)
                    if key not in env:
                        env[key] = graph.call_function(aten.clone.default, (
                            graph.call_function(aten.permute.default, (base, list(order))),),
                            {"memory_format": torch.contiguous_format})
                    base = env[key]
                numel = 1
                for d in size:
                    numel *= d
                if off == 0 and tuple(stride) == _contiguous(size) and numel == n:
                    env[tr] = graph.call_function(aten.view.default, (base, list(size)))
                else:
                    env[tr] = graph.call_function(aten.as_strided.default, (base, list(size), list(stride), off))
        node = graph.call_function(fs.kernel.op, tuple(val(fs, p) for p in fs.plan),
                                   {n: val(fs, p) for n, p in fs.kwplan.items()})
        for idx, tro, _ in fs.touts:
            env[tro] = node if idx < 0 else graph.call_function(operator.getitem, (node, idx))
    graph.output(tuple(env[tr] for tr in outs))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    examples = []
    for tr in in_trs:
        (size, stride, off, dt), need = in_lays[tr]
        buf = torch.zeros(max(need, 1), dtype=torch.uint8, device=prog.device)
        examples.append(torch.empty((0,), dtype=prog.aten.DTYPES[dt], device=prog.device)
                        .set_(buf.untyped_storage(), off, size, stride))
    return gm, examples


def prefix(prog: Any, g: Any) -> Any:
    """What to compile of ``prog`` (a :class:`~.program.Program`): the longest prefix of trusted steps
    that write nothing, draw nothing and read inputs' views, earlier results, or views of earlier dense
    results, as
    ``(steps, input typed registers, outputs, scalar registers, FX graph, example inputs)``; None
    when it is shorter than ``compiled.MIN_STEPS``."""
    inputs = {tr: (lay, need) for lst in prog.in_lays.values() for tr, lay, need in lst}
    derived = {tr: (prog.prod[r], lay) for r, lst in prog.derive.items() for tr, lay, _ in lst}
    extent = {tr: need for lst in prog.derive.values() for tr, _, need in lst}
    dense: dict[int, Any] = {}  # results laid out densely from offset 0: the dims' order in memory
    produced: set[int] = set()
    in_trs: list[int] = []
    views: dict[int, tuple[int, Any, int, Any]] = {}
    numel: dict[int, int] = {}
    steps: list[Any] = []
    for fs in prog.fast:
        if fs is None or not fs.trusted or fs.wtrs or fs.fc is None or fs.vcheck is not None \
                or not _draws_nothing(fs):  # (a step that checks operand values at every call stays eager)
            break
        new = [tr for tr in dict.fromkeys(fs.trs) if tr not in produced and tr not in in_trs and tr not in views]
        if any(tr not in inputs and not _viewable(prog, tr, derived, dense, numel, extent) for tr in new):
            break  # a view the compiled graph cannot make as eager does: it stops before it
        in_trs += [tr for tr in new if tr in inputs]
        views.update((tr, (*derived[tr], numel[derived[tr][0]], dense[derived[tr][0]])) for tr in new
                     if tr not in inputs)
        steps.append(fs)
        for (_, size, stride, off, dt, _, _), tro, _ in fs.outs:
            produced.add(tro)
            numel[tro] = size.numel()
            order = _dense_order(size, stride) if off == 0 else None
            if order is not None:
                dense[tro] = order
    p = len(steps)
    if p < MIN_STEPS:
        return None
    needed = {r for s in g.steps[p:] for r in s[1]} | set(g.kept)
    outs = []
    for fs in steps:
        for (_, size, stride, off, dt, nb, _), tro, oreg in fs.outs:
            if oreg in needed:
                outs.append((tro, size, stride, off, dt, nb, prog.derive.get(oreg)))
    gm, examples = build(prog, steps, in_trs, inputs, [o[0] for o in outs], views)
    return p, in_trs, outs, {fs.sreg for fs in steps}, gm, examples


def _viewable(prog: Any, tr: int, derived: Any, dense: Any, numel: Any, extent: Any) -> bool:
    """Can the compiled graph make typed register ``tr`` (a view of an earlier result) as eager does:
    a dense result of the same dtype, the view inside its bytes (as_strided checks no bounds)."""
    if tr not in derived:
        return False
    src, lay = derived[tr]
    dt = _dtype_of(prog, src)
    return src in dense and prog.aten.DTYPES[lay[3]] is dt and extent[tr] <= numel[src] * dt.itemsize

def _dtype_of(prog: Any, tro: int) -> Any:
    for fs in prog.fast:
        if fs is not None:
            for (_, _, _, _, dt, _, _), t, _ in fs.outs:
                if t == tro:
                    return dt
    return None


def _contiguous(size: Any) -> tuple[int, ...]:
    out, n = [], 1
    for d in reversed(list(size)):
        out.append(n)
        n *= max(d, 1)
    return tuple(reversed(out))


def _dense_order(size: Any, stride: Any) -> tuple[int, ...] | None:
    """The permutation of dims that lays ``size``/``stride`` out contiguously (outermost first), or None
    when the layout is not dense (gaps, overlaps, broadcast)."""
    order = tuple(sorted(range(len(size)), key=lambda d: (-stride[d], d)))
    if tuple(stride[d] for d in order) != _contiguous([size[d] for d in order]):
        return None
    return order


def _draws_nothing(fs: Any) -> bool:
    """A step that takes no random stream: not a random op, or attention with ``dropout_p`` 0."""
    if fs.kernel.draw is None:
        return True
    names = [a.name for a in fs.kernel.op._schema.arguments]
    if "dropout_p" not in names:
        return False
    j = names.index("dropout_p")
    p = fs.plan[j] if j < len(fs.plan) else fs.kwplan.get("dropout_p", ("c", 0.0))
    v = p[1] if p[0] == "c" else fs.baked[p[1]] if p[0] == "s" and fs.baked is not None else None
    return type(v) in (int, float) and v == 0


__all__ = ["Compiler", "Compiled", "build", "prefix", "PENDING", "READY", "FAILED"]
