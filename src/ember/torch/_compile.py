"""``torch.compile(model, backend="ember")``: a compiled graph's ATen ops recorded once, then replayed.

Eager ember code pays Python dispatch for every ATen op (schema walk, plan lookup, message,
output tensors: ~25-40 µs on the client). Under this backend Dynamo captures the model and
AOTAutograd hands over functional forward and backward graphs; each graph's first call on a
given input layout runs it through the ordinary dispatch while the session's messages are
*captured*; later calls with the same layouts build the outputs from the captured layouts,
with no per-op dispatch, and send either

* the captured messages again, with fresh storage ids (inputs substituted, intermediates
  dropped at the end): a training step's forward and backward graphs, into the session's op
  group, with the eager ops between them (the loss): the optimizer's step or the next upload ends
  the group, which goes out
  as one ``REPLAY`` (:mod:`ember.client.graph`), so the tensors the forward saves for the
  backward never get an id on the peer. (Inside ``ember.torch.capture``, every graph's
  messages go into the capture's graph.) Or
* one ``REPLAY`` of the captured graph, sent at once: an inference graph, a forward or backward
  with more ops than the op group has room for, or one in a loop that reads a value about every
  step (``loss.item()``), where a held group would start on the peer only at the read, and a
  graph of its own lets the peer run the forward while the client runs the backward's Python.

Either way the peer runs the same ops on the same data as eager, so results are bit-equal to eager.

A graph whose capture did anything but record ATen ops (a read or other round trip, an upload,
a reseed after ``torch.manual_seed``) is captured again on its next call, and after a few tries
runs eagerly for good: the backend never changes what a program computes, only how fast the
client records it. The backend is found by name through the ``torch_dynamo_backends`` entry
point (``pip install`` registers it), or pass :func:`compiler` itself.
"""

from __future__ import annotations

import operator
import threading
from typing import Any, Callable

import torch

from ..client.graph import canon
from ..protocol import messages as m
from ._capture import recording
from ._devices import apply_seed, materialize
from ._storage import StorageRef, live_session, ref_or_none

# (the replay makes its outputs as _storage.new_tensor does, with "meta in TLS" set once for all of them)
_create = torch._C._acc.create_empty_tensor
_meta_tls = torch._C._set_meta_in_tls_dispatch_include

_OP = m.OP
TRIES = 3  # captures per layout before a graph runs eagerly for good
#: graphs captured, calls replayed, calls run eagerly (not replayable, or tried too often)
stats = {"captures": 0, "replays": 0, "eager": 0}


class _Trace:
    """One capture: the messages, which sids were the inputs', and how to rebuild the outputs; and, once
    registered, the graph a call replays (``graph``: None until tried, False when it cannot be one). A trace is
    one session's (its key holds the session): so is what it learned of that session's loop (``_joining``)."""

    __slots__ = ("messages", "inputs", "fresh", "kept", "outputs", "graph", "reads", "synced", "paused")

    def __init__(self, messages: list[list[Any]], inputs: list[int], fresh: list[int], kept: list[Any],
                 outputs: list[tuple[Any, ...]]) -> None:
        self.messages, self.inputs, self.fresh, self.kept, self.outputs = messages, inputs, fresh, kept, outputs
        self.graph: Any = None
        self.reads = -1  # the session's reads at the last call
        self.synced = 0.0  # how often a value was read between two calls (a moving average)
        self.paused = False  # joining the op group paused: the loop reads a value about every step


class _Graph:
    """A trace as one registered graph: REPLAY inputs (``in_pos``: the position of each among the call's ember
    inputs, or ``~sid`` of a kept storage), kept outputs (recorded sids) and the fresh storages a replay names
    (the outputs', and those the call's outputs are on)."""

    __slots__ = ("entry", "n_ops", "in_pos", "outs", "fresh", "over")

    def __init__(self, entry: Any, c: Any, t: _Trace) -> None:
        self.entry, self.n_ops = entry, len(c.shape)
        pos = {sid: j for j, sid in enumerate(t.inputs)}
        self.in_pos = [pos[x] if x in pos else ~x for x in c.inputs]
        self.outs = [t.fresh[s] for s in c.kept]
        self.fresh = list(dict.fromkeys([*self.outs, *(o[1] for o in t.outputs if o[0] == "fresh")]))
        self.over = entry.overrides(c.scalars)


def _as_graph(t: _Trace, session: Any) -> Any:
    """The trace's graph on this session (intermediates never get an id), or False."""
    outs = {o[1] for o in t.outputs if o[0] == "fresh"}
    c = canon(t.messages, set(t.fresh) - outs)
    entry = session.graph_entry(c) if c is not None else None
    return False if entry is None else _Graph(entry, c, t)


def _replayable(msgs: list[list[Any]]) -> bool:
    for msg in msgs:
        if msg[0] != _OP or not isinstance(msg[1], str) or not (msg[1].startswith("aten.") or msg[1] == "torch.alloc"):
            return False
        args = msg[2]
        if msg[1] == "torch.alloc":
            if args:
                return False
        elif not args or not isinstance(args[0], list) or not all(type(a) is int for a in args[1:]):
            return False
        if not all(type(o) is int for o in msg[4]):
            return False
    return True


class Replayer:
    """The compiled form of one AOT graph (forward, backward or inference)."""

    def __init__(self, gm: torch.fx.GraphModule, joins: bool = False) -> None:
        self.gm = gm
        self.joins = joins  # a training step's forward or backward: its ops may join the session's op group
        self.traces: dict[Any, _Trace | int] = {}  # layout key -> trace, or the captures tried so far

    def __call__(self, *args: Any) -> Any:
        refs = [ref_or_none(a) for a in args]
        if any(r is None for r, a in zip(refs, args) if isinstance(a, torch.Tensor)) or not any(refs):
            stats["eager"] += 1  # a CPU tensor among the inputs (or no ember one): as eager
            return self.gm(*args)
        first = next(r for r in refs if r is not None)
        session = first.session
        key = _key(args, refs, session)
        if key is None:
            stats["eager"] += 1
            return self.gm(*args)
        for r in refs:
            if r is not None and r.pending is not None:
                materialize(r)
        t = self.traces.get(key, 0)
        if isinstance(t, _Trace):
            return self._replay(t, args, refs, first)
        if t >= TRIES:
            stats["eager"] += 1
            return self.gm(*args)
        out, trace = self._capture(args, refs, session)
        self.traces[key] = trace if trace is not None else t + 1
        return out

    def _capture(self, args: tuple[Any, ...], refs: list[StorageRef | None], session: Any) -> Any:
        msgs: list[list[Any]] = []
        real, me = session.record, threading.get_ident()

        def capturing(msg: list[Any]) -> None:
            if threading.get_ident() == me:  # (another thread's ops on this session are not the graph's)
                msgs.append(msg)
            real(msg)
        outer = session.__dict__.get("record")  # (an ember.torch.capture recording around this call)
        session.record = capturing
        st = session.stats
        asked = st["requests"], st["known_reads"]
        try:
            out = self.gm(*args)
        finally:
            if outer is None:
                del session.record
            else:
                session.record = outer
        # A graph that read a value while it ran (a custom op's ``offs.tolist()``: Hugging Face's MoE under
        # torch.compile) made ops that depend on it: its messages are not the next call's. Not a trace.
        read = (st["requests"], st["known_reads"]) != asked
        trace = None if read else self._trace(msgs, out, refs, session)
        stats["captures" if trace is not None else "eager"] += 1
        return out, trace

    def _trace(self, msgs: list[list[Any]], out: Any, refs: list[StorageRef | None], session: Any) -> _Trace | None:
        if not _replayable(msgs) or not isinstance(out, (list, tuple)):
            return None
        inputs = [r.sid for r in refs if r is not None]
        fresh = [o for msg in msgs for o in msg[4]]
        made = set(fresh)
        if len(made) != len(fresh) or made & set(inputs):
            return None
        kept: list[Any] = []  # storages neither input nor fresh that the messages use (graph constants)
        outputs: list[tuple[Any, ...]] = []
        for o in out:
            if not isinstance(o, torch.Tensor):
                if o is None or type(o) in (int, float, bool):  # (an int: a size a dynamic-shape forward saves
                    outputs.append(("value", o))  # for its backward; the key holds every input's shape: a constant)
                else:
                    return None  # anything else: run eagerly rather than guess
                continue
            r = ref_or_none(o)
            if r is None or r.pending is not None or r.session is not session:
                return None
            layout = (o.dtype, tuple(o.shape), tuple(o.stride()), o.storage_offset(), o.requires_grad)
            if r.sid in made:
                outputs.append(("fresh", r.sid, *layout))
            elif r.sid in inputs:
                outputs.append(("input", inputs.index(r.sid), *layout))
            else:
                kept.append(o.untyped_storage())
                outputs.append(("kept", len(kept) - 1, *layout))
        used = {a for msg in msgs for a in msg[2][1:]}
        known = made | set(inputs) | {getattr(s, "_ember").sid for s in kept}
        held = _constants(self.gm, session)
        if not used - known <= held.keys():  # a storage from outside the graph, neither an output nor a constant
            return None  # the graph holds: not ours to hold
        kept.extend(held[sid] for sid in sorted(used - known))  # (the graph's constants: named by the replay)
        return _Trace(msgs, inputs, fresh, kept, outputs)

    def _replay(self, t: _Trace, args: tuple[Any, ...], refs: list[StorageRef | None], first: StorageRef) -> Any:
        session = live_session(first)
        apply_seed(session)  # torch.manual_seed since the last random op: as eager, before this graph's
        ids = session.ids
        for s in t.kept:
            live_session(s._ember)
        # One REPLAY of this graph alone; or its ops: into ember.torch.capture's graph, or (a training step's
        # forward and backward) into the session's op group where that has room for them. The step's graphs and
        # the eager ops between them then go out as one replayed group, and what the forward hands the backward
        # (its saved tensors) never gets an id on the peer.
        graphed = False
        if not recording() and not (self.joins and _joining(t, session) and len(t.messages) <= session.group_room()):
            if t.graph is None:
                t.graph = _as_graph(t, session)
            graphed = bool(t.graph)
        g = t.graph
        cur = [r.sid for r in refs if r is not None]
        if graphed:
            new = {f: next(ids) for f in g.fresh}  # (ids for its outputs only: intermediates never get one)
            session.replay_graph(g.entry, g.n_ops, [cur[x] if x >= 0 else ~x for x in g.in_pos],
                                 [new[o] for o in g.outs], g.over)
        else:
            new = {f: next(ids) for f in t.fresh}
            sub = dict(zip(t.inputs, cur))
            sub.update(new)
            for s in t.kept:
                sub[s._ember.sid] = s._ember.sid
            record = session.record
            for msg in t.messages:
                a = msg[2]
                record([msg[0], msg[1], [a[0], *[sub[x] for x in a[1:]]] if a else a, msg[3],
                        [new[o] for o in msg[4]], msg[5]])
        outs = _outputs(t, new, session, first.device, [a for a, r in zip(args, refs) if r is not None])
        if not graphed:
            made = {o[1] for o in t.outputs if o[0] == "fresh"}
            for f, sid in new.items():
                if f not in made:
                    session.release(sid)  # an intermediate: freed on the peer after the ops that use it
        stats["replays"] += 1
        return outs


def _constants(gm: torch.fx.GraphModule, session: Any) -> dict[int, Any]:
    """The ember tensors a graph holds as attributes (its ``get_attr`` nodes: a ``torch.tensor([])`` made in the
    forward, as Hugging Face's KV cache makes, lifted by AOTAutograd), by storage id: a replay names their
    storages as it names its inputs'. Without them such a graph ran op by op on every call."""
    held: dict[int, Any] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            v = operator.attrgetter(node.target)(gm)
            r = ref_or_none(v)
            if r is not None and r.pending is None and r.session is session:
                held[r.sid] = v.untyped_storage()
    return held


def _joining(t: _Trace, session: Any) -> bool:
    """Does this call of ``t``'s graph join the op group? Not in a loop that reads a value about every step that the
    end of the step writes (``torch.isnan(loss).item()`` after the backward): a held group starts on the peer
    only at the read, where this graph's own REPLAY starts at once (the peer runs the forward while this thread
    runs the loss and the backward's Python). A read of a value that the rest of the step only reads (the loss
    after the optimizer's step) does not count: the session answers it before the rest (``_split_for_read``).
    Decided on a moving average with hysteresis, so that a read every few steps does not switch it back and
    forth."""
    st = session.stats
    reads = st.get("reads", 0) - st.get("split_reads", 0)  # (a read the peer answers before the rest of the
    #                                                        held step, client/grouping.py, does not count)
    t.synced = 0.75 * t.synced + (0.25 if reads != t.reads else 0.0)
    t.reads = reads
    if t.synced > 0.6:
        t.paused = True
    elif t.synced < 0.3:
        t.paused = False
    return not t.paused


def _outputs(t: _Trace, new: dict[int, int], session: Any, device: Any, inputs: list[Any]) -> list[Any]:
    """The replay's outputs in the captured layouts: on the fresh storages ``new`` names (one storage per id),
    on an input's storage, or on a kept one."""
    storages: dict[int, Any] = {}
    outs: list[Any] = []
    _meta_tls(True)
    try:
        for o in t.outputs:
            kind = o[0]
            if kind == "value":
                outs.append(o[1])
                continue
            dtype, size, stride, offset, grad = o[2:]
            x = _create((0,), dtype)
            if kind == "fresh":
                sid = new[o[1]]
                st = storages.get(sid)
                if st is None:
                    st = storages[sid] = x.untyped_storage()
                    st._ember = StorageRef(sid, session, device)
            elif kind == "input":
                st = inputs[o[1]].untyped_storage()
            else:
                st = t.kept[o[1]]
            x.set_(st, offset, size, stride)
            outs.append(x.requires_grad_() if grad else x)
    finally:
        _meta_tls(False)
    return outs


def _key(args: tuple[Any, ...], refs: list[StorageRef | None], session: Any) -> Any:
    """The layouts, dtypes and storage sharing of the inputs (None: not all on one session)."""
    parts: list[Any] = [id(session)]
    first: dict[int, int] = {}
    for k, (a, r) in enumerate(zip(args, refs)):
        if r is None:
            if isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                return None
            parts.append(a if isinstance(a, (int, float, bool, type(None))) else type(a))
            continue
        if r.session is not session:
            return None
        parts.append((a.dtype, a.shape, a.stride(), a.storage_offset(), a.requires_grad, first.setdefault(r.sid, k)))
    return tuple(parts)


def compiler(gm: torch.fx.GraphModule, example_inputs: list[Any], **_options: Any) -> Callable[..., Any]:
    """The Dynamo backend (``torch.compile(model, backend="ember")``, or pass this function). ``mode=`` and
    ``options=`` (inductor's: ``"reduce-overhead"``'s CUDA graphs...) are accepted and ignored, as ``aot_eager``
    does: every mode replays the recorded graph."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from ._rng import install_compiled
    install_compiled()  # (a checkpointed region's random ops: their kernels for ember)

    def training_graph(g: torch.fx.GraphModule, _inputs: list[Any]) -> Callable[..., Any]:
        return make_boxed_func(Replayer(g, joins=True))

    def inference_graph(g: torch.fx.GraphModule, _inputs: list[Any]) -> Callable[..., Any]:
        return make_boxed_func(Replayer(g))
    # (an inference graph that writes its inputs, as a compiled optimizer step does, keeps those writes in
    # the graph: replayed in place on the peer rather than copied back op by op on the client)
    return aot_autograd(fw_compiler=training_graph, bw_compiler=training_graph, inference_compiler=inference_graph,
                        keep_inference_input_mutations=True)(gm, example_inputs)


__all__ = ["compiler", "Replayer", "stats"]
