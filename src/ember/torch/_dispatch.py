"""The one kernel every ATen call on an ember tensor reaches: record it, return its outputs.

``kernel(op, *args, **kwargs)`` runs below autograd (the forward and the backward
pass both arrive here). It walks the schema once, collecting the operands' storages
and layouts, the scalar values and the literal arguments; looks up the cached
:class:`~ember.torch._meta.Plan` for that key (running the meta kernel on a miss);
records one ``OP`` message on the operands' session (views and metadata-only ops send
nothing); and returns real ember tensors with the inferred layouts. Nothing waits for
the peer unless torch needs a value (see ``_transfer``).

A call that repeats with positional arguments only (``a + b``, ``mm``, a view in the backward) takes a
fast path: ``_fast_walk`` keys it on those arguments alone and finds the plan and the defaults' scalars
without binding the schema or walking it (``counters["fast"]``); the first such call goes the generic way.
"""

from __future__ import annotations

import collections
from typing import Any, Callable

import torch

from ..client.device import Device
from ..protocol import aten as A
from ..protocol import messages as m
from . import _known, _meta
from ._schema import OpInfo, bound, call, info
from ._transfer import run_dynamic, upload
from ._devices import TwoDevices, WrongDevice, apply_seed, cpu_peer, current_device, device_of, materialize
from ._storage import StorageRef, dtype_name, live_session, new_tensor, set_layout

_OP = m.OP
_EXACT = _known.EXACT
_FILLS = _known.FLOAT_FACTORIES
_graph_task = torch._C._current_graph_task_id
_inference_mode = torch.is_inference_mode_enabled
_cache: dict[Any, _meta.Plan] = {}
#: The fast path's plans: (op info, per positional argument its layout or literal) -> (plan, defaults' scalars,
#: the one fresh output ``_run_one`` builds, or None).
_fast: dict[tuple[Any, ...], tuple[_meta.Plan, list[Any], tuple[Any, ...] | None]] = {}
_CACHE_MAX = 1 << 16
_TENSOR, _TENSOR_LIST, _SCALAR, _LITERAL = A.TENSOR, A.TENSOR_LIST, A.SCALAR, A.LITERAL
_BY_VALUE = frozenset({A.STRING, A.DTYPE, A.MEMORY_FORMAT})  # (keyed by their value, as the generic walk does)
_FRESH, _VIEW, _INPUT = _meta.FRESH, _meta.VIEW, _meta.INPUT
_Tensor = torch.Tensor
_NUMBER = (bool, int, float, complex)
#: Ops handled by ``_patches`` instead of the generic path (id(op) -> handler).
SPECIAL: dict[int, Callable[..., Any]] = {}
#: fast: calls that skipped bound and _walk (a Counter: ``counters.clear()`` starts it over)
counters = collections.Counter({"ops": 0, "messages": 0, "cache_misses": 0, "fast": 0})
#: Set while ``ember.torch.capture`` records a step: told each call's operand and fresh storages.
note: Callable[[list[StorageRef], list[StorageRef]], None] | None = None
#: Set while an optimizer step is recorded or replayed (``_optstep``): it takes every call ``(op, args, kwargs)``.
guide: Callable[[Any, tuple[Any, ...], dict[str, Any]], Any] | None = None


def _walk(i: OpInfo, values: list[Any]) -> tuple[list[Any], list[torch.Tensor], list[StorageRef], list[Any],
                                                 list[Any]]:
    """(template, operands, their storages, scalars, key parts) of one call."""
    template: list[Any] = []
    operands: list[torch.Tensor] = []
    refs: list[StorageRef] = []
    scalars: list[Any] = []
    key: list[Any] = []
    distinct: dict[int, int] = {}  # id(storage ref) -> its alias group (first use order)
    for (name, cat, _kw, _d), v in zip(i.args, values):
        if cat == A.TENSOR:
            template.append(_tensor_entry(v, operands, refs, distinct, scalars, key, name, i))
        elif cat == A.TENSOR_LIST:
            if v is None:
                template.append(None)
                key.append(None)
            else:
                template.append([_tensor_entry(x, operands, refs, distinct, scalars, key, name, i) for x in v])
                key.append(len(v))
        elif cat == A.SCALAR:
            if v is None:
                template.append(None)
                key.append(None)
            else:
                template.append(1)
                scalars.append(_wire_scalar(v))
                key.append((type(v), v) if i.by_value else type(v))  # (6, 6.0 and True hash alike)
        elif cat == A.SCALAR_LIST:
            if v is None:
                template.append(None)
                key.append(None)
            else:
                template.append(len(v))
                scalars.extend(_wire_scalar(x) for x in v)
                key.append(tuple((type(x), x) for x in v) if i.by_value else tuple(type(x) for x in v))
        elif cat == A.LITERAL:
            if isinstance(v, (list, tuple, torch.Size)):
                v = [int(x) for x in v] if not (v and type(v[0]) is bool) else list(v)
                key.append(tuple(v))
            else:
                key.append((type(v), v))
            template.append(v)
        elif cat == A.STRING:
            template.append(v)
            key.append(v)
        elif cat == A.DTYPE or cat == A.MEMORY_FORMAT:
            template.append(None if v is None else str(v)[6:])
            key.append(v)
        elif cat == A.LAYOUT:
            if v is not None and v is not torch.strided:
                raise NotImplementedError(f"{i.name}: ember tensors are strided only, not {v}")
            template.append(None if v is None else "strided")
            key.append(v)
        elif cat == A.DEVICE:
            if v is not None:
                v = torch.device(v)
                if v.type != "ember":
                    if v.type in ("cpu", "meta"):
                        raise _OtherDevice(v)
                    raise WrongDevice(f"{i.name} was asked for a {v} tensor among ember tensors",
                                      hint="move data with .to('ember') or .cpu()")
            template.append(None if v is None else 1)
            key.append(v is None)
        elif cat == A.GENERATOR:
            if v is not None:
                raise NotImplementedError(f"{i.name}: generator= is not supported on ember tensors "
                                          "(torch cannot make generators for Python devices); seed with "
                                          "torch.manual_seed")
            template.append(None)
        else:
            raise NotImplementedError(i.refused or f"{i.name}: unsupported argument {name}")
    return template, operands, refs, scalars, key


def layouts_of(operands: list[torch.Tensor]) -> list[list[Any]]:
    return [[list(t.shape), list(t.stride()), t.storage_offset(), dtype_name(t.dtype)] for t in operands]


def _tensor_entry(v: Any, operands: list[torch.Tensor], refs: list[StorageRef], distinct: dict[int, int],
                  scalars: list[Any], key: list[Any], name: str, i: OpInfo) -> Any:
    if v is None:
        key.append(None)
        return None
    if isinstance(v, torch.Tensor):
        r = getattr(v.untyped_storage(), "_ember", None)
        if r is None:
            if v.device.type == "cpu" and (v.dim() == 0 or name == "indices"):
                v = _upload_scalar(v, refs)  # 0-d CPU tensors and CPU indices mix in, as on CUDA
                r = v.untyped_storage()._ember
            elif v.device.type == "ember":
                raise RuntimeError(f"{i.name}: argument {name} is an ember tensor with no storage on a peer")
            else:
                raise WrongDevice(
                    f"Expected all tensors to be on the same device, but found at least two devices, ember:0 "
                    f"and {v.device}! (argument {name} of {i.name})",
                    hint="move the CPU tensor with .to('ember') first")
        alias = distinct.setdefault(id(r), len(distinct))  # (refs stay alive in `refs`: ids are not reused)
        operands.append(v)
        refs.append(r)
        key.append((v.dtype, v.shape, v.stride(), v.storage_offset(), alias))
        return 0
    if isinstance(v, (bool, int, float, complex)):  # a Python number in a Tensor slot (a wrapped number)
        scalars.append(_wire_scalar(v))
        key.append(type(v))
        return 1
    raise TypeError(f"{i.name}: argument {name} must be a tensor or a number, got {type(v).__name__}")


def _wire_scalar(v: Any) -> Any:
    if isinstance(v, bool):
        return v
    if isinstance(v, complex):
        return [v.real, v.imag]
    if isinstance(v, int):
        if not A.INT64[0] <= v < 1 << 64:
            raise OverflowError(f"the integer {v} does not fit in 64 bits")
        return v
    if isinstance(v, float):
        return v
    if isinstance(v, torch.SymInt | torch.SymFloat):  # pragma: no cover - not in eager mode
        raise NotImplementedError("symbolic values are not supported on ember tensors")
    return float(v)


def _upload_scalar(v: torch.Tensor, refs: list[StorageRef]) -> torch.Tensor:
    return upload(v, refs[0].device if refs else current_device())


def kernel(op: Any, *args: Any, **kwargs: Any) -> Any:
    """Every ATen call on ember tensors (the PrivateUse1 fallback and the claimed overloads)."""
    g = guide
    if g is not None:
        return g(op, args, kwargs)
    special = SPECIAL.get(id(op))
    if special is not None:
        return special(op, *args, **kwargs)
    return _generic(op, args, kwargs)


def unguided(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``kernel`` without the guide: what a call does when nothing intercepts it."""
    special = SPECIAL.get(id(op))
    if special is not None:
        return special(op, *args, **kwargs)
    return _generic(op, args, kwargs)


class _OtherDevice(Exception):
    """The call asks for a result on a local device (``zeros_like(t, device="cpu")``)."""


#: Runs a call whose device= is local (set by ``_decomposed``): (info, values, device) -> result.
on_host: Callable[[OpInfo, list[Any], torch.device], Any] | None = None
#: Runs an op outside ATen by its CPU kernel (set by ``_decomposed``): (info, op, args, kwargs) -> result.
run_foreign: Callable[[OpInfo, Any, tuple[Any, ...], dict[str, Any]], Any] | None = None


def kernel_generic(op: Any, *args: Any, **kwargs: Any) -> Any:
    """The generic path: infer (cached), record one message, build the outputs."""
    return _generic(op, args, kwargs)


def _generic(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    i = info(op)
    if i.foreign:
        assert run_foreign is not None
        return run_foreign(i, op, args, kwargs)
    try:
        res = _call(i, op, args, kwargs)
    except TwoDevices:
        if not i.base.startswith("_foreach_"):
            raise
        from ._across_peers import foreach_by_device
        return foreach_by_device(i, args, kwargs)
    if i.exact and type(res) is _Tensor and (res.dtype in _EXACT or i.base in _FILLS and _graph_task() == -1):
        # (a result the client may know: an integer one, or a fill outside a backward pass, whose own fills --
        #  a loss's ones_like, a formula's zeros -- are never read and would cost every step)
        _known.follow(op, args, kwargs, res)
    return res


def _call(i: OpInfo, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    walked = None if kwargs else _fast_walk(i, args)
    if walked is not None:
        fkey, operands, refs, scalars = walked
        try:
            hit = _fast.get(fkey)
        except TypeError:  # an unhashable literal: the generic path says what is wrong with it
            hit = walked = None
        if hit is not None:
            counters["ops"] += 1
            counters["fast"] += 1
            if hit[2] is not None and note is None:
                o = hit[2]
                if o[0] == _FRESH:
                    return _run_one(i, hit[0], refs, scalars + hit[1] if hit[1] else scalars, o)
                base = operands[o[1]]
                if not _inference_mode() or base.is_inference():
                    live_session(refs[0])  # (as _run: a view on an ended session raises SessionLost)
                    return new_tensor(o[2], o[3], o[4], o[5], storage=base.untyped_storage())
            return _run(i, hit[0], operands, refs, scalars + hit[1] if hit[1] else scalars)
    values = bound(i, args, kwargs)
    try:
        template, operands, refs, scalars, key = _walk(i, values)
    except _OtherDevice as e:
        if on_host is None:
            raise WrongDevice(f"{i.name} was asked for a {e.args[0]} tensor among ember tensors") from None
        return on_host(i, values, e.args[0])
    k = (i, *key)
    plan = _cache.get(k)
    counters["ops"] += 1
    if plan is None:
        layouts = layouts_of(operands)
        try:
            plan = _meta.infer(i, values, operands, template, layouts)
        except _meta.DataDependent:
            got = _known_call(i, values, operands, refs, scalars, template, layouts)
            return run_dynamic(i, operands, scalars, template, layouts, values) if got is _ASK else got
        counters["cache_misses"] += 1
        if len(_cache) >= _CACHE_MAX:
            _cache.clear()
            _fast.clear()
        _cache[k] = plan
    if walked is not None:  # the next such call skips bound and _walk: the defaults' scalars are constant
        if len(_fast) >= _CACHE_MAX:
            _fast.clear()
        _fast[walked[0]] = (plan, scalars[len(walked[3]):], _one_result(i, plan, refs))
    return _run(i, plan, operands, refs, scalars)


_ASK = object()


def _known_call(i: OpInfo, values: list[Any], operands: list[torch.Tensor], refs: list[StorageRef],
                scalars: list[Any], template: list[Any], layouts: list[Any]) -> Any:
    """A data-dependent call (``nonzero``, a boolean mask's index...) whose deciding operands the client knows
    (``_known``), on a torch CPU peer of this torch: its outputs' layouts computed here, by CPU torch on those
    bytes, so no round trip asks for them (the peer checks its results against them, as for any call); the
    results are known too when every operand is. ``_ASK``: ask the peer (``run_dynamic``)."""
    if not refs or i.seeded or any(i.writes) or i.refused is not None or i.list_return:
        return _ASK
    s = refs[0].session
    got = _known.deciding_bytes(i.base, operands, s)
    if got is None or not cpu_peer(refs[0].device.info):
        return _ASK
    try:
        plan, flat = _meta.infer_on_cpu(i, values, operands, template, layouts, got[0])
    except Exception:  # noqa: BLE001 - what CPU torch refuses here, the peer says (and run_dynamic asks it)
        return _ASK
    out = _run(i, plan, operands, refs, scalars)
    if got[1]:
        for res, c in zip(out if isinstance(out, (tuple, list)) else [out], flat):
            if isinstance(res, torch.Tensor):
                _known.remember(res, c)
    return out


def _fast_walk(i: OpInfo, args: tuple[Any, ...]) -> tuple[tuple[Any, ...], list[torch.Tensor], list[StorageRef],
                                                              list[Any]] | None:
    """(key, operands, their storages, scalars) of a positional-only call of tensors on a peer, scalars and
    literals, the rest defaulted; None for any other call (the generic walk takes it).

    The key is at least as fine as the plan cache's on the given arguments (it keeps literal lists as given
    and numbers the aliases by operand, not by storage): what it finds is what the generic path would do."""
    cats = i.pos_cats
    if len(args) > len(cats):
        return None
    key: list[Any] = [i]
    operands: list[torch.Tensor] = []
    refs: list[StorageRef] = []
    scalars: list[Any] = []
    for cat, v in zip(cats, args):
        if cat == _TENSOR:
            part = _fast_operand(v, operands, refs)
            if part is False:
                if not isinstance(v, _NUMBER):
                    return None
                scalars.append(_wire_scalar(v))  # a Python number in a Tensor slot (a wrapped number)
                part = type(v)
            key.append(part)
        elif cat == _SCALAR:
            if v is None:
                key.append(None)
            else:
                scalars.append(_wire_scalar(v))
                key.append((type(v), v) if i.by_value else type(v))
        elif cat == _LITERAL:
            key.append(tuple(v) if isinstance(v, (list, tuple)) else (type(v), v))
        elif cat == _TENSOR_LIST:
            if v is None:
                key.append(None)
                continue
            parts = tuple([_fast_operand(x, operands, refs) for x in v])
            if False in parts:
                return None
            key.append(parts)
        elif cat in _BY_VALUE:
            key.append(v)
        else:
            return None
    return tuple(key), operands, refs, scalars


def _fast_operand(v: Any, operands: list[torch.Tensor], refs: list[StorageRef]) -> Any:
    """An operand's key part (its layout and the first operand on its storage), or False: not for the fast path."""
    if isinstance(v, _Tensor):
        r = getattr(v.untyped_storage(), "_ember", None)
        if r is None:
            return False
        alias = 0
        for q in refs:
            if q is r:
                break
            alias += 1
        operands.append(v)
        refs.append(r)
        return (v.dtype, v.shape, v.stride(), v.storage_offset(), alias)
    return None if v is None else False


def _one_result(i: OpInfo, plan: _meta.Plan, refs: list[StorageRef]) -> tuple[Any, ...] | None:
    """The output of a plan that returns one tensor and either sends one message, the tensor on its one fresh
    storage (most calls: ``a + b``, ``mm``, an activation: ``_run_one`` runs it), or sends nothing, the tensor a
    view of its one operand (``view``, ``as_strided``: made at once); else None."""
    if not (refs and plan.ret == "one" and len(plan.outputs) == 1 and not plan.grow and not plan.relayout
            and not i.seeded and i.refused is None):
        return None
    o = plan.outputs[0]
    if plan.send:
        return o if plan.n_fresh == 1 and o[0] == _FRESH else None
    return o if not plan.fresh_nbytes and o[0] == _VIEW and len(refs) == 1 else None


def _run_one(i: OpInfo, plan: _meta.Plan, refs: list[StorageRef], scalars: list[Any], o: tuple[Any, ...]) -> Any:
    """``_run`` for a plan whose one result ``o`` is fresh (``_one_result``): the same message, the same tensor."""
    r0 = refs[0]
    dev = r0.device
    for r in refs:
        if r.device is not dev:
            device_of(refs, i)  # (raises: two devices)
        if r.pending is not None:
            materialize(r)
    s = live_session(r0)
    sid = next(s.ids)
    s.record([_OP, i.name, [scalars, *[r.sid for r in refs]], 1, [sid], plan.kwargs])
    counters["messages"] += 1
    return new_tensor(o[2], o[3], o[4], o[5], ref=StorageRef(sid, s, dev))


def _run(i: OpInfo, plan: _meta.Plan, operands: list[torch.Tensor], refs: list[StorageRef],
         scalars: list[Any]) -> Any:
    """Record the planned call (unless it only views or allocates) and build its outputs."""
    if plan.send and i.refused is not None:  # what the peer would refuse fails here, at the call
        raise NotImplementedError(i.refused)
    dev = device_of(refs, i)
    s = live_session(refs[0]) if refs else dev.session
    if plan.send:
        if i.seeded:
            apply_seed(s)
        for j, need in plan.grow:
            grow(refs[j], operands[j], need)
        for r in refs:
            if r.pending is not None:
                materialize(r)
        ids = s.ids
        outs = [next(ids) for _ in range(plan.n_fresh)]
        s.record([_OP, i.name, [scalars, *[r.sid for r in refs]], 1, outs, plan.kwargs])
        counters["messages"] += 1
        fresh = [StorageRef(sid, s, dev) for sid in outs]
    else:
        fresh = [StorageRef(next(s.ids), s, dev, pending=nb) for nb in plan.fresh_nbytes]
    if note is not None:
        note(refs, fresh)
    for j, size, stride, off in plan.relayout:
        t = operands[j]
        set_layout(t, t.untyped_storage(), off, size, stride)
    out = []
    for o in plan.outputs:
        kind = o[0]
        if kind == _FRESH:
            out.append(new_tensor(o[2], o[3], o[4], o[5], ref=fresh[o[1]]))
        elif kind == _VIEW:
            base = operands[o[1]]
            if _inference_mode() and not base.is_inference():
                with torch.inference_mode(False):  # a view of a normal tensor is a normal tensor, as in torch
                    out.append(new_tensor(o[2], o[3], o[4], o[5], storage=base.untyped_storage()))
            else:
                out.append(new_tensor(o[2], o[3], o[4], o[5], storage=base.untyped_storage()))
        elif kind == _INPUT:
            out.append(operands[o[1]])
        else:
            out.append(o[1] if kind == _meta.VALUE else None)
    ret = plan.ret
    if ret == "one":
        return out[0]
    if ret == "none":
        return None
    return out if ret == "list" else tuple(out)


def grow(r: StorageRef, t: torch.Tensor, need: int) -> None:
    """Make the peer's storage behind ``t`` at least ``need`` bytes (growth zeroed), before an op writes there."""
    if need <= t.untyped_storage().nbytes():
        return
    if r.pending is not None:
        r.pending = max(r.pending, need)
        return
    live_session(r).record([_OP, "aten.resize_.default", [[], r.sid], 1, [],
                            {"a": [0, [need], None], "l": [[[0], [1], 0, "uint8"]], "o": []}])


def meta_call(i: OpInfo, values: list[Any]) -> Any:
    """Run an overload's meta kernel directly on ember tensors (metadata-only ops: set_, t_...)."""
    torch._C._set_meta_in_tls_dispatch_include(True)
    try:
        return call(i, values)
    finally:
        torch._C._set_meta_in_tls_dispatch_include(False)


__all__ = ["kernel", "kernel_generic", "meta_call", "SPECIAL", "counters"]
