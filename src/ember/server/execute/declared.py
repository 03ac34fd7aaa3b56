"""What an ATen call makes, sized before it runs: :class:`~.aten.AtenKernel`'s ``check_declared`` and ``growth``.

Memory is charged by the outputs a client declares, before a call runs; a hostile client declares one float and
asks for ``zeros([2**32])``. The overload's meta kernel, on meta copies of the operands, says what the call makes
(:func:`check_declared`); ``resize_`` says how far it grows its tensor (:func:`growth`). Which ops the network loop
may run inline, and which ops' outputs their scalars shape, are decided here too.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ...protocol import aten as A
from ...protocol.codec import packb

SLACK = 1 << 16
"""Bytes a call's outputs may exceed its declared ones by, under its meta kernel (kernels that disagree on an
auxiliary output's size, as :data:`LENIENT`'s do, are not refused)."""
LENIENT = frozenset({"native_batch_norm", "_native_batch_norm_legit", "_embedding_bag",
                     "_embedding_bag_forward_only"})
"""Ops whose CPU kernel and meta kernel disagree on the size of an auxiliary output, one of them
empty (batch norm's saved statistics in eval mode, embedding bag's unused max indices): the peer
stores zeros in the client's layout, so the client's picture stays true."""
VALUE_SHAPED = frozenset({"arange", "range", "linspace", "logspace"})
"""Ops whose outputs' sizes their scalars give (``arange``'s end): checked at every call."""


def value_costed(base: str) -> bool:
    """Elementwise ops whose work per element grows with a value (a polynomial's degree ``n``: laguerre with
    n = 2e9 kept the network loop for seconds, every session's round trips with it; ``mvlgamma``'s ``p``):
    never run on the network loop or a caller's thread."""
    return "polynomial" in base or base.startswith(("mvlgamma", "polygamma"))


def check_declared(k: Any, a: list[Any], tensors: list[Any], scalars: list[Any], specs: Any) -> int:
    """A call makes no more fresh output than the client declared, and grows no operand it writes: memory is
    charged by declared outputs before a call runs, and ``zeros([2**32])`` declared as one float allocated
    16 GiB before its result was found to differ (a factory's size, ``repeat``'s counts, an outer product:
    outputs larger than the operands), as ``mm.out`` into a one-element ``out`` grew it to the product (a
    client's ``out`` is sized first: an ``out=`` call it sends grows nothing). The overload's meta kernel tells,
    on meta copies of the operands, once per call shape (per scalar values too, for ``arange``-like ops). A
    call its meta kernel cannot size (none, or a data-dependent size) runs, its result checked after it ran.
    A call that declares no outputs (``o: []``) declares nothing fresh; one the client calls data-dependent
    (``o: None``) but the meta kernel sizes: those bytes, to charge while it runs (the return value)."""
    if k.resize or specs is not None and type(specs) is not list or \
            specs is None and not k.op._schema.returns:
        return 0
    key = packb((a, [(t.shape, t.stride(), str(t.dtype)) for t in tensors], specs,
                 scalars if k.value_shaped else None))
    if key in k.declared_ok:
        return 0
    metas = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta") for t in tensors]
    try:
        args, kwargs, written = k._bind(a, metas, scalars)
        for j, (name, cat, _r, kwonly) in enumerate(k.args):
            if cat == A.DEVICE or cat == A.GENERATOR:
                v = torch.device("meta") if cat == A.DEVICE else None
                if kwonly:
                    kwargs[name] = v
                elif j < len(args):
                    args[j] = v
        res = k.op(*args, **kwargs)
    except Exception:  # noqa: BLE001 - no meta kernel, or a size only the values tell: checked after it runs
        return 0
    inputs = {m.untyped_storage()._cdata for m in metas}
    made = sum(r.untyped_storage().nbytes() for r in (res if isinstance(res, (tuple, list)) else [res])
               if isinstance(r, torch.Tensor) and r.untyped_storage()._cdata not in inputs)
    if specs is None:  # (data-dependent by the client's word: what the meta kernel sizes is charged while it runs)
        return made if made > SLACK else 0
    declared = sum(s[5] for s in specs if type(s) is list and len(s) == 6 and type(s[5]) is int and s[5] > 0)
    if made > declared + SLACK and k.base not in LENIENT:  # (LENIENT: meta and CPU size an output otherwise)
        raise ValueError(f"{k.name}: the call makes {made} bytes of outputs where the client declared "
                         f"{declared} (memory is charged by the declared outputs before a call runs)")
    real = {id(m): t for m, t in zip(metas, tensors)}
    for m, _n in written:
        if m.untyped_storage().nbytes() > real[id(m)].untyped_storage().nbytes():
            raise ValueError(f"{k.name}: the call would grow a written operand to {tuple(m.shape)} (a "
                             "client sizes what it writes first)")
    if len(k.declared_ok) >= 256:
        k.declared_ok.clear()
    k.declared_ok.add(key)
    return 0


def growth(k: Any, args: list[Any]) -> int:
    """Bytes ``resize_`` grows its tensor by (charged while it runs; what it holds after is charged then)."""
    if not k.resize or not args or not isinstance(args[0], torch.Tensor):
        return 0
    t, size = args[0], args[1] if len(args) > 1 else None
    if isinstance(size, torch.Tensor):  # (resize_as_: the other tensor's size)
        size = size.shape
    try:
        want = math.prod(int(n) for n in size) * t.element_size()
    except (TypeError, ValueError):
        return 0
    return max(0, want - t.untyped_storage().nbytes())


__all__ = ["check_declared", "growth", "value_costed", "SLACK", "LENIENT", "VALUE_SHAPED"]
