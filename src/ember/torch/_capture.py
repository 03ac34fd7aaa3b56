"""``ember.torch.capture(step)``: a whole training step recorded twice, then replayed as one ``REPLAY``.

Eager ember code pays Python dispatch for every ATen op of a step (autograd, schema walk,
plan lookup, message): ~30 µs an op on the client, whatever the peer. A captured step pays it
only while it is being *recorded*. Each call of ``capture(step)(*args)`` first runs ``step``
eagerly while the session's messages are tapped; when two consecutive recordings are the same
program -- the same ops with the same layouts, keyword arguments and scalar values, the same
inputs (the step's tensor arguments by position, the same outside tensors by id: parameters,
optimizer state), the same results -- the last recording becomes a graph: one ``GRAPH``
registration, then one ``REPLAY`` per call, with no per-op work on the client at all.

What a replay writes (see docs/protocol.md, "Graphs and replays"):

* tensors the step changes in place (parameters, optimizer state, running statistics) are
  changed in place, as eagerly;
* tensors the step makes and leaves behind (``p.grad`` after ``zero_grad(set_to_none=True)``,
  state an attribute keeps from one step to the next) are *rewritten in place*: the ``REPLAY``
  names the ids the client already holds for them, so the Python objects stay valid and see the
  new values. This holds only when each call frees the previous call's leftovers (checked);
* tensors the step returns are fresh handles every call (detached: a replay has no autograd
  graph on the client).

Guards (checked on every call, cheaply; any change records again): the arguments' structure,
layouts, dtypes and storage sharing, and non-tensor values; grad mode and autocast; every
outside tensor the graph reads or rewrites still alive; the state of each module the step ran (its plain
attributes -- ``training``, a dropout's ``p`` --, which parameters and buffers it holds and whether each
parameter requires grad, its hooks) and the hyperparameters of the optimizers it stepped (a new learning rate
records again;
one given as an ember tensor with ``capturable=True`` is a graph input that a scheduler changes in
place). The step's Python runs only while recording: side effects on plain Python objects are not
repeated by a replay (as with CUDA graphs). One thread at a time records a session's step.

A step the capture cannot hold -- one that reads a value (``.item()``, ``print``, a data-dependent
shape), uploads (``x.to("ember")`` inside the step: pass the tensors as arguments), draws on
host state that changes every call (a plain Adam's step count makes its bias corrections new
scalars each step: use ``fused=True`` or ``capturable=True``), or never repeats -- runs eagerly
for good, with one :class:`CaptureWarning` that says why. A replay is bit-equal to running the step eagerly: the
peer runs the same ops on the same data.

Outside a capture, an optimizer's ``step()`` on ember parameters is replayed on its own (the
optimizer's Python still runs, its ATen calls become one ``REPLAY``): see :mod:`._optstep`.
Inside one, the capture holds it.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Callable

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook as _opt_hook
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..client.graph import canon
from ..protocol import codec
from ..protocol import messages as m
from . import _dispatch as D
from ._devices import apply_seed, current_device, materialize
from ._storage import StorageRef, fresh_tensor, new_tensor, ref_or_none

TRIES = 4  # recordings in a row without a replayable pair before a step runs eagerly for good
#: steps recorded, calls replayed, calls run eagerly (given up), graphs made
stats = {"recorded": 0, "replays": 0, "eager": 0, "captures": 0}
_recording = [0]  # captures recording now (any thread: autograd runs compiled backward graphs on its own)
_KINDS = {v: k for k, v in vars(m).items() if k.isupper() and type(v) is int and k in (
    "UPLOAD", "READ", "SYNC", "CUSTOM", "SHAPE", "GRAPH", "REPLAY", "EXPOSE", "FETCH", "MOVE", "CLOSE")}


@torch.compiler.disable
def _noted(seen: dict[int, Any], obj: Any) -> None:
    """A hook's note of a module or optimizer the step used (None: the hook changes nothing; ``... and None`` asked
    ``bool()`` of it, which a compiled module's ``len`` refuses). Never traced: a compiled module called in the step
    runs its hooks from its graph, and Dynamo refuses a module it holds twice."""
    seen.setdefault(id(obj), obj)


class CaptureWarning(UserWarning):
    """A captured step runs eagerly (the message says why)."""


def recording() -> bool:
    """Is a capture recording? (then torch.compile's graphs are recorded op by op, into the capture's graph)"""
    return _recording[0] > 0


class _Tap:
    """What one call asks of its session: the ops, the ids released, the refs made and used, and why
    (if at all) the call cannot be a graph."""

    _NAMES = ("record", "release", "request", "upload", "send_alone", "replay_graph")

    def __init__(self, session: Any) -> None:
        self.s = session
        self.msgs: list[list[Any]] = []
        self.drops: list[int] = []
        self.refs: dict[int, weakref.ref[StorageRef]] = {}
        self.why: str | None = None
        self.mods: dict[int, Any] = {}
        self.opts: dict[int, Any] = {}

    def __enter__(self) -> "_Tap":
        s, msgs, drops = self.s, self.msgs, self.drops
        self.saved = {k: s.__dict__[k] for k in self._NAMES if k in s.__dict__}
        real_record, real_release, real_request = s.record, s.release, s.request
        real_upload, real_alone = s.upload, s.send_alone

        def record(msg: list[Any]) -> None:
            if msg[0] == m.OP:  # (any thread's: autograd runs the backward pass on a device thread)
                msgs.append(msg)
            else:
                self.refuse(f"sends a {_KINDS.get(msg[0], msg[0])} message")
            real_record(msg)

        def release(tid: int) -> None:
            drops.append(tid)
            real_release(tid)

        def request(kind: int, *a: Any, **k: Any) -> Any:
            self.refuse("reads a value from the peer (.item(), .cpu(), print, bool(t), a data-dependent "
                        "shape)" if kind in (m.READ, m.SHAPE) else f"waits for the peer ({_KINDS.get(kind, kind)})")
            return real_request(kind, *a, **k)

        def upload(*a: Any, **k: Any) -> Any:
            self.refuse("uploads a CPU tensor (x.to('ember') inside the step: pass ember tensors as arguments)")
            return real_upload(*a, **k)

        def send_alone(msg: list[Any]) -> None:
            self.refuse(f"sends a {_KINDS.get(msg[0], msg[0])} message")
            real_alone(msg)
        real_replay = s.replay_graph

        def replay_graph(*a: Any, **k: Any) -> None:
            self.refuse("replays another captured graph")
            real_replay(*a, **k)
        s.record, s.release, s.request, s.upload, s.send_alone = record, release, request, upload, send_alone
        s.replay_graph = replay_graph
        refs = self.refs

        def note(used: list[StorageRef], fresh: list[StorageRef]) -> None:  # (weakly: temporaries must die)
            for r in used:
                refs[r.sid] = weakref.ref(r)
            for r in fresh:
                refs[r.sid] = weakref.ref(r)
        self.prev_note, D.note = D.note, note
        mods, opts = self.mods, self.opts
        self.hooks = [torch.nn.modules.module.register_module_forward_pre_hook(
                          lambda mod, _a: _noted(mods, mod)),
                      _opt_hook(
                          lambda opt, _a, _k: _noted(opts, opt))]
        _recording[0] += 1
        return self

    def __exit__(self, *exc: Any) -> None:
        _recording[0] -= 1
        for h in self.hooks:
            h.remove()
        D.note = self.prev_note
        s = self.s
        for k in self._NAMES:
            if k in self.saved:
                setattr(s, k, self.saved[k])
            else:
                s.__dict__.pop(k, None)

    def refuse(self, why: str) -> None:
        if self.why is None:
            self.why = why


def _guards(mods: list[Any], opts: list[Any]) -> tuple[Any, ...]:
    """What plain Python state the recorded ops depended on: each module's state (:func:`_module_state`),
    optimizers' hyperparameters (a changed learning rate is a different program)."""
    return (torch.is_grad_enabled(), tuple(_module_state(mod.__dict__) for mod in mods),
            tuple(tuple((len(g["params"]), tuple((k, v) for k, v in g.items() if k != "params" and type(v) in _PLAIN))
                        for g in o.param_groups) for o in opts))


def _module_state(d: dict[str, Any]) -> tuple[Any, ...]:
    """A module's plain attributes (``training``, a dropout's ``p``, a norm's ``eps``...), which parameter and buffer
    objects it holds and whether each parameter requires grad (a frozen layer, a re-tied weight), and how many hooks
    it has: a step replayed after any of them changed would run the old program."""
    ps, bs = d["_parameters"], d["_buffers"]
    return (tuple([(k, v) for k, v in d.items() if v.__class__ in _SCALARS]),
            tuple([(id(p), p.requires_grad) for p in ps.values() if p is not None]) if ps else (),
            tuple(map(id, bs.values())) if bs else (),
            len(d["_forward_hooks"]) + len(d["_forward_pre_hooks"]) + len(d["_backward_hooks"])
            + len(d.get("_backward_pre_hooks", ())))


_PLAIN = (int, float, bool, str, type(None), tuple)
_SCALARS = frozenset({int, float, bool, str, type(None)})


class _Recording:
    """One recorded call, analysed: its canonical graph, what its inputs and results are, its signature."""

    __slots__ = ("c", "sig", "tokens", "kept", "left", "rets", "spec", "watch", "left_watch", "ext", "n_prev",
                 "mods", "opts", "guards")

    def __init__(self) -> None:
        self.ext: set[int] = set()


def _analyse(tap: _Tap, out: Any, arg_sids: dict[int, int], prev: list[int]) -> _Recording | str:
    """The recording of one call, or why it cannot be replayed."""
    if tap.why is not None:
        return tap.why
    msgs = tap.msgs
    for msg in msgs:
        name = msg[1]
        if not isinstance(name, str) or not (name.startswith("aten.") or name == "torch.alloc"):
            return f"runs {name}, which a graph does not hold"
    fresh = [o for msg in msgs for o in msg[4]]
    fs = set(fresh)
    if len(fs) != len(fresh):
        return "writes one id twice"
    drops = set(tap.drops)
    gone = drops & fs  # temporaries
    rec = _Recording()
    prev_slot = {sid: j for j, sid in enumerate(prev)}
    leaves, rec.spec = tree_flatten(out)
    rets: list[tuple[Any, ...]] = []
    ret_fresh: set[int] = set()
    for v in leaves:
        if isinstance(v, torch.Tensor):
            r = ref_or_none(v)
            if r is None or r.pending is not None:
                return f"returns a tensor the peer does not hold ({v.device})"
            lay = (v.dtype, tuple(v.shape), tuple(v.stride()), v.storage_offset())
            if r.sid in fs:
                rets.append(("f", r.sid, *lay))
                ret_fresh.add(r.sid)
            elif r.sid in arg_sids:
                rets.append(("a", arg_sids[r.sid], *lay))
            else:
                rets.append(("k", v.untyped_storage(), *lay))
        elif v is None or type(v) in (int, float, bool, str):
            rets.append(("v", v))
        else:
            return f"returns a {type(v).__name__}"
    if ret_fresh and ret_fresh & _held_by(tap.mods.values(), tap.opts.values()):
        return "returns a tensor it also keeps (a .grad, optimizer state or buffer): return a clone"
    c = canon(msgs, gone)
    if c is None:
        return "records values a graph cannot carry"
    rec.c = c
    kept_ids = [fresh[s] for s in c.kept]
    rec.kept = kept_ids
    rec.left = [sid for sid in kept_ids if sid not in ret_fresh]
    tokens: list[tuple[str, int]] = []
    inputs = set(c.inputs)
    for sid in c.inputs:
        if sid in arg_sids:
            tokens.append(("a", arg_sids[sid]))
        elif sid in prev_slot:
            tokens.append(("p", prev_slot[sid]))
        else:
            tokens.append(("c", sid))
    for d in drops - fs:
        j = prev_slot.get(d)
        if j is not None:
            rec.ext.add(j)
        elif d in inputs:
            rec.ext.add(-1 - d)  # frees an outside tensor it reads: never the same twice
    rec.tokens, rec.rets, rec.n_prev = tokens, rets, len(prev)
    refs = tap.refs  # the outside tensors the graph reads or rewrites: all must live for a replay
    rec.left_watch = [w for w in (refs.get(sid) for sid in rec.left) if w is not None and w() is not None]
    rec.watch = [w for w in (refs.get(t[1]) for t in tokens if t[0] == "c") if w is not None and w() is not None]
    rec.watch += rec.left_watch
    rec.mods, rec.opts = list(tap.mods.values()), list(tap.opts.values())
    rec.guards = _guards(rec.mods, rec.opts)
    rec.sig = (codec.packb([c.shape, c.kept, [t.__name__ for t in c.types]]), c.kw_bytes(), codec.packb(c.scalars),
               tokens, [("f", kept_ids.index(x[1]), *x[2:]) if x[0] == "f" else ("k", id(x[1]), *x[2:])
                        if x[0] == "k" else x for x in rets], rec.spec, sorted(rec.ext),
               len(prev), len(rec.left), rec.guards)
    return rec


def _held_by(mods: Any, opts: Any) -> set[int]:
    """The storage ids the modules and optimizers a step ran hold: parameters, their grads, buffers, state."""
    ts: list[Any] = []
    for mod in mods:
        ts.extend(mod.parameters(recurse=False))
        ts.extend(mod.buffers(recurse=False))
    for o in opts:
        for g in o.param_groups:
            ts.extend(g["params"])
        for st in o.state.values():
            ts.extend(v for v in st.values() if isinstance(v, torch.Tensor))
    ts.extend([p.grad for p in ts if isinstance(p, torch.nn.Parameter) and p.grad is not None])
    out = set()
    for t in ts:
        r = ref_or_none(t)
        if r is not None:
            out.add(r.sid)
    return out


class _Plan:
    """A replayable step: the graph's registration and the bindings of one REPLAY."""

    def __init__(self, rec: _Recording, entry: Any, session: Any) -> None:
        self.entry, self.session, self.n_ops = entry, session, len(rec.c.shape)
        # (the graph id hashes the structure, not the scalars: a graph registered with another learning rate
        # serves this one too, with the scalars that differ overridden in every REPLAY)
        self.over = entry.overrides(rec.c.scalars)
        left = {sid: j for j, sid in enumerate(rec.left)}
        self.ins: list[int] = []
        self.argpos: list[tuple[int, int]] = []
        for k, (kind, v) in enumerate(rec.tokens):
            if kind == "a":
                self.ins.append(0)
                self.argpos.append((k, v))
            elif kind == "p":
                self.ins.append(rec.left[v])  # the previous call's leftover is the one the client holds now
            else:
                self.ins.append(v)
        self.outs: list[int] = []
        self.retpos: dict[int, int] = {}  # recorded sid of a returned fresh tensor -> its position in outs
        for k, sid in enumerate(rec.kept):
            if sid in left:
                self.outs.append(sid)  # rewritten in place
            else:
                self.outs.append(0)
                self.retpos[sid] = k
        self.rets, self.spec, self.watch = rec.rets, rec.spec, rec.watch
        self.mods, self.opts, self.guards = rec.mods, rec.opts, rec.guards

    def valid(self) -> bool:
        for w in self.watch:
            if w() is None:
                return False
        return _guards(self.mods, self.opts) == self.guards

    def replay(self, sids: list[int], args: list[torch.Tensor], device: Any) -> Any:
        s = self.session
        if s.lost is not None:
            raise s._lost_error()
        apply_seed(s)
        ins = self.ins[:]
        for k, i in self.argpos:
            ins[k] = sids[i]
        outs = self.outs[:]
        ids = s.ids
        new: dict[int, int] = {}
        for sid, k in self.retpos.items():
            outs[k] = new[sid] = next(ids)
        s.replay_graph(self.entry, self.n_ops, ins, outs, self.over)
        storages: dict[int, Any] = {}
        leaves: list[Any] = []
        for x in self.rets:
            kind = x[0]
            if kind == "v":
                leaves.append(x[1])
                continue
            dtype, size, stride, off = x[2:]
            if kind == "f":
                t = fresh_tensor(storages, new[x[1]], s, device, dtype, size, stride, off)
            elif kind == "a":
                t = new_tensor(dtype, size, stride, off, storage=args[x[1]].untyped_storage())
            else:
                t = new_tensor(dtype, size, stride, off, storage=x[1])
            leaves.append(t)
        stats["replays"] += 1
        return tree_unflatten(leaves, self.spec)


def _detached(out: Any) -> Any:
    """The step's results without their autograd graph, as a replay returns them."""
    leaves, spec = tree_flatten(out)
    if not any(isinstance(v, torch.Tensor) and v.requires_grad for v in leaves):
        return out
    return tree_unflatten([v.detach() if isinstance(v, torch.Tensor) else v for v in leaves], spec)


class Captured:
    """The callable ``capture(step)`` returns (see the module's docstring)."""

    def __init__(self, fn: Callable[..., Any], tries: int = TRIES) -> None:
        self.fn, self.tries = fn, tries
        self.plans: dict[Any, _Plan] = {}
        self.last: _Recording | None = None
        self.last_key: Any = None
        self.misses = 0
        self.why: str | None = None  # set once the step runs eagerly for good
        self.__wrapped__ = fn
        self.__doc__ = getattr(fn, "__doc__", None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.why is not None:
            stats["eager"] += 1
            return self.fn(*args, **kwargs)
        if recording():  # a capture inside a capture: the outer one records these ops
            return self.fn(*args, **kwargs)
        leaves, spec = tree_flatten((args, kwargs))
        key: list[Any] = [spec, torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
                          torch.is_autocast_enabled("ember") and torch.get_autocast_dtype("ember")]
        tens: list[torch.Tensor] = []
        refs: list[StorageRef] = []
        first: dict[int, int] = {}
        for v in leaves:
            if isinstance(v, torch.Tensor):
                r = ref_or_none(v)
                if r is None:
                    return self._give_up(f"takes a {v.device} tensor as an argument (move it with .to('ember') "
                                         "before the call)", args, kwargs)
                key.append((v.dtype, tuple(v.shape), tuple(v.stride()), v.storage_offset(), v.requires_grad,
                            first.setdefault(id(r), len(tens))))
                tens.append(v)
                refs.append(r)
            else:
                try:
                    hash(v)
                except TypeError:
                    return self._give_up(f"takes an unhashable {type(v).__name__} argument", args, kwargs)
                key.append((type(v), v))
        k = tuple(key)
        for r in refs:
            if r.pending is not None:
                materialize(r)
        sids = [r.sid for r in refs]
        p = self.plans.get(k)
        if p is not None:
            if p.valid():
                self.misses = 0
                return p.replay(sids, tens, refs[0].device if refs else current_device())
            del self.plans[k]
        return self._record(k, args, kwargs, refs, sids)

    def _record(self, k: Any, args: tuple[Any, ...], kwargs: dict[str, Any], refs: list[StorageRef],
                sids: list[int]) -> Any:
        session = refs[0].session if refs else current_device().session
        if any(r.session is not session for r in refs):
            return self._give_up("mixes tensors of two Ember devices", args, kwargs)
        apply_seed(session)  # a reseed since the last call goes out before the recording, not in it
        arg_sids: dict[int, int] = {}
        for i, sid in enumerate(sids):
            arg_sids.setdefault(sid, i)
        prev = self.last.left if self.last is not None and self.last_key == k else []
        if prev and any(w() is None for w in self.last.left_watch):  # type: ignore[union-attr]
            self.last = None  # (its leftovers are gone: the next recording starts afresh)
            self._missed("frees what it leaves behind between calls (optimizer.zero_grad() outside the step?): "
                         "a replay cannot make new Python objects, so do that inside the step")
            prev = []
        with _Tap(session) as tap:
            out = _detached(self.fn(*args, **kwargs))  # (the autograd graph of a result dies in the tap)
        stats["recorded"] += 1
        rec = _analyse(tap, out, arg_sids, prev)
        if isinstance(rec, str):
            self.last = None
            self._missed(rec)
            return out
        last, self.last, self.last_key = self.last, rec, k
        if last is not None and last.sig == rec.sig and rec.ext == set(range(len(prev))):
            entry = session.graph_entry(rec.c)
            if entry is None:
                self._missed("cannot be registered as a graph on this peer (graph_cache 0, or too many ops)")
                return out
            self.plans[k] = _Plan(rec, entry, session)
            stats["captures"] += 1
            self.misses = 0
            return out
        if last is not None and last.guards[2] != rec.guards[2] and last.guards[:2] == rec.guards[:2]:
            self._missed("steps an optimizer whose hyperparameters change every call (a learning-rate schedule: "
                         "give the lr as an ember tensor, lr=torch.tensor(lr, device='ember'), with "
                         "capturable=True or fused=True)")
        elif last is not None and last.sig[:2] == rec.sig[:2] and last.sig[2] != rec.sig[2]:
            self._missed("records new scalar values every call (host-side state such as a non-capturable "
                         "optimizer's step count: construct Adam/AdamW with fused=True or capturable=True)")
        else:
            self._missed("records a different program every call")
        return out

    def _missed(self, why: str) -> None:
        self.misses += 1
        if self.misses >= self.tries:
            self.why = why
            self.plans.clear()
            self.last = None
            warnings.warn(f"ember.torch.capture: {getattr(self.fn, '__qualname__', self.fn)!s} runs eagerly from now "
                          f"on: the step {why}", CaptureWarning, stacklevel=3)

    def _give_up(self, why: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.misses = self.tries - 1
        self._missed(why)
        stats["eager"] += 1
        return self.fn(*args, **kwargs)


def capture(fn: Callable[..., Any] | None = None, *, tries: int = TRIES) -> Any:
    """Capture a whole step (forward, backward and optimizer step) and replay it as one graph.

    ``step = ember.torch.capture(step)`` (or ``@ember.torch.capture``): the first calls run eagerly
    while they are recorded; once two recordings agree, each call is one ``REPLAY`` message. Pass
    the step's data as ember tensor arguments; read results (``loss.item()``) outside the step.
    """
    if fn is None:
        return lambda f: Captured(f, tries)
    return Captured(fn, tries)


__all__ = ["capture", "Captured", "CaptureWarning", "recording", "stats"]
