"""Ops the client rewrites before anything is sent, so their arguments are checked like any other op's.

* ``as_strided_copy``/``as_strided_scatter`` and the ``_unsafe_*index*`` family are refused by name
  on a peer (they could reach outside a storage, or skip bounds checks). Here they run as torch's
  own decompositions: an ``as_strided`` *view* (whose layout the peer checks against its storage
  before touching memory) and a copy, or clamped indices and bounds-checked ``index``/``index_put``.
* ``_efficientzerotensor`` (the zero gradient of ``sgn``/``abs``-like ops on real inputs) is a
  plain ``zeros``: torch's ZeroTensor is an optimisation a Python device cannot carry.
* ``lift_fresh_copy`` and ``lift`` (a graph traced by ``torch.compile`` copies the tensor constants it
  made with them: Hugging Face's Llama) are refused by name on a peer (``lift*``: ops only a client
  performs); here they are what they compute, a ``clone``.
* A CPU ``device=`` on a call among ember tensors (``zeros_like(t, device="cpu")``) runs on local
  torch, as on CUDA: ``*_like``/``new_*`` take only their operands' layouts, other ops read them.
* An op outside ATen (a C++ extension's, torchvision's ``nms`` / ``roi_align``, a ``torch.library`` custom
  op) has no kernel for ember, and a peer runs ATen's vetted ops only: it runs here, by its CPU kernel, on its
  operands' values (a read each), its results uploaded to their device (:func:`run_foreign`).
"""

from __future__ import annotations

from typing import Any

import torch

from . import _dispatch as D
from . import _transfer as T
from ._schema import OpInfo, call

aten = torch.ops.aten
_DECOMPOSED = ("as_strided_copy.default", "_unsafe_masked_index.default",
               "_unsafe_masked_index_put_accumulate.default", "_unsafe_index.Tensor", "_unsafe_index_put.default")


def _decomposition(op: Any) -> Any:
    from torch._decomp import decomposition_table
    fn = decomposition_table.get(op)
    if fn is None:  # CompositeImplicit ops (as_strided_copy): their own composite
        return lambda *a, **k: op.decompose(*a, **k)
    return fn


def _as_strided_scatter(op: Any, x: torch.Tensor, src: torch.Tensor, size: Any, stride: Any,
                        storage_offset: Any = None) -> torch.Tensor:
    """As ATen's: a copy of ``x``'s whole storage, viewed as ``x``, with the ``as_strided`` view overwritten."""
    whole = aten.as_strided.default(x, [x.untyped_storage().nbytes() // x.element_size()], [1], 0)
    out = aten.as_strided.default(aten.clone.default(whole), x.shape, x.stride(), x.storage_offset())
    aten.copy_.default(aten.as_strided.default(out, size, stride, storage_offset), src)
    return out


def _into(out: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``out=``: the value in the caller's tensor, resized as ATen's ``resize_output`` does."""
    if out.shape != value.shape:
        aten.resize_.default(out, value.shape)
    return aten.copy_.default(out, value)


def _zeros(op: Any, size: Any, *, dtype: Any = None, layout: Any = None, device: Any = None,
           pin_memory: Any = None) -> torch.Tensor:
    return aten.zeros.default(size, dtype=dtype, layout=layout, device=device)


def on_host(i: OpInfo, values: list[Any], device: torch.device) -> Any:
    """Run ``i`` on local torch (``device`` is not ember): ember operands become CPU values."""
    layout_only = i.base.endswith("_like") or i.base.startswith("new_")

    def host(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.device.type == "ember":
            if layout_only:
                return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
            return T.read(v)
        if isinstance(v, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in v):
            return type(v)(host(x) for x in v)
        return v

    return call(i, [host(v) for v in values])


def run_foreign(i: OpInfo, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A non-ATen op on ember tensors: its CPU kernel on their values, the results on their Ember device
    (bit-equal to local CPU, at a round trip per operand; its outputs' shapes may depend on the data: ``nms``)."""
    from torch.utils._pytree import tree_flatten, tree_map
    from ._devices import device_of
    from ._storage import ref_or_none
    if any(i.writes):
        raise NotImplementedError(f"{i.name} writes its arguments and has no kernel for ember tensors (an op outside "
                                  "ATen runs here on CPU only when it returns new tensors); call it on CPU tensors")
    name = op.name()
    if not any(torch._C._dispatch_has_kernel_for_dispatch_key(name, k)
               for k in ("CPU", "CompositeExplicitAutograd", "CompositeImplicitAutograd")):
        raise NotImplementedError(f"{i.name} has no CPU kernel to run for ember tensors (an op outside ATen runs on "
                                  "the client's CPU); call it on CPU tensors")
    refs = [r for r in (ref_or_none(t) for t in tree_flatten((args, kwargs))[0]) if r is not None]
    dev = device_of(refs, i)

    def host(v: Any) -> Any:
        return T.read(v) if isinstance(v, torch.Tensor) and v.device.type == "ember" else v

    res = op(*tree_map(host, args), **tree_map(host, kwargs))
    return tree_map(lambda v: T.upload(v, dev) if isinstance(v, torch.Tensor) and v.device.type == "cpu" else v, res)


def install() -> None:
    for name in _DECOMPOSED:
        base, overload = name.split(".")
        op = getattr(getattr(aten, base), overload)
        fn = _decomposition(op)
        D.SPECIAL[id(op)] = lambda _op, *a, _fn=fn, **k: _fn(*a, **k)
    D.SPECIAL[id(aten._efficientzerotensor.default)] = _zeros
    for op in (aten.lift_fresh_copy.default, aten.lift.default):
        D.SPECIAL[id(op)] = lambda _op, x: aten.clone.default(x)
    D.SPECIAL[id(aten.as_strided_scatter.default)] = _as_strided_scatter
    for base in ("as_strided_copy", "as_strided_scatter"):
        functional = getattr(aten, base).default
        D.SPECIAL[id(getattr(aten, base).out)] = lambda _op, *a, out, _f=functional, **k: _into(out, _f(*a, **k))
    D.on_host = on_host
    D.run_foreign = run_foreign


__all__ = ["install", "on_host", "run_foreign"]
