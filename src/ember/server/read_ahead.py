"""A small read that overtakes queued work it cannot depend on: the worker's choice of its next batch.

A session's worker runs its batches in the order they came, so a read waits for everything queued
before it. Most reads need that; some do not. Hugging Face's Trainer checks every step's loss with
``torch.isnan(loss)`` and ``torch.isinf(loss)`` *after* the backward: the loss was final when the
forward ended, yet each read waited for the whole backward on the peer, and the client recorded the
optimizer's step while the peer sat idle (a pipeline drained twice a step).

So, before each batch, the worker may take a later one out of turn (:func:`take`): a batch of small,
bounded ops that write nothing but their fresh outputs and draw no random numbers, and reads
(``OP`` / ``READ`` / ``DROP`` only, at least one ``READ``, cheap by ``Interpreter.cheap``), none of
whose inputs any batch it overtakes writes (outputs, in-place and ``out=`` operands, a replayed graph's
written and consumed inputs, uploads, drops), and none of whose outputs or drops any of them touches.
Its results are then exactly what they would have been in order: the same ops on the same values.
Anything the worker cannot judge (a graph it does not hold yet, a ``GRAPH`` registration, a custom
op, a transfer, an unknown op, a malformed message) is a barrier: nothing overtakes it. At most
:data:`MAX_SCAN` queued batches are looked at; nothing overtakes while the session is stalled on a
missing graph.

A read may also come while the worker runs a long replay (the backward's graph) with nothing queued: the
replay looks at what came between two of its steps (``Interpreter.poke``), and such a read batch runs there
when it overtakes the rest of the running batch, that replay included, as it would a queued one
(:func:`take_during`): the Trainer's ``torch.isinf(loss)`` is answered in the middle of the backward.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from ..protocol import messages as m
from ..protocol import ops
from .execute.interpreter import INLINE_MAX_MESSAGES
from .execute.replay import written_of

#: How many queued batches the worker looks at before each batch, and how many of their messages it weighs at most.
MAX_SCAN, MAX_MESSAGES = 64, 4096
_OP, _READ, _DROP, _UPLOAD, _REPLAY = m.OP, m.READ, m.DROP, m.UPLOAD, m.REPLAY
_LOOK = frozenset({m.READ, m.SYNC, m.SHAPE})  # requests that only look


def take(pending: deque[Any], interp: Any) -> Any:
    """Remove and return the item of ``pending`` (queued ``(batch, received, cost)`` items, the oldest first, or
    None) the worker runs next: the oldest, or a later read batch that overtakes the ones before it (see the
    module docstring). A read batch whose trailing ``DROP`` alone would collide (the client releasing what queued
    work still uses) overtakes without it: the drops stay where they were, and carry the item's ``cost`` (the
    part that overtakes carries None: the worker counts the item as done once, when its last part has run)."""
    if len(pending) > 1 and pending[0] is not None and interp._stalled is None:
        try:
            j, part = _overtaking(pending, interp)
        except Exception:  # noqa: BLE001 - a malformed message: nothing overtakes (the worker reports it in order)
            j, part = 0, None
        if j:
            return _remove(pending, j, part)
    return pending.popleft()


def _remove(pending: deque[Any], j: int, part: int | None) -> Any:
    """Take item ``j`` out of ``pending`` to run it now: whole (``part`` None), or its first ``part`` messages, the
    rest (its trailing drops) staying in its place with its cost."""
    item = pending[j]
    if part is None:
        del pending[j]
        return item
    pending[j] = (item[0][part:], item[1], item[2])
    return item[0][:part], item[1], None


def may_read(batch: list[list[Any]]) -> bool:
    """Might ``batch`` be a read that overtakes (a quick test on the network loop: short, with a ``READ``)?"""
    return len(batch) <= INLINE_MAX_MESSAGES and any(msg[0] == _READ for msg in batch)  # (Interpreter.cheap's bound)


def take_during(pending: deque[Any], rest: list[list[Any]], interp: Any) -> Any:
    """The queued read batch that may run now, in the middle of a message (``rest``: it and the rest of its batch),
    removed from ``pending`` as :func:`take` does; or None. The read must overtake ``rest`` whole as well as the
    queued batches before it: the message under way (a replay) then neither wrote nor will write what it reads."""
    if not pending or pending[0] is None:
        return None
    pending.appendleft((rest, 0.0, None))
    try:
        j, part = _overtaking(pending, interp)
    except Exception:  # noqa: BLE001 - a malformed message: nothing overtakes (the worker reports it in order)
        j, part = 0, None
    finally:
        pending.popleft()
    return _remove(pending, j - 1, part) if j else None


def _overtaking(pending: deque[Any], interp: Any) -> tuple[int, int | None]:
    """(position of the read batch that overtakes, None or how many of its messages do: all but trailing drops),
    or (0, None). At most :data:`MAX_MESSAGES` queued messages are weighed."""
    seen = 0
    for j in range(1, min(len(pending), MAX_SCAN)):
        item = pending[j]
        if item is None:
            break
        batch = item[0]
        seen += len(pending[j - 1][0])
        if seen > MAX_MESSAGES:
            break
        if not _reader(batch, interp):
            continue
        before = [pending[i][0] for i in range(j)]
        if _independent(batch, before, interp):
            return j, None
        n = len(batch)
        while n and batch[n - 1][0] == _DROP:
            n -= 1
        if n < len(batch) and all(msg[0] != _DROP for msg in batch[:n]) and _independent(batch[:n], before, interp):
            return j, n
        break
    return 0, None


def _reader(batch: list[list[Any]], interp: Any) -> bool:
    """Is ``batch`` small pure ops and reads, with at least one read?"""
    if not interp.cheap(batch, True):  # (first: it bounds the batch's length)
        return False
    reads = False
    table = interp.table
    for msg in batch:
        kind = msg[0]
        if kind == _READ:
            reads = True
        elif kind == _OP:
            fn = table.get(msg[1]) if len(msg) == 6 and type(msg[1]) is str else None
            if fn is None or _writes(fn, msg[1]) is not False or getattr(fn, "seeded", False):
                return False
        elif kind != _DROP:
            return False
    return reads


def _writes(fn: Any, name: str) -> bool | None:
    """Does op ``name`` (``fn``, its entry in the interpreter's table) write an operand? An ATen overload says
    (its schema); the Array API's ops never do; None for anything else (a collective, Ember's own torch ops):
    unknown, so nothing overtakes it."""
    w = getattr(fn, "writes_any", None)
    if w is not None:
        return w
    return ops.writes(name)


def _tensor_args(msg: list[Any]) -> list[Any]:
    smask = msg[3]
    return [a for i, a in enumerate(msg[2]) if not smask >> i & 1]


def _independent(batch: list[list[Any]], before: list[list[list[Any]]], interp: Any) -> bool:
    """Does no batch of ``before`` write what ``batch`` reads, or touch what it makes or drops?"""
    written: set[Any] = set()
    touched: set[Any] = set()
    for b in before:
        for msg in b:
            if not _effects(msg, written, touched, interp):
                return False
    for msg in batch:
        kind = msg[0]
        if kind == _OP:
            if not written.isdisjoint(_tensor_args(msg)) or not touched.isdisjoint(msg[4]):
                return False
        elif kind == _READ:
            if msg[2] in written:
                return False
        elif not touched.isdisjoint(msg[1]):  # DROP
            return False
    return True


def _effects(msg: list[Any], written: set[Any], touched: set[Any], interp: Any) -> bool:
    """Add what ``msg`` writes and touches; False for a message nothing may overtake."""
    kind = msg[0]
    if kind == _OP:
        fn = interp.table.get(msg[1])
        w = None if fn is None else _writes(fn, msg[1])
        if w is None:
            return False
        args, outs = _tensor_args(msg), msg[4]
        touched.update(args)
        touched.update(outs)
        written.update(outs)
        if w:
            written.update(written_of(fn, msg[2], msg[5]) or args)  # (unsure which: all of them)
    elif kind == _REPLAY:
        g = interp.graphs.peek(msg[1])
        if g is None:
            return False  # (it stalls the session when it runs)
        ins, outs = msg[2], msg[3]
        if type(outs) is int:  # dense ids (as GraphReplay.replay reads them)
            outs = [outs - g.n_in - g.n_s + r for r in g.kept]
        touched.update(ins)
        touched.update(outs)
        written.update(outs)
        written.update(ins[k] for k in graph_writes(g))
    elif kind == _UPLOAD:
        touched.add(msg[1])
        written.add(msg[1])
    elif kind == _DROP:
        touched.update(msg[1])
        written.update(msg[1])
    elif kind in _LOOK:
        touched.add(msg[2])
    else:
        return False
    return True


def graph_writes(g: Any) -> tuple[int, ...]:
    """The input positions a registered graph writes in place or consumes (computed once per graph)."""
    w = g.writes_in
    if w is None:
        n_in = g.n_in
        regs: set[int] = set(g.consumed)
        for step in g.steps:  # (fn, registers, output registers, keyword arguments, name, tensor registers, ...)
            fn = step[0]
            writes = _writes(fn, step[4]) if fn is not None else False
            mine = step[5] if writes is None else written_of(fn, step[1], step[3]) if writes else ()  # (unknown: all)
            regs.update(r for r in mine if type(r) is int and r < n_in)
        w = g.writes_in = tuple(sorted(regs))
    return w


__all__ = ["take", "take_during", "may_read", "graph_writes", "MAX_SCAN"]
