"""An eager ATen call bound once per template: the generic kernel's checks, made once per call shape.

:meth:`AtenKernel.__call__ <ember.server.execute.aten.AtenKernel.__call__>` binds a message's
template to the overload's schema (:meth:`AtenKernel._bind`), checks each layout's extent and
each output spec on every call. A client sends the same few call shapes again and again (the
template ``a``, the operand layouts ``l`` and the output specs ``o`` of ``(a + 1).item()`` are the
same every time; only the scalars' values and the storages change), so the kernel keeps, per
call shape, what those checks found (:class:`EagerPlan`): the overload's call made once from the
bound template (``step_maker._maker``, as a replayed graph's fast step), each operand's typed layout
and extent, each output's spec. A call of a known shape then only checks what may differ
between calls: that each operand names a storage holding its layout, that the scalars are
numbers, and that each result is exactly what its spec says (else the generic ``_store`` copies
it into its layout or says why, as the generic kernel does).

A planned call also keeps, on each stored storage value it reads, the typed view it read it through
(``_VIEW``: the plan's layout, the storage, the view), so the next call of that shape on that storage
makes no new view (a view sees every later write; the extent check still runs per call); a result
that spans all of its storage is adopted as a flat ``uint8`` view of itself that keeps the result
(:func:`~.program.span`), and a later call (or graph) reading that storage value in the result's
layout reads the result itself (in another layout of its dtype, an ``as_strided`` view of it). Each
saves a ``torch.empty(0).set_`` (~2 µs, a fifth of a small call's peer time).

Only calls that write no operand, resize nothing, and whose kernel needs no position check
(:mod:`.positions`) take this way; everything else, and any call the plan's checks do not
accept, runs the generic kernel (same errors, same results). The call shape is keyed by its
overload's name and its MessagePack bytes (a canonical encoding: ``1``, ``1.0`` and ``True``
differ). A session keeps at most :data:`MAX_PLANS` shapes (then starts over), each of a call
whose key is at most :data:`MAX_KEY` bytes (larger calls run the generic kernel: per-call
overhead matters for small calls), so what plans hold is bounded per session (a few MB at
most, uncharged, as poison records are), and a client sending ever new shapes costs the peer
the generic path plus one encoding per call.
"""

from __future__ import annotations

from typing import Any

import torch

from ...protocol import aten as A
from ...protocol.codec import packb
from .program import TYPED, span
from .step_maker import _maker, _scalar_count, _slot
from .tight import adoptable

#: Call shapes one session remembers (a few per overload in real code; the cache starts over when full).
MAX_PLANS = 512
#: The longest key (bytes) of a call shape that gets a plan.
MAX_KEY = 1024
#: ``EagerPlan.run``'s answer when the generic kernel must run the call (nothing was done yet).
GENERIC = object()
_Tensor, _uint8, _empty = torch.Tensor, torch.uint8, torch.empty
#: The attribute of a stored storage value that keeps its last typed operand view: (layout, storage, view).
_VIEW = "_ember_typed"


class EagerPlan:
    """One call shape of one overload, bound and checked once (see the module docstring)."""

    __slots__ = ("call", "n_scal", "lays", "outs", "device", "scalar", "a", "specs", "declared")

    def __init__(self, k: Any, a: list[Any], lays: list[Any], specs: list[Any], dtypes: dict[str, Any],
                 itemsize: dict[str, int], scalar: Any) -> None:
        self.device, self.scalar = k.device, scalar
        self.a, self.specs, self.declared = a, specs, False  # (declared: the outputs hold what a call makes)
        self.lays = []
        for lay in lays:
            need = A.layout_extent(lay, itemsize)  # raises on a malformed layout: no plan, the generic path
            self.lays.append((dtypes[lay[3]], lay[2], list(lay[0]), list(lay[1]), need))
        k.check_outputs(lays, specs)  # (raises: the generic path, which says why)
        marks = [torch.empty(0, device="cpu") for _ in lays]  # bound once with markers, as Program._lower does
        self.n_scal = _scalar_count(k, a, A)
        smarks = [float(j) + 0.5 for j in range(self.n_scal)]
        args, kwargs, before = k._bind(a, marks, smarks)
        if before:
            raise ValueError("writes an operand")  # (never planned: the generic kernel keeps its layout)
        tid = {id(t): j for j, t in enumerate(marks)}
        sid = {id(x): j for j, x in enumerate(smarks)}
        plan = [_slot(v, tid, sid) for v in args]
        kwplan = {n: _slot(v, tid, sid) for n, v in kwargs.items()}
        self.call = _maker(plan, kwplan, k.op._op if k.draw is None else None, k.draw, None,
                           len(lays))(list(range(len(lays))))
        self.outs = []
        for spec in specs:
            if not isinstance(spec, list) or len(spec) != 6 or type(spec[0]) is not int or spec[0] < 0:
                raise ValueError("malformed output spec")
            _, size, stride, offset, dtype, nb = spec
            if type(nb) is not int or not A.layout_extent([size, stride, offset, dtype], itemsize) <= nb <= A.INT64[1]:
                raise ValueError("output spec cannot hold its layout")
            self.outs.append((spec[0], torch.Size(size), tuple(stride), offset, dtypes[dtype], nb, spec))

    def run(self, k: Any, scalars: Any, bufs: tuple[Any, ...]) -> Any:
        """The call's stored results, or ``GENERIC`` (before anything ran) when the generic kernel must
        judge it. Raises what the kernel raises, or what the generic ``_store`` says of a result."""
        lays = self.lays
        if len(bufs) != len(lays) or type(scalars) is not list or len(scalars) != self.n_scal:
            return GENERIC
        dev = self.device
        tensors = []
        ptrs = []  # the operands' memory: a result there is copied, never adopted (as ``_store`` does)
        for b, lay in zip(bufs, lays):
            if type(b) is not _Tensor or b.dtype is not _uint8 or b.dim() != 1 or b.storage_offset() != 0:
                return GENERIC
            st = b.untyped_storage()
            if lay[4] > st.nbytes():
                return GENERIC
            ptrs.append(st.data_ptr())
            d = b.__dict__
            seen = d.get(_VIEW)  # the typed view this storage was last read through, under this very layout
            if seen is not None and seen[0] is lay and seen[1] == st._cdata:
                tensors.append(seen[2])
                continue
            dt, off, size, stride, _ = lay
            typed = d.get(TYPED)  # the typed result this storage value spans (program.span)
            v = _of_result(typed, st, dt, off, size, stride) if typed is not None else None
            if v is None:
                v = _empty((0,), dtype=dt, device=dev).set_(st, off, size, stride)
            d[_VIEW] = (lay, st._cdata, v)
            tensors.append(v)
        scalar = self.scalar
        try:
            S = [scalar(x) for x in scalars]
        except ValueError:
            return GENERIC
        if not self.declared or k.value_shaped:
            k.check_declared(self.a, tensors, scalars, self.specs)  # (raises: its outputs are poisoned, why said)
            self.declared = True
        res = k.follow_and_call(self.call, tensors, S)
        flat = res if isinstance(res, (tuple, list)) else (res,)
        stored = []
        for idx, size, stride, off, dt, nb, spec in self.outs:
            if idx >= len(flat):
                return k._results(res, [o[6] for o in self.outs], tensors)  # raises why
            r = flat[idx]
            if type(r) is _Tensor and r.dtype is dt and r.shape == size and r.stride() == stride \
                    and r.storage_offset() == off and adoptable(r, nb, ptrs):  # (a storage holding r alone)
                stored.append(span(r, _as_storage, _uint8))  # a flat uint8 value spanning it (r itself if it spans all)
                continue
            stored.append(k._store(r, spec, tensors))  # copies into the spec's layout, or says what is wrong
        return stored[0] if len(stored) == 1 else tuple(stored)


def _as_storage(t: Any) -> Any:
    return _empty((0,), dtype=_uint8, device=t.device).set_(t.untyped_storage())  # (aten.as_storage)


def _of_result(typed: Any, st: Any, dt: Any, off: int, size: list[int], stride: list[int]) -> Any:
    """An operand view made of ``typed``, the result a storage value spans: ``typed`` itself in its own
    layout, else a view of it in another layout of its dtype (``as_strided`` checks the extent); None when
    it is not on the storage ``st`` or not of dtype ``dt`` (the caller sets a view on the storage)."""
    if typed.dtype is not dt or typed.untyped_storage()._cdata != st._cdata:
        return None
    if typed.storage_offset() == off and list(typed.shape) == size and list(typed.stride()) == stride:
        return typed
    try:
        return typed.as_strided(size, stride, off)
    except RuntimeError:  # past the storage: the caller's set_ says so (its extent was checked)
        return None


def plan_for(k: Any, plans: dict[bytes, Any], a: Any, l: Any, o: Any, dtypes: dict[str, Any],  # noqa: E741
             itemsize: dict[str, int], scalar: Any) -> EagerPlan | None:
    """The kernel ``k``'s plan for this call shape in the session's ``plans`` (made on first sight), or None:
    the generic kernel."""
    if type(o) is not list or type(l) is not list or type(a) is not list or len(a) != len(k.args):
        return None
    try:
        key = packb((k.name, a, l, o))
    except Exception:  # noqa: BLE001 - not encodable (a huge int...): the generic kernel says what is wrong
        return None
    if len(key) > MAX_KEY:
        return None
    p = plans.get(key, GENERIC)
    if p is GENERIC:
        try:
            p = EagerPlan(k, a, l, o, dtypes, itemsize, scalar)
        except Exception:  # noqa: BLE001 - the generic kernel says what is wrong, at the call
            p = None
        if len(plans) >= MAX_PLANS:
            plans.clear()
        plans[key] = p
    return p


__all__ = ["EagerPlan", "plan_for", "GENERIC", "MAX_PLANS"]
