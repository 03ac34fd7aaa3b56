"""Recording one of Ember's own peer ops (``protocol/aten.py``'s INTERNAL, ``server/execute/internal_calls.py``):
``torch.rnn_layer`` and its backward (``_rnn.py``), ``torch.sparse_mm`` (``_sparse.py``). Each is an ``OP`` of
operand ids whose ``kwargs`` carry the op's own arguments, the operands' layouts and the outputs' specs
(contiguous), from which the outputs' tensors are made here, as for an ATen call."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..protocol import codec
from . import _dispatch as D
from ._devices import cpu_peer, materialize
from ._storage import StorageRef, dtype_name, live_session, new_tensor, ref_of


def agreed(t: torch.Tensor, feature: str) -> bool:
    """Does the peer of ember tensor ``t`` speak wire feature ``feature`` (its internal ops)?"""
    return feature in codec.agreed_features(ref_of(t).session.welcome_features)


def call(name: str, a: list[Any], operands: list[torch.Tensor], outs: list[tuple[Any, torch.dtype]],
         dev: Any = None) -> list[Any]:
    """Record the internal op ``name`` on ``operands`` (ember tensors of one peer; none: on Ember device ``dev``)
    and make its outputs, contiguous, of the given (shape, dtype)."""
    refs = [ref_of(t) for t in operands]
    s = live_session(refs[0]) if refs else dev.session
    for r in refs:
        if r.pending is not None:
            materialize(r)
    specs = [[j, list(shape), list(torch.empty(shape, device="meta").stride()), 0, dtype_name(dtype),
              math.prod(shape) * dtype.itemsize] for j, (shape, dtype) in enumerate(outs)]
    sids = [next(s.ids) for _ in outs]
    s.record([D._OP, name, [r.sid for r in refs], 0, sids, {"a": a, "l": D.layouts_of(operands), "o": specs}])
    dev = refs[0].device if refs else dev
    return [new_tensor(dtype, spec[1], spec[2], 0, ref=StorageRef(sid, s, dev))
            for (_, dtype), spec, sid in zip(outs, specs, sids)]


__all__ = ["agreed", "call", "cpu_peer"]
