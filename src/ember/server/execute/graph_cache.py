"""Op-graph caching, server side: a session's registered graphs, compiled once, in a bounded LRU.

A GRAPH message (see :mod:`ember.protocol.messages`) is validated and compiled
into a tuple of steps ``(fn, arg_registers, out_registers, kwargs, name,
tensor_registers, error)``: the op's callable is looked up once, the keyword
arguments are converted once (dtype names to backend dtypes, axis lists to
tuples) into a private copy that replays never mutate, except the offsets of its
*moving* layouts (GRAPH's optional ``moving``: input views a loop slices at a moving
position), which each REPLAY sets (:func:`set_offsets`). The interpreter runs
the steps over a register file (:meth:`Interpreter.replay`); on a torch device the graph's ATen
steps are lowered into a :class:`~ember.server.execute.program.Program` at its first replay. A
graph registered again unchanged (the same message bytes) keeps what it was lowered into.

The cache is a plain LRU: registering or replaying a graph makes it the most
recent; inserting past ``capacity`` evicts the least recent. Clients mirror
exactly this policy (they see the same sequence of GRAPH and REPLAY), which
lets them re-register an evicted graph before replaying it without a round
trip. Keep the two in step.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any, Callable

from ...errors import ProtocolError
from ...protocol import codec
from ...protocol import messages as m
from ...protocol.codec import safe_repr
from .backends import Backend
from .confine import kwargs_fault, scalar_fault

Step = tuple[Any, tuple[int, ...], tuple[int, ...], "dict[str, Any] | None", str, tuple[int, ...],
             "Exception | None"]


#: Registers (inputs + scalars + op outputs) of one graph, at most: a replay allocates its register file.
MAX_REGISTERS = 1 << 20
#: Bytes of compiled graphs one session's cache holds, at most (least recently used evicted first).
MAX_CACHE_BYTES = 64 << 20


class CompiledGraph:
    __slots__ = ("gid", "n_in", "scalars", "n_s", "steps", "kept", "consumed", "n_reg", "n_ops", "wire_bytes",
                 "replay_bytes", "saved", "nbytes", "program", "digest", "moving", "offsets", "writes_in")

    def __init__(self, gid: int, n_in: int, scalars: list[Any], steps: tuple[Step, ...], kept: tuple[int, ...],
                 consumed: tuple[int, ...], n_reg: int, nbytes: int = 0) -> None:
        self.gid = gid
        self.n_in = n_in
        self.scalars = scalars
        self.n_s = len(scalars)
        self.steps = steps
        self.kept = kept
        self.consumed = consumed
        self.n_reg = n_reg
        self.nbytes = nbytes  # an estimate of what the compiled graph occupies (charged to the session)
        self.n_ops = len(steps)
        self.wire_bytes = 0    # the GRAPH message's size (set by compile_graph)
        self.replay_bytes = 0  # a REPLAY's size, estimated (ids as 32-bit ints, no scalar overrides)
        self.saved = 0         # wire bytes one replay saves against sending the ops one by one
        self.program: Any = None  # its Program (lowered at the first replay), False when it has no fast step
        self.digest = b""      # the GRAPH message's hash: registered again unchanged, the graph is kept
        #: (step, operand, its layout in the step's private keyword arguments) per moving layout
        self.moving: tuple[tuple[int, int, list[Any]], ...] = ()
        self.offsets: list[int] = []  # their offsets as registered (a REPLAY's defaults)
        self.writes_in: tuple[int, ...] | None = None  # input positions it writes or consumes (server/read_ahead.py)

    def drop(self) -> None:
        """The graph left the cache: its program's cached views go (they hold storages of the session)."""
        if self.program:
            self.program.drop()


def digest(raw: bytes) -> bytes:
    """A GRAPH message's identity (its packed bytes' hash)."""
    return hashlib.blake2b(raw, digest_size=16).digest()


def _sizes(g: CompiledGraph, msg: list[Any], raw: bytes | None) -> None:
    """Telemetry's byte figures: the op messages a replay stands for are about the graph body's size."""
    raw = codec.packb(msg) if raw is None else raw
    g.wire_bytes = len(raw)
    g.digest = digest(raw)
    g.replay_bytes = len(codec.packb([m.REPLAY, g.gid, [0xFFFFFFFF] * g.n_in, 0xFFFFFFFF, []]))
    g.saved = max(0, len(codec.packb(msg[4])) - g.replay_bytes)


def _int(v: Any, what: str, lo: int = 0, hi: int | None = None) -> int:
    if type(v) is not int or v < lo or (hi is not None and v >= hi):
        raise ProtocolError(f"malformed Graph message: {what} is {v!r}")
    return v


def compile_graph(msg: list[Any], table: dict[str, Callable[..., Any]], backend: Backend,
                  raw: bytes | None = None) -> CompiledGraph:
    """Validate a GRAPH message and compile it; ProtocolError names what is malformed."""
    if len(msg) not in (7, 8):
        raise ProtocolError(f"malformed Graph message: {len(msg)} fields, expected 7 (or 8, with moving layouts)")
    _, gid, n_in, scalars, body, kept, consumed = msg[:7]
    _int(gid, "the graph id", 0, 1 << 64)
    _int(n_in, "the input count", 0, 1 << 20)
    if not isinstance(scalars, list) or not isinstance(body, list) or not isinstance(kept, list) \
            or not isinstance(consumed, list):
        raise ProtocolError("malformed Graph message: scalars, body, kept and consumed must be arrays")
    if len(body) > m.MAX_GRAPH_OPS:
        raise ProtocolError(f"graph of {len(body)} ops exceeds this peer's limit of {m.MAX_GRAPH_OPS}")
    bad = None if backend.kind == "torch" else scalar_fault(scalars, (1 << len(scalars)) - 1, backend.dtypes)
    if bad is not None:
        raise ProtocolError(f"malformed Graph message: {bad}")
    first_out = n_in + len(scalars)
    reg = first_out
    steps: list[Step] = []
    cost = 64 * len(scalars) + 8 * first_out
    for op in body:
        if not isinstance(op, list) or len(op) != 4:
            raise ProtocolError(f"malformed Graph op {safe_repr(op)}")
        name, regs, nouts, kwargs = op
        if not isinstance(name, str) or not isinstance(regs, list) or not (kwargs is None or isinstance(kwargs, dict)):
            raise ProtocolError(f"malformed Graph op {safe_repr(op)}")
        for r in regs:
            _int(r, f"a register of op {name[:40]!r}", 0, reg)
        _int(nouts, f"the output count of op {name[:40]!r}", 0, 1 << 16)  # 0: an in-place op
        if reg + nouts > MAX_REGISTERS:
            raise ProtocolError(f"graph of more than {MAX_REGISTERS} registers exceeds this peer's limit")
        cost += 256 + 8 * (len(regs) + nouts) + 64 * len(kwargs or ())
        err: Exception | None = None
        kw = None
        if kwargs:
            kw = dict(kwargs)  # private copy: the replay never sees a mutated body
            try:
                if "dtype" in kw and kw["dtype"] is not None:
                    kw["dtype"] = backend.dtype(kw["dtype"])
                if "axis" in kw and type(kw["axis"]) is list:
                    kw["axis"] = tuple(kw["axis"])
            except Exception as e:  # fails at run time, exactly like the op sent alone
                err = e
            bad = kwargs_fault(kw)
            if bad is not None:
                err = TypeError(bad)
        tregs = tuple(r for r in regs if not n_in <= r < first_out)
        steps.append((table.get(name), tuple(regs), tuple(range(reg, reg + nouts)), kw, name, tregs, err))
        reg += nouts
    for r in kept:
        _int(r, "a kept register", first_out, reg)
    for k in consumed:
        _int(k, "a consumed input", 0, n_in)
    g = CompiledGraph(gid, n_in, scalars, tuple(steps), tuple(kept), tuple(consumed), reg, cost + 8 * reg)
    if len(msg) == 8:
        _moving(g, msg[7])
    _sizes(g, msg, raw)
    if scalars:  # its literals (a list of millions of numbers...) are held as long as it is cached
        g.nbytes += 8 * len(codec.packb(scalars))
    return g


def _moving(g: CompiledGraph, moving: Any) -> None:
    """GRAPH's ``moving``, flat ``[step, operand, ...]``: each an ATen step's operand that is a graph input,
    whose layout's offset each REPLAY may set. The step gets a private copy of that layout to set it in."""
    if not isinstance(moving, list) or len(moving) % 2 or len(moving) > 2 * MAX_REGISTERS:
        raise ProtocolError("malformed Graph message: moving must be a flat [step, operand, ...] array")
    steps = g.steps
    out: list[tuple[int, int, list[Any]]] = []
    seen = set()
    for j in range(0, len(moving), 2):
        i = _int(moving[j], "a moving layout's step", 0, len(steps))
        _, regs, _, kw, name, _, _ = steps[i]
        lays = kw.get("l") if kw is not None else None
        if type(lays) is not list or len(regs) != 1 + len(lays):
            raise ProtocolError(f"malformed Graph message: step {i} ({name[:40]}) has no operand layouts to move")
        t = _int(moving[j + 1], f"a moving operand of step {i}", 0, len(lays))
        lay = lays[t]
        if regs[1 + t] >= g.n_in or not isinstance(lay, list) or len(lay) != 4 or type(lay[2]) is not int:
            raise ProtocolError(f"malformed Graph message: operand {t} of step {i} ({name[:40]}) is not an input "
                                "in a layout")
        if (i, t) in seen:
            raise ProtocolError(f"malformed Graph message: operand {t} of step {i} moves twice")
        seen.add((i, t))
        lays = kw["l"] = list(lays)  # (the step's keyword arguments are its own already: compile_graph)
        lay = lays[t] = list(lay)
        out.append((i, t, lay))
        g.offsets.append(lay[2])
    g.moving = tuple(out)
    g.nbytes += 64 * len(out)


def set_offsets(g: CompiledGraph, ovr: Any) -> list[int]:
    """A REPLAY's ``offsets`` (flat ``[index, offset, ...]``, the others as registered) set into the moving
    layouts of ``g``; returns every moving layout's offset for this replay."""
    offs = list(g.offsets)
    if not isinstance(ovr, list) or len(ovr) % 2:
        raise ProtocolError(f"malformed Replay of graph {g.gid}: offsets must be a flat [index, offset, ...] array")
    for j in range(0, len(ovr), 2):
        idx, off = ovr[j], ovr[j + 1]
        if type(idx) is not int or not 0 <= idx < len(offs) or type(off) is not int or not 0 <= off < 1 << 62:
            raise ProtocolError(f"Replay of graph {g.gid} sets offset {safe_repr(idx)} to {safe_repr(off)}; the "
                                f"graph moves {len(offs)} layouts, offsets are non-negative ints")
        offs[idx] = off
    for (_, _, lay), off in zip(g.moving, offs):
        lay[2] = off
    return offs


class GraphCache:
    """gid -> CompiledGraph, least recently used evicted first; bounded in count and in bytes.

    ``memory`` (a :class:`~ember.server.memory.SessionMemory`) is charged each entry's
    estimated size while it is cached (counted, not refused: the byte bound evicts instead).
    Evicting for bytes can make a client's mirror of the LRU disagree; the NEED_GRAPH
    round trip then restores the graph, so results never change.
    """

    def __init__(self, capacity: int, *, memory: Any = None, max_bytes: int = MAX_CACHE_BYTES) -> None:
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.memory = memory
        self.nbytes = 0
        self._d: OrderedDict[int, CompiledGraph] = OrderedDict()
        self.evictions = 0

    def get(self, gid: Any) -> CompiledGraph | None:
        g = self._d.get(gid)
        if g is not None:
            self._d.move_to_end(gid)
        return g

    def peek(self, gid: Any) -> CompiledGraph | None:
        """The graph, without making it the most recent (telemetry looks, the LRU does not move)."""
        return self._d.get(gid) if type(gid) is int else None

    def put(self, g: CompiledGraph) -> None:
        d = self._d
        old = d.pop(g.gid, None)
        if old is not None:
            self._account(-old.nbytes)
            if old is not g:
                old.drop()
        d[g.gid] = g
        self._account(g.nbytes)
        while len(d) > self.capacity or (self.nbytes > self.max_bytes and len(d) > 1):
            _, gone = d.popitem(last=False)
            self._account(-gone.nbytes)
            gone.drop()
            self.evictions += 1

    def _account(self, n: int) -> None:
        self.nbytes += n
        if self.memory is not None:
            if n > 0:
                self.memory.charge(n, "a graph-cache entry", strict=False)
            elif n < 0:
                self.memory.release(-n)

    def __len__(self) -> int:
        return len(self._d)

    def compiled_states(self) -> dict[str, int]:
        """How many of these graphs' compiled prefixes (:mod:`.compiled`) are pending, ready or failed."""
        out = {"pending": 0, "ready": 0, "failed": 0}
        for g in list(self._d.values()):  # (a copy: telemetry may look while the session's worker adds)
            c = g.program.comp if g.program else None
            if c:
                out[c.state] = out.get(c.state, 0) + 1
        return out

    def __contains__(self, gid: Any) -> bool:
        return gid in self._d

    def clear(self) -> None:
        for g in self._d.values():
            g.drop()
        self._d.clear()
        self._account(-self.nbytes)
