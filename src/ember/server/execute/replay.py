"""Running registered graphs (REPLAY), the NEED_GRAPH stall, and what an id holds when it has no value.

:class:`GraphReplay` is the part of the :class:`~ember.server.interpreter.Interpreter`
that executes GRAPH and REPLAY messages (see :mod:`ember.server.execute.graph_cache` for how a
graph is validated and compiled). It relies on the interpreter's state: ``tensors``,
``poison``, ``graphs``, ``mem``, ``_fp``, ``backend``, ``table``, ``custom_ops``,
``respond``, ``_stalled`` / ``_stall_gid`` and its ``put`` / ``forget`` /
``_set_poison`` / ``_reserve`` methods.
"""

from __future__ import annotations

from typing import Any, Callable

from ...errors import LimitExceeded, ProtocolError, to_wire
from ...protocol import messages as m
from ...protocol import codec
from ...protocol.codec import safe_repr
from .confine import scalar_fault
from .graph_cache import compile_graph, digest, set_offsets
from .program import Program
from .sizes import PREDICTED

#: A replay charges results below this size together, once they reach SLACK bytes: the budget check
#: per tiny op cost a quarter of a chain of tiny ops' throughput; the overshoot is at most SLACK.
SMALL_RESULT = 1 << 16
SLACK = 1 << 20


def written_of(fn: Any, operands: Any, kwargs: Any) -> list[Any]:
    """The operands (ids, or registers) a call of ``fn`` writes in place: ATen in-place and out=
    ops say which (``fn.written``); none for anything else, or for a call too malformed to tell."""
    w = getattr(fn, "written", None)
    if w is None:
        return []
    try:
        return [operands[p] for p in w(kwargs or {}) if p < len(operands)]
    except Exception:  # noqa: BLE001 - a malformed call fails in the op itself
        return []


def store_results(store: Any, outs: list[int], res: Any, name: str) -> None:
    """Put a multi-output op's results under their ids (or registers)."""
    if len(res) != len(outs):
        raise ValueError(f"{name} returned {len(res)} results for {len(outs)} outputs")
    for o, r in zip(outs, res):
        store[o] = r


class _Run:
    """One replay's running state: bytes charged for the register file, poison seen, inputs spoiled."""

    __slots__ = ("temps", "small", "bad", "spoiled", "ins", "n_in")

    def __init__(self, ins: list[Any], n_in: int) -> None:
        self.temps = 0  # bytes of results the register file holds (nominal sizes), released at the end
        self.small = 0  # bytes of small results not charged yet (at most SLACK)
        self.bad = False
        self.spoiled: dict[Any, Poison] = {}
        self.ins, self.n_in = ins, n_in


class Poison:
    """Why a tensor has no value."""

    __slots__ = ("error",)

    def __init__(self, error: dict[str, Any]) -> None:
        self.error = error


class Missing:
    """A replay input id the session does not hold (in a replay's register file)."""

    __slots__ = ("tid",)

    def __init__(self, tid: Any) -> None:
        self.tid = tid


class NeedGraph(Exception):
    """A REPLAY named a graph the cache does not hold."""

    def __init__(self, gid: Any) -> None:
        super().__init__(gid)
        self.gid = gid


#: Messages a stalled session (waiting for a GRAPH it asked for) holds, at most.
MAX_STALLED = 1 << 16
#: Bytes of upload data a stalled session may hold while it waits for a graph (then it ends).
MAX_STALLED_BYTES = 64 << 20


def describe(vals: list[Any]) -> str:
    """Input shapes and dtypes (scalars as bounded reprs) for an error message."""
    parts = []
    for v in vals[:16]:
        shape = getattr(v, "shape", None)
        parts.append(f"{tuple(shape)} {getattr(v, 'dtype', '')}".strip() if shape is not None else safe_repr(v))
    return ", ".join(parts) + (f", ... ({len(vals)} in all)" if len(vals) > 16 else "")


def describe_layouts(kwargs: Any) -> str:
    """An ATen call's operands as the client sees them (from its layouts), e.g. ``(4, 3) float32``."""
    try:
        return ", ".join(f"{tuple(lay[0])} {lay[3]}" for lay in kwargs["l"][:16]) if "l" in kwargs else ""
    except Exception:  # noqa: BLE001
        return ""


def call_text(name: str, vals: list[Any], kwargs: Any) -> str:
    """``zeros(shape=[20000, 20000], dtype=float64)``: an op call for a message."""
    args = describe(vals)
    if isinstance(kwargs, dict):
        kw = ", ".join(f"{k}={str(v).rsplit('.', 1)[-1].strip(chr(39) + '>') if k == 'dtype' else safe_repr(v, 60)}"
                       for k, v in list(kwargs.items())[:8] if k != "key")
        args = ", ".join(a for a in (args, kw) if a)
    return f"{name}({args})"


def limit_poison(name: str, spec: str, e: LimitExceeded) -> Poison:
    """The poison of an op refused by a limit (read back as LimitExceeded, with the hint)."""
    return Poison({"kind": "LimitExceeded", "op": name,
                   "message": f"op {name} refused on {spec}: {e.message}" + (f"\n  hint: {e.hint}" if e.hint else "")})


class GraphReplay:
    """GRAPH / REPLAY handlers and the stall while a REPLAY waits for its graph (a mixin of Interpreter)."""

    tensors: dict[Any, Any]
    poison: dict[Any, Poison]
    graphs: Any          # GraphCache
    mem: Any             # SessionMemory
    backend: Any         # Backend
    table: dict[str, Any]
    custom_ops: dict[str, Any]
    respond: Any
    _fp: Any
    _stalled: list[list[Any]] | None
    _stall_gid: Any
    _stalled_bytes: int
    probe: Any           # telemetry (server/telemetry/probe.py)
    label: str
    graph_hits: int
    replayed_ops: int
    graph_saved: int

    def _resume(self, batch: list[list[Any]]) -> list[list[Any]] | None:
        """Stalled: register the awaited GRAPH if this batch brings it, then run everything held, in order."""
        stalled, gid = self._stalled, self._stall_gid
        assert stalled is not None
        for msg in batch:
            if msg[0] == m.GRAPH and len(msg) > 1 and msg[1] == gid:
                out: list[list[Any]] = []
                self.graph(msg, out)
                if out:
                    self.respond(out)
                break
        else:
            stalled.extend(batch)
            self._stalled_bytes += sum(
                len(x[5]) for x in batch if x[0] == m.UPLOAD and len(x) == 7 and isinstance(x[5], (bytes, bytearray)))
            if len(stalled) > MAX_STALLED or self._stalled_bytes > MAX_STALLED_BYTES:
                self._stalled = None
                self._fatal(ProtocolError(
                    f"the session waited for graph {gid} past {MAX_STALLED} messages or {MAX_STALLED_BYTES} bytes "
                    "of uploads; the client never sent it"))
            return None
        self._stalled = self._stall_gid = None
        self._stalled_bytes = 0
        stalled.extend(batch)
        return stalled

    # ---- graphs ---------------------------------------------------------------------
    def graph(self, msg: list[Any], out: list[list[Any]]) -> None:
        """Register (or refresh) a graph. A malformed one is a client bug: a session-level error."""
        try:
            if not self.graphs.capacity:
                raise ProtocolError("this peer caches no graphs (graph_cache 0): send the ops themselves")
            raw = codec.packb(msg)
            old = self.graphs.peek(msg[1]) if len(msg) > 1 else None
            g = old if old is not None and old.digest == digest(raw) else compile_graph(msg, self.table, self.backend, raw)
        except ProtocolError as e:
            out.append([0, m.ERROR, to_wire(e)])
            self._fatal(e, answered=True)
            return
        evicted = self.graphs.evictions
        self.graphs.put(g)
        if self.graphs.evictions != evicted:
            self.probe.graph_evicted(self.label, self.graphs.evictions - evicted)

    def _fatal(self, e: ProtocolError, answered: bool = False) -> None:
        """A session-level error: the client is told (unless ``answered``) and the session ends
        once the batch's answers are out (``fatal``, read by the session after the batch)."""
        if getattr(self, "on_fatal", None) is None:  # no session to end (an interpreter on its own)
            if not answered:
                self.respond([[0, m.ERROR, to_wire(e)]])
            return
        self.fatal = (e, answered)

    def replay(self, msg: list[Any], out: list[list[Any]]) -> None:
        """Run a registered graph: the same ops, the same poisoning, as if each op had been sent.

        Memory: each step's results are charged (their nominal size) while the register file holds
        them, temporaries too; reservations are made exactly as for the op sent alone; the kept
        results are then charged by buffer as they are stored.
        """
        if len(msg) == 6:  # with moving layouts' offsets (GRAPH's moving)
            _, gid, ins, outs, scal, offs = msg
        else:
            _, gid, ins, outs, scal = msg
            offs = None
        if type(gid) is not int or not 0 <= gid < 1 << 64:
            raise ProtocolError(f"Replay names graph {safe_repr(gid)}: graph ids are 64-bit unsigned ints")
        g = self.graphs.get(gid)
        if g is None:
            if not self.graphs.capacity:
                raise ProtocolError("this peer caches no graphs (graph_cache 0): Replay is not available")
            raise NeedGraph(gid)
        if not isinstance(ins, list) or not isinstance(scal, list) or not isinstance(outs, (int, list)):
            raise ProtocolError(f"malformed Replay of graph {gid}")
        n_in = g.n_in
        if type(outs) is int:  # dense ids: output register r gets id outs + r - (first output register)
            first = outs - n_in - g.n_s
            outs = [first + r for r in g.kept]
        if len(ins) != n_in or len(outs) != len(g.kept) or len(scal) % 2:
            raise ProtocolError(f"Replay of graph {gid} binds {len(ins)} inputs and {len(outs)} outputs; "
                                f"the graph has {n_in} and {len(g.kept)}")
        self.graph_hits += 1
        self.replayed_ops += g.n_ops
        self.graph_saved += g.saved
        t, poison = self.tensors, self.poison
        R: list[Any] = [None] * g.n_reg
        st = _Run(ins, n_in)
        for k, i in enumerate(ins):
            v = t.get(i)
            if v is None:
                v = poison.get(i) or Missing(i)
                st.bad = True
            R[k] = v
        R[n_in:n_in + g.n_s] = g.scalars
        ovr = set()
        for j in range(0, len(scal), 2):
            idx = scal[j]
            if type(idx) is not int or not 0 <= idx < g.n_s:
                raise ProtocolError(f"Replay of graph {gid} overrides scalar {idx!r} of {g.n_s}")
            if self.backend.kind != "torch" and scalar_fault(scal, 2 << j, self.backend.dtypes) is not None:
                raise ProtocolError(f"Replay of graph {gid} overrides scalar {idx} with a {type(scal[j + 1]).__name__}")
            R[n_in + idx] = scal[j + 1]
            ovr.add(n_in + idx)
        moved = set_offsets(g, offs if offs is not None else []) if g.moving or offs else None
        prog = g.program
        if prog is None:  # lowered at the first replay: a graph never replayed costs nothing more
            prog = g.program = Program(g, self) if self._aten else False  # type: ignore[attr-defined]
            if prog and not prog.n_fast:
                prog = g.program = False
        try:
            if prog:
                prog.run(self, g, R, ovr, st, moved)
            else:
                step = self._step
                for i in range(g.n_ops):
                    step(g, i, R, st)
        finally:
            self.mem.release(st.temps)  # the kept results are charged again, by buffer, as they are stored
        for i, p in st.spoiled.items():
            self._set_poison([i], p)
        for reg, oid in zip(g.kept, outs):
            v = R[reg]
            if type(v) is Poison:
                self._set_poison([oid], v)
            else:
                try:
                    self.put(oid, v, "replay")
                except Exception as e:  # noqa: BLE001 - over a limit: poisoned like the op sent alone
                    self._set_poison([oid], self._replay_poison("replay", [v], e))
        for k in g.consumed:
            self.forget(ins[k])

    def _step(self, g: Any, i: int, R: list[Any], st: _Run) -> Poison | None:
        """Step ``i`` of graph ``g`` over the register file ``R``, as the op sent alone would run (its
        poison, or None). Each result is charged (its nominal size) while the register file holds it;
        reservations are made exactly as for the op sent alone."""
        fn, regs, oregs, kw, name, tregs, err = g.steps[i]
        mem = self.mem
        try:
            joins = False
            if st.bad:
                for r in tregs:
                    v = R[r]
                    if type(v) is Poison or type(v) is Missing:
                        if not getattr(fn, "joins_poisoned", False):
                            raise KeyError(v.tid if type(v) is Missing else name)
                        joins = True  # a collective joins its peers with zeros (collectives.py)
            if fn is None:
                raise KeyError(name)
            if err is not None:
                raise err
            args = [R[r] for r in regs]
            if joins:
                args = [None if type(a) is Poison or type(a) is Missing else a for a in args]
            reserved = self._reserve(name, args, kw) if name in PREDICTED else \
                self._reserve_unpredicted(name, args, kw)  # type: ignore[attr-defined]
            try:
                res = fn(*args, **kw) if kw else fn(*args)
            finally:
                if reserved:
                    mem.release(reserved)
            if len(oregs) == 1:
                n = getattr(res, "nbytes", 0)
                if n >= SMALL_RESULT:
                    mem.charge(n, (name, res))
                    st.temps += n
                elif n:  # small results are charged together, SLACK bytes at a time
                    st.small += n
                    if st.small >= SLACK:
                        n, st.small = st.small, 0
                        mem.charge(n, lambda: f"{name} and the small results before it in graph {g.gid}")
                        st.temps += n
                R[oregs[0]] = res
            else:
                store_results(R, oregs, res, name)
                n = sum(getattr(R[o], "nbytes", 0) for o in oregs)
                if n:
                    mem.charge(n, lambda: f"{name} outputs")
                    st.temps += n
            return None
        except Exception as e:
            p = self._replay_poison(name, [R[r] for r in tregs], e, kw)
            for o in oregs:
                R[o] = p
            for r in written_of(fn, regs, kw):  # in-place ops poison what they write
                R[r] = p
                if r < st.n_in:
                    st.spoiled[st.ins[r]] = p
            st.bad = True
            return p

    def _replay_poison(self, name: str, vals: list[Any], e: Exception, kw: Any = None) -> Poison:
        """What ``_fail`` would have made of this op sent alone (same message, same upstream poison)."""
        upstream = next((v for v in vals if type(v) is Poison), None)
        if upstream is not None:
            return upstream
        return self._op_poison(name, e, [v.tid for v in vals if type(v) is Missing],
                               lambda: describe_layouts(kw) or describe(["?" if type(v) is Missing else v for v in vals]))

    def _op_poison(self, name: str, e: Exception, missing: list[Any], desc: Callable[[], str]) -> Poison:
        """The poison of an op that failed with ``e`` (``missing``: its unknown input ids; ``desc``: its
        arguments in words), reported to telemetry."""
        if isinstance(e, LimitExceeded):
            p = limit_poison(name, self.backend.spec, e)
        else:
            msg = self._why(name, e, missing)  # type: ignore[attr-defined]
            p = Poison({"kind": "RemoteExecutionError", "op": name,
                        "message": f"op {name}({desc()}) failed on {self.backend.spec}: {msg}"})
        self.probe.error(self.label, p.error["kind"], type(e).__name__, name, p.error["message"], True)
        return p
