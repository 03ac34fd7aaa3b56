"""Optimizer steps on ember devices replayed as one graph, with no change to user code.

When every parameter of a ``torch.optim.Optimizer`` lives on one Ember device, its ``step()``
is recorded once (with :mod:`._capture`'s tap: the ATen messages it sends, the ids it frees)
and from then on *replayed against that recording*: the optimizer's Python still runs every
step -- so the host state eager keeps stays exactly eager's (a plain Adam's CPU step counts,
a learning-rate schedule, lazily made state, the pre- and post-step hooks, which run around
it as always) -- but its ATen calls on ember tensors are not dispatched. Each call is checked
against the recorded one (the same overload, literal arguments, operand layouts, and the same
storages where the recording had the same: ``p.grad`` made anew by ``zero_grad(set_to_none=True)``
is bound as it is now, never a stale one) and its scalars are kept (bias corrections, the
learning rate: they differ from step to step and become the replay's scalar values, so a
schedule needs no new recording). Fresh results (the step's temporaries) are placeholders
that never reach the peer. When the step returns, the whole of it goes out as one ``REPLAY``
of the recorded graph -- or, where the session's op group has room for its ops (after an eager or
``torch.compile``'d forward and backward), as the recorded messages again, into that group, which
then goes out as one ``REPLAY`` of the whole training step: one message instead of a dispatch
per ATen op (AdamW's foreach step is 8 ops whatever the model, but each walks every parameter:
~1 ms of client CPU per step for a 2-layer GPT, ~2 ms for a 6-layer one). The peer runs the
same kernels on the same data, so a replayed step is bit-equal to an eager one.

A call that differs from the recording (another overload, a layout, a parameter whose grad is
now None, a new aliasing) ends the replay there: the calls already checked are dispatched for
real (the placeholders they returned become their real results) and the step finishes eagerly;
the next step records again. The first step of most optimizers makes their state (kept: not a
replayable step) and is recorded again on the second. A step that keeps failing to replay
(:data:`TRIES` times in a row: it reads a value, sends something other than ATen ops, keeps a
tensor it makes, never repeats) runs eagerly for good, with one :class:`CaptureWarning` that
says why.

Always eager, silently: ``step(closure)`` (the closure's forward and backward are not the
optimizer's), ``differentiable=True`` groups (the step is part of an autograd graph), steps inside
an ``ember.torch.capture`` recording (the capture holds them) or under ``torch.compile``,
optimizers with a parameter off Ember or on two Ember devices, and everything when
``EMBER_CAPTURE_OPTIMIZER=0`` is set or after ``ember.torch.capture_optimizer_steps(False)``
(or ``capture_optimizer_steps(False, optimizer=opt)`` for one optimizer).
"""

from __future__ import annotations

import functools
import os
import threading
import warnings
import weakref
from typing import Any, Callable

import torch
from torch.optim import Optimizer

from ..client.graph import canon
from ..protocol import aten as A
from ..protocol.messages import OP as _OP
from . import _dispatch as D, _optfast
from ._optfast import _layout
from ._capture import CaptureWarning, _Tap, recording
from ._devices import materialize
from ._meta import _ITEMSIZE
from ._schema import bound, info
from ._storage import StorageRef, dtype_name, new_tensor, ref_or_none, set_layout

TRIES = 4  # steps in a row that do not replay before an optimizer's steps run eagerly for good
PLANS = 8  # recorded steps kept per optimizer (one per pattern of grads that are None), oldest dropped
#: steps recorded, steps replayed, steps run eagerly for good, replays that ended in an eager step, and of the
#: replays those that ran no optimizer Python (a trusted host model's: :mod:`._optfast`)
stats = {"recorded": 0, "replays": 0, "eager": 0, "diverged": 0, "modelled": 0}
_enabled = [os.environ.get("EMBER_CAPTURE_OPTIMIZER", "1").strip().lower() not in ("0", "false", "no", "off")]
_T, _TL, _S, _SL = A.TENSOR, A.TENSOR_LIST, A.SCALAR, A.SCALAR_LIST
_NUMBER = (bool, int, float, complex)
_ident = threading.get_ident
_wire = D._wire_scalar


class _Differs(Exception):
    """A call of a replayed step is not the recorded one."""


def _lean(i: Any, values: list[Any]) -> tuple[list[Any], list[Any], list[Any]]:
    """(skeleton, operands, wire scalars) of one call, in the order ``_dispatch._walk`` takes them: the
    skeleton is what must equal the recorded call's (list lengths, None-ness, literal values)."""
    skel: list[Any] = []
    operands: list[Any] = []
    scalars: list[Any] = []
    for (_n, cat, _k, _d), v in zip(i.args, values):
        if cat == _T:
            if v is None:
                skel.append(None)
            elif isinstance(v, _NUMBER):
                scalars.append(_wire(v))
                skel.append(type(v))
            else:
                operands.append(v)
                skel.append(0)
        elif cat == _TL:
            if v is None:
                skel.append(None)
            else:
                operands.extend(v)
                skel.append(len(v))
        elif cat == _S:
            if v is None:
                skel.append(None)
            else:
                scalars.append(_wire(v))
                skel.append(1)
        elif cat == _SL:
            if v is None:
                skel.append(None)
            else:
                scalars.extend([_wire(x) for x in v])
                skel.append(len(v))
        else:
            skel.append(v)
    return skel, operands, scalars


class _Call:
    """One recorded ATen call: ``sends`` one OP message (replayed) or none (a view: run as it is)."""

    __slots__ = ("op", "info", "sends", "skel", "lays", "layids", "stypes", "scal", "refs", "outs", "ret", "msg",
                 "slot0")

    def __init__(self, op: Any, i: Any, sends: bool) -> None:
        self.op, self.info, self.sends = op, i, sends


def _results(out: Any, operands: list[Any], outs: list[int]) -> tuple[str, list[Any]] | None:
    """How a call's result is made from its operands and fresh ids (None: not a shape a replay rebuilds)."""
    if out is None:
        return "none", []
    kind = "one" if isinstance(out, torch.Tensor) else "list" if type(out) is list else "tuple" \
        if type(out) is tuple else None
    if kind is None:
        return None
    specs: list[Any] = []
    for t in ([out] if kind == "one" else out):
        if t is None:
            specs.append(None)
            continue
        if not isinstance(t, torch.Tensor):
            return None
        j = next((j for j, o in enumerate(operands) if o is t), None)
        if j is not None:
            specs.append(("in", j))
            continue
        r = ref_or_none(t)
        if r is None or r.sid not in outs:
            return None
        lay = (tuple(t.shape), tuple(t.stride()), t.storage_offset())
        specs.append(("f", outs.index(r.sid), t.dtype, *lay))
    return kind, specs


class _Recorder:
    """The guide while a step is recorded: every call runs as usual and is noted with what a replay checks."""

    def __init__(self, tap: _Tap) -> None:
        self.tap, self.thread = tap, _ident()
        self.calls: list[_Call] = []
        self.why: str | None = None
        self.layid: dict[tuple[Any, ...], int] = {}

    def __call__(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if _ident() != self.thread:
            return D.unguided(op, args, kwargs)
        msgs = self.tap.msgs
        n0 = len(msgs)
        i = info(op)
        try:
            skel, operands, scalars = _lean(i, bound(i, args, kwargs))
            before: list[Any] | None = [_layout(t) for t in operands]
        except Exception:  # (what eager refuses, it refuses below; anything else is not replayed)
            skel, operands, scalars, before = [], [], [], None
        out = D.unguided(op, args, kwargs)
        c = _Call(op, i, len(msgs) > n0)
        self.calls.append(c)
        if not c.sends:
            return out
        msg = msgs[n0]
        refs = [ref_or_none(t) for t in operands]
        if len(msgs) > n0 + 1 or before is None or id(op) in D.SPECIAL:
            self.refuse(f"runs {i.name} in a way a replay does not rebuild")
        elif i.seeded:
            self.refuse(f"draws random numbers ({i.name})")
        elif None in refs or msg[2][0] != scalars or msg[2][1:] != [r.sid for r in refs]:  # type: ignore[union-attr]
            self.refuse(f"passes {i.name} operands a replay does not bind")
        elif [_layout(t) for t in operands] != before:
            self.refuse(f"changes its operands' layouts ({i.name})")
        else:
            res = _results(out, operands, msg[4])
            if res is None:
                self.refuse(f"returns what a replay does not rebuild ({i.name})")
            else:
                c.ret, c.outs = res
                c.skel, c.lays, c.scal, c.msg = skel, before, scalars, msg
                c.layids = [self.layid.setdefault(lay, len(self.layid)) for lay in before]
                c.stypes = [type(x) for x in scalars]
        return out

    def refuse(self, why: str) -> None:
        if self.why is None:
            self.why = why


class _Plan:
    """A recorded step that replays: its graph's registration and, per call, what binds it."""

    def __init__(self, calls: list[_Call], c: Any, entry: Any, session: Any, device: Any) -> None:
        self.calls, self.entry, self.session, self.device, self.canon = calls, entry, session, device, c
        self.n_ops, self.n_in = len(c.shape), len(c.inputs)
        slot = k = 0
        for call in calls:
            if call.sends:
                name, _smask, refs, n_outs = c.shape[k]
                call.refs, call.slot0 = refs[1:], slot
                slot, k = slot + n_outs, k + 1
        self.fresh_each_step = not all(call.sends for call in calls)  # (a view may relayout a placeholder)
        self.placeholders: tuple[list[list[Any]], dict[int, int]] | None = None
        self.trust = _optfast.Trust()  # the step's host model, once one has agreed with its guided replays

    def take_placeholders(self) -> tuple[list[list[Any]], dict[int, int]]:
        """Per call, its fresh results as placeholders (pending storages: never on the peer), and the slot of
        each placeholder storage; reused from step to step unless a step ran views on them."""
        if self.placeholders is not None:
            return self.placeholders
        s, dev = self.session, self.device
        by_slot: dict[int, Any] = {}
        slot_of: dict[int, int] = {}
        per_call: list[list[Any]] = []
        for call in self.calls:
            made: list[Any] = []
            for o in (call.outs if call.sends else ()):
                if o is None or o[0] == "in":
                    made.append(None)
                    continue
                _f, j, dtype, size, stride, off = o
                slot = call.slot0 + j
                st = by_slot.get(slot)
                if st is None:
                    r = StorageRef(next(s.ids), s, dev, pending=max(1, A.layout_extent(
                        [list(size), list(stride), off, dtype_name(dtype)], _ITEMSIZE)))
                    t = new_tensor(dtype, size, stride, off, ref=r)
                    by_slot[slot], slot_of[id(r)] = t.untyped_storage(), slot
                else:
                    t = new_tensor(dtype, size, stride, off, storage=st)
                made.append(t)
            per_call.append(made)
        got = (per_call, slot_of)
        if not self.fresh_each_step:
            self.placeholders = got
        return got


class _Guide:
    """The guide while a step replays: each call is checked against the recorded one and bound, not run."""

    def __init__(self, plan: _Plan) -> None:
        self.plan, self.calls, self.thread = plan, plan.calls, _ident()
        self.pos = 0
        self.bind: list[StorageRef | None] = [None] * plan.n_in
        self.reg_of: dict[int, int] = {}
        self.scalars: list[list[Any]] = []
        self.done: list[tuple[Any, tuple[Any, ...], dict[str, Any], int]] = []  # checked calls, not yet run
        self.made, self.slot_of = plan.take_placeholders()
        self.seen: dict[int, tuple[int, int]] = {}
        self.differs: str | None = None

    def __call__(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if _ident() != self.thread:
            return D.unguided(op, args, kwargs)
        k = self.pos
        calls = self.calls
        if k >= len(calls) or calls[k].op is not op:
            return self.diverge(f"calls {info(op).name} where the recording had "
                                f"{calls[k].info.name if k < len(calls) else 'no more calls'}", op, args, kwargs)
        c = calls[k]
        if not c.sends:
            self.pos = k + 1
            self.seen.clear()  # (a view op may change an operand's layout in place)
            return D.unguided(op, args, kwargs)
        try:
            operands, scalars = self.check(c, args, kwargs)
        except _Differs as e:
            return self.diverge(f"{c.info.name}: {e}", op, args, kwargs)
        self.pos = k + 1
        self.scalars.append(scalars)
        self.done.append((op, tuple(list(a) if type(a) is list else a for a in args), kwargs, k))
        D.counters["ops"] += 1
        made = self.made[k]
        items = [operands[o[1]] if o is not None and o[0] == "in" else made[j] for j, o in enumerate(c.outs)]
        ret = c.ret
        return items[0] if ret == "one" else None if ret == "none" else items if ret == "list" else tuple(items)

    def check(self, c: _Call, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], list[Any]]:
        """The call's operands and scalars, once it is found to be the recorded call (else ``_Differs``)."""
        i = c.info
        try:
            skel, operands, scalars = _lean(i, bound(i, args, kwargs))
        except Exception:
            raise _Differs("arguments the recording did not take") from None
        if skel != c.skel:
            raise _Differs("other arguments")
        stypes = c.stypes
        if len(scalars) != len(stypes) or any(type(v) is not t for v, t in zip(scalars, stypes)):
            raise _Differs("other scalar types")
        if i.by_value and scalars != c.scal:
            raise _Differs("other scalar values")
        lays, layids, refs, bind, reg_of, slot_of = c.lays, c.layids, c.refs, self.bind, self.reg_of, self.slot_of
        session, seen = self.plan.session, self.seen
        for j, t in enumerate(operands):
            want = refs[j]
            v = seen.get(id(t))  # (a tensor already checked in this step: the same storage and layout)
            if v is not None:
                if v[0] != want or v[1] != layids[j]:
                    raise _Differs("one tensor where the recording had two")
                continue
            try:
                r = t.untyped_storage()._ember
                lay = (t.dtype, t.shape, t.stride(), t.storage_offset())
            except AttributeError:
                raise _Differs("an operand that is not an ember tensor") from None
            if lay != lays[j]:
                raise _Differs(f"an operand of another layout ({lay[1:]} for {lays[j][1:]})")
            seen[id(t)] = (want, layids[j])  # (alive until the step ends: self.done holds the calls' arguments)
            slot = slot_of.get(id(r))
            if slot is not None or want >= 0:
                if slot != want:
                    raise _Differs("another tensor where the recording had one of the step's own results")
                continue
            reg = ~want
            b = bind[reg]
            if b is None:
                if r.sid in reg_of or r.session is not session:
                    raise _Differs("operands that share a storage where the recording's did not")
                bind[reg] = r
                reg_of[r.sid] = reg
            elif b is not r:
                raise _Differs("operands in separate storages where the recording's shared one")
        return operands, scalars

    def diverge(self, why: str, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """This call is not the recorded one: run the checked calls for real, then this one and the rest."""
        self.run_checked(why)
        return D.unguided(op, args, kwargs)

    def run_checked(self, why: str) -> None:
        """Dispatch the calls checked so far, each placeholder becoming its call's real result; the guide is off."""
        if D.guide is self:
            D.guide = None
        self.differs = why
        self.plan.placeholders = None  # (handed to the step's Python: never reused)
        for op, args, kwargs, k in self.done:
            out = D.unguided(op, args, kwargs)
            real = [out] if self.calls[k].ret == "one" else out or []
            for ph, t in zip(self.made[k], real):
                if ph is None:
                    continue
                st = ph.untyped_storage()
                if st._ember.pending is not None:
                    st._ember = t.untyped_storage()._ember
                if _layout(ph) != _layout(t):
                    set_layout(ph, st, t.storage_offset(), t.shape, t.stride())
        self.done.clear()


def _where(opt: Optimizer) -> tuple[Any, Any, Any] | None:
    """(the grads' None pattern, session, device) when every parameter is on one Ember device, no group is
    differentiable and no gradient is sparse (its step's shapes depend on its values); else None (the step runs
    eagerly)."""
    pattern: list[bool] = []
    first: StorageRef | None = None
    for g in opt.param_groups:
        if g.get("differentiable"):
            return None
        for p in g["params"]:
            r = ref_or_none(p)
            if r is None or (first is not None and r.session is not first.session):
                return None
            first = first or r
            if p.grad is not None and p.grad.layout is not torch.strided:
                return None
            pattern.append(p.grad is None)
    if first is None:
        return None
    return (tuple(pattern), id(first.session)), first.session, first.device


class _OptimizerCapture:
    """One optimizer's recorded steps (by grads' None pattern), misses in a row, and why it runs eagerly."""

    def __init__(self) -> None:
        self.plans: dict[Any, _Plan] = {}
        self.last: _Plan | None = None  # the plan a host model ran last: tried first, before _where
        self.misses = 0
        self.why: str | None = None
        self.off = False

    def step(self, func: Callable[..., Any], opt: Optimizer) -> Any:
        if self.off:
            return func(opt)
        last = self.last
        if last is not None and self.why is None:
            got = last.trust.run(opt, drop=False)
            if got is not None:  # (the last modelled plan again: its model checks all _where would, and more)
                return self.modelled(last, got)
        where = _where(opt)
        if where is None:
            return func(opt)
        if self.why is not None:
            stats["eager"] += 1
            return func(opt)
        key, session, device = where
        plan = self.plans.get(key)
        if plan is not None:
            return self.replay(plan, key, func, opt)
        return self.record(key, session, device, func, opt)

    def record(self, key: Any, session: Any, device: Any, func: Callable[..., Any], opt: Optimizer) -> Any:
        with _Tap(session) as tap:
            rec = _Recorder(tap)
            D.guide = rec
            try:
                out = func(opt)
            finally:
                D.guide = None
        stats["recorded"] += 1
        plan = _plan_of(tap, rec, session, device)
        if isinstance(plan, str):
            self.missed(plan, opt)
        elif plan is not None:
            if len(self.plans) >= PLANS:
                self.last = None if self.plans.pop(next(iter(self.plans))) is self.last else self.last
            self.plans[key] = plan
        return out

    def replay(self, plan: _Plan, key: Any, func: Callable[..., Any], opt: Optimizer) -> Any:
        got = plan.trust.run(opt)
        if got is not None:  # (the step's Python would make the recorded calls: not run)
            return self.modelled(plan, got)
        g = _Guide(plan)
        D.guide = g
        try:
            out = func(opt)
        except BaseException:
            if D.guide is g:
                g.run_checked("raised")
            raise
        finally:
            if D.guide is g:
                D.guide = None
        if g.differs is None and g.pos != len(g.calls):
            g.run_checked(f"made {g.pos} of the recording's {len(g.calls)} calls")
        if g.differs is not None:
            stats["diverged"] += 1
            del self.plans[key]
            self.last = None if plan is self.last else self.last
            self.missed(f"differs from its recording ({g.differs})", opt)
            return out
        self.send(plan, g.bind, g.scalars)
        plan.trust.after_guided(func, opt, plan.session, g.bind, g.scalars)
        return out

    def modelled(self, plan: _Plan, got: tuple[list[Any], list[list[Any]]]) -> None:
        """A step its plan's trusted host model ran (``got``: the storages it binds, its scalars): sent."""
        D.counters["ops"] += len(plan.calls)
        self.send(plan, *got)
        stats["modelled"] += 1
        self.last = plan
        return None  # (what Adam.step and SGD.step return without a closure)

    def send(self, plan: _Plan, bound: list[Any], scalars: list[list[Any]]) -> None:
        """The replayed step goes out: into the op group when it has room, else as a REPLAY of its graph."""
        s = plan.session
        if s.lost is not None:
            raise s._lost_error()
        for r in bound:
            if r.pending is not None:
                materialize(r)
        bind = [r.sid for r in bound]
        if plan.n_ops <= s.group_room():
            _into_group(s, plan.canon, bind, scalars)
        else:
            s.replay_graph(plan.entry, plan.n_ops, bind, [], plan.entry.overrides(scalars))
        stats["replays"] += 1
        self.misses = 0

    def missed(self, why: str, opt: Optimizer) -> None:
        self.misses += 1
        if self.misses >= TRIES:
            self.why = why
            self.plans.clear()
            self.last = None
            warnings.warn(f"ember.torch: {type(opt).__name__}.step() runs eagerly from now on: the step {why}",
                          CaptureWarning, stacklevel=4)


def _plan_of(tap: _Tap, rec: _Recorder, session: Any, device: Any) -> _Plan | str | None:
    """The recorded step's plan, why it cannot replay, or None when it sent nothing (nothing to replay)."""
    why = tap.why or rec.why
    if why is not None:
        return why
    msgs = tap.msgs
    if not msgs:
        return None
    sending = [c for c in rec.calls if c.sends]
    if len(sending) != len(msgs) or any(c.msg is not msg for c, msg in zip(sending, msgs)):
        return "sends messages its own calls did not (another thread's?)"
    for msg in msgs:
        if not (isinstance(msg[1], str) and msg[1].startswith("aten.")):
            return f"runs {msg[1]}, which a graph does not hold"
    fresh = {o for msg in msgs for o in msg[4]}
    drops = set(tap.drops)
    if fresh - drops:
        return "keeps a tensor it makes (optimizer state is made on the first step)"
    c = canon(msgs, fresh)
    if c is None:
        return "records values a graph cannot carry"
    if drops & set(c.inputs):
        return "frees a tensor it reads"
    entry = session.graph_entry(c)
    if entry is None:
        return "cannot be registered as a graph on this peer (graph_cache 0, or too many ops)"
    return _Plan(rec.calls, c, entry, session, device)


def _into_group(s: Any, c: Any, bind: list[int], scalars: list[Any]) -> None:
    """Record the plan's ops (its canonical form ``c``) again, on the ids ``bind`` and with this step's
    ``scalars``, into the session's op group; its results are the step's temporaries (freed at once: the
    group never gives them an id on the peer)."""
    ids = s.ids
    slots = [next(ids) for _ in range(c.n_slots)]
    sc = iter(scalars)
    record = s.record
    k = 0
    for (name, smask, refs, n_outs), kw in zip(c.shape, c.kws):
        record([_OP, name, [next(sc) if r is None else slots[r] if r >= 0 else bind[~r] for r in refs], smask,
                slots[k:k + n_outs], kw])
        k += n_outs
    for sid in slots:
        s.release(sid)


_states: weakref.WeakKeyDictionary[Optimizer, _OptimizerCapture] = weakref.WeakKeyDictionary()


def _state(opt: Optimizer) -> _OptimizerCapture:
    st = _states.get(opt)
    if st is None:
        st = _states[opt] = _OptimizerCapture()
    return st


def _wrap(func: Callable[..., Any]) -> Callable[..., Any]:
    """An optimizer class's ``step`` as it runs inside torch's hook wrapper: replayed when it can be."""
    if getattr(func, "_ember_step", False):
        return func

    @functools.wraps(func)
    def step(self: Optimizer, *args: Any, **kwargs: Any) -> Any:
        if (args and args != (None,)) or (kwargs and kwargs != {"closure": None}) or not _enabled[0] \
                or D.guide is not None or recording() or torch.compiler.is_compiling():
            return func(self, *args, **kwargs)
        return _state(self).step(func, self)
    step._ember_step = True  # type: ignore[attr-defined]
    return step


def install() -> None:
    """Route every optimizer class's ``step`` through :func:`_wrap` (classes torch already hooked too)."""
    hook = Optimizer.profile_hook_step
    if getattr(hook, "_ember", False):
        return

    def profile_hook_step(func: Callable[..., Any]) -> Callable[..., Any]:
        return hook(_wrap(func))
    profile_hook_step._ember = True  # type: ignore[attr-defined]
    Optimizer.profile_hook_step = staticmethod(profile_hook_step)  # type: ignore[method-assign,assignment]
    todo = list(Optimizer.__subclasses__())
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        st = cls.__dict__.get("step")
        if st is not None and getattr(st, "hooked", False) and hasattr(st, "__wrapped__"):
            cls.step = profile_hook_step(st.__wrapped__)  # type: ignore[method-assign]
            cls.step.hooked = True  # type: ignore[attr-defined]


def capture_optimizer_steps(enabled: bool, optimizer: Optimizer | None = None) -> None:
    """Turn the replay of optimizer steps on ember devices on or off: for every optimizer, or for one
    (``EMBER_CAPTURE_OPTIMIZER=0`` in the environment starts with it off for all)."""
    if optimizer is None:
        _enabled[0] = bool(enabled)
    else:
        st = _state(optimizer)
        st.off = not enabled
        st.plans.clear()
        st.last = None


__all__ = ["capture_optimizer_steps", "install", "stats", "TRIES"]
