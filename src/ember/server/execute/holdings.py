"""What a session's interpreter stores, and what each stored value costs its memory budget.

:class:`Holdings` is the part of the :class:`~ember.server.interpreter.Interpreter` that
puts values under ids and forgets them, charging the session's
:class:`~ember.server.memory.SessionMemory` by buffer (views of a buffer the session
holds cost nothing more), reserves the predicted size of an op that may allocate more
than its inputs hold (:mod:`ember.server.execute.sizes`), and re-charges the operands an ATen op
grew in place. It relies on the interpreter's ``tensors``, ``poison``, ``mem``, ``_fp``,
``_numpy``, ``max_tensors``, ``backend`` and ``table``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...errors import LimitExceeded
from ...protocol import ops
from .replay import Poison, call_text, describe_layouts, limit_poison, written_of
from .sizes import THRESHOLD, declared_outputs, expanded, inside_broadcast, predict

_ELEMENTWISE = ops.ELEMENTWISE
_FOREIGN = "OUSVMm"  # NumPy kinds no device announces (objects, strings, voids, dates): never stored
MAX_POISON = 1 << 14
"""Poisoned ids one session keeps (each holds its error's text, ~600 bytes: 10 MB at most, uncharged)."""
SMALL = THRESHOLD // 16
"""Operands below this many bytes cannot make an elementwise result worth reserving for."""


class Holdings:
    """Storing values under ids, charged to the session's memory budget (a mixin of Interpreter)."""

    tensors: dict[Any, Any]
    poison: dict[Any, Poison]
    _views: dict[int, set[Any]]  # id of a stored value -> {(program, input)} holding views of it
    mem: Any             # SessionMemory
    backend: Any         # Backend
    _fp: Any
    _numpy: bool
    _aten: bool
    max_tensors: int

    def _reserve(self, name: str, vals: list[Any], kwargs: Any) -> int:
        """Charge an op's predicted output before it runs when it may exceed what its inputs hold."""
        if name in ops.ELEMENTWISE and len(vals) <= 2:  # the hot path: small operands, no broadcast
            a = vals[0] if vals else None
            b = vals[1] if len(vals) == 2 else None
            na, nb = getattr(a, "nbytes", 0), getattr(b, "nbytes", 0)
            if na < SMALL and nb < SMALL and (not na or not nb or a.shape == b.shape):
                return 0  # at most 8x an operand under THRESHOLD / 16: charged once it exists
        return self._reserve_predicted(name, vals, kwargs)

    def _reserve_predicted(self, name: str, vals: list[Any], kwargs: Any) -> int:
        """``_reserve`` past its small-elementwise check (which the interpreter inlines)."""
        need = predict(name, vals, kwargs, self.backend.xp)
        if not need:
            return 0
        fp = self._fp
        if need <= max((fp(v)[1] for v in vals if getattr(v, "shape", None) is not None), default=0):
            return 0  # no larger than an input: charged once it exists
        self.mem.charge(need, lambda: call_text(name, vals, kwargs))
        return need

    def _reserve_unpredicted(self, name: str, vals: list[Any], kwargs: Any) -> int:
        """Charge, before it runs, an op :mod:`sizes` does not predict: an ATen call's declared
        outputs (the storages the peer fills in), what a kernel that broadcasts inside holds while it runs
        (``sizes.inside_broadcast``) and what its operands describe beyond their storages (``sizes.expanded``);
        an op over a view much larger than its buffer (a
        broadcast), whose outputs and temporaries may be as large as the view."""
        if self._aten:
            need = declared_outputs(kwargs) + inside_broadcast(name, kwargs) + expanded(kwargs, vals) if kwargs else 0
            if need:
                self.mem.charge(need, lambda: describe_layouts(kwargs) or name)
            return need
        need = 0
        for v in vals:
            n = getattr(v, "nbytes", 0)
            if type(n) is int and n >= THRESHOLD and n > need and n > self._fp(v)[1]:
                need = n
        if need:
            self.mem.charge(need, lambda: call_text(name, vals, kwargs))
        return need

    def _footprints(self, fn: Any, args: Any, kwargs: Any) -> list[tuple[Any, int, int]] | None:
        """(id, buffer key, bytes) of the operands an in-place op writes (ATen ops on torch devices)."""
        ids = written_of(fn, args, kwargs)
        if not ids:
            return None
        t, fp = self.tensors, self._fp
        return [(i, *fp(t[i])) for i in ids if type(i) is int and i in t]

    def _recharge(self, before: list[tuple[Any, int, int]], name: str) -> None:
        """A written operand may have grown (``resize_``, ``out=``): charge what it holds now, or
        poison it (freeing it) when that is over a budget."""
        t, fp, mem = self.tensors, self._fp, self.mem
        for tid, key, n in before:
            v = t.get(tid)
            if v is None:
                continue
            nkey, nn = fp(v)
            if (nkey, nn) == (key, n):
                continue
            mem.unhold(key)
            try:
                mem.hold(nkey, nn, (name, v))
            except LimitExceeded as e:
                t.pop(tid, None)  # its new buffer was never charged: nothing to release
                if self._views:
                    self._unview(v)
                self._set_poison([tid], limit_poison(name, self.backend.spec, e))

    def put(self, tid: Any, value: Any, what: str, prepaid: int = 0) -> None:
        """Store ``value`` under ``tid``, charging its buffer (LimitExceeded: nothing stored or charged)."""
        t = self.tensors
        old = t.get(tid)
        if old is None and len(t) >= self.max_tensors:
            self.mem.release(prepaid)
            raise LimitExceeded(f"this session already holds {len(t)} tensors, the most this peer allows "
                                f"(max_tensors)", hint="free arrays you no longer need (del x)")
        if self._numpy and type(value) is np.ndarray and value.base is None:  # the hot path, inlined
            if value.dtype.kind in _FOREIGN:
                self.mem.release(prepaid)
                raise TypeError(f"{what} made a {value.dtype} array; this device holds only {', '.join(self.backend.dtypes)}")
            key, n = id(value), value.nbytes
        else:
            key, n = self._fp(value)
        self.mem.hold(key, n, (what, value), prepaid)
        t[tid] = value
        if old is not None:
            if self._views and old is not value:
                self._unview(old)
            self.mem.unhold(self._fp(old)[0])
        elif self.poison:
            self.poison.pop(tid, None)  # a reused id: its old error is gone with it

    def _put_all(self, outs: list[Any], res: Any, name: str) -> None:
        if len(res) != len(outs):
            raise ValueError(f"{name} returned {len(res)} results for {len(outs)} outputs")
        done = []
        try:
            for o, r in zip(outs, res):
                self.put(o, r, name)
                done.append(o)
        except Exception:
            for o in done:  # all outputs or none
                self.forget(o)
            raise

    def forget(self, tid: Any) -> None:
        """Drop ``tid`` (value or poison), releasing its buffer when nothing else refers to it."""
        v = self.tensors.pop(tid, None)
        if v is None:
            self.poison.pop(tid, None)
            return
        if self._views:
            self._unview(v)
        if self._numpy and type(v) is np.ndarray and v.base is None:
            self.mem.unhold(id(v))
        else:
            self.mem.unhold(self._fp(v)[0])

    def _unview(self, v: Any) -> None:
        """``v`` leaves the session: graph programs drop the views they cached of it
        (:meth:`~ember.server.execute.program.Program.unbind`), so none keeps its storage alive."""
        for prog, k in self._views.pop(id(v), ()):
            prog.unbind(k, v)

    def _set_poison(self, outs: Any, poison: Poison) -> None:
        p = self.poison
        try:
            for o in outs:
                self.forget(o)
                if len(p) >= MAX_POISON or len(p) >= self.max_tensors:  # the oldest are forgotten first
                    del p[next(iter(p))]
                p[o] = poison
        except TypeError:  # not a list of ids: nothing to poison
            pass
