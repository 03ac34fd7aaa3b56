"""Ember's own torch ops on typed operands (``torch.rnn_layer``, ``torch.sparse_mm``...): the shared wrapper.

Each such op's message is an ``OP`` whose arguments are all operand ids (``smask`` 0) and whose ``kwargs``
are ``{"a": the call's own arguments, "l": one layout per operand, "o": one spec per output}``, as an ATen
call's. :func:`call` makes the typed operands (``aten.operand`` checks each layout against its storage),
runs the op on them, and hands back its results as storage values of exactly the declared specs
(contiguous), or says which result does not match: the client made its tensors from those specs.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

Tensor = torch.Tensor


def call(run: Callable[[Any, list[Tensor]], list[Tensor]], device: Any, operand: Callable[[Any, Any, Any], Tensor],
         as_storage: Callable[[Tensor], Tensor]) -> Callable[..., Any]:
    """The table entry of an internal op whose body is ``run(a, typed operands) -> results``."""
    def op(*bufs: Any, a: Any, l: Any, o: Any) -> Any:  # noqa: E741
        if type(l) is not list or len(l) != len(bufs) or type(o) is not list:
            raise ValueError("malformed call: one layout per operand, a list of output specs")
        res = run(a, [operand(b, lay, device) for b, lay in zip(bufs, l)])
        if len(o) != len(res):
            raise ValueError(f"this call makes {len(res)} outputs, not {len(o)}")
        stored = [_stored(r, spec, as_storage) for r, spec in zip(res, o)]
        return stored[0] if len(stored) == 1 else tuple(stored)  # (one output: the value itself, as ATen's)
    return op


def _stored(r: Tensor, spec: Any, as_storage: Callable[[Tensor], Tensor]) -> Tensor:
    """Result ``r`` as a storage value of exactly its spec (a contiguous layout of its shape and dtype)."""
    r = r.contiguous()
    if type(spec) is not list or len(spec) != 6 or spec[1] != list(r.shape) or spec[2] != list(r.stride()) \
            or spec[3] != 0 or spec[4] != str(r.dtype).removeprefix("torch.") \
            or spec[5] != r.numel() * r.element_size():
        raise ValueError(f"output spec {str(spec)[:100]} is not a contiguous {list(r.shape)} {r.dtype}")
    if r.storage_offset() or r.untyped_storage().nbytes() != spec[5]:
        r = r.clone()
    return as_storage(r)


__all__ = ["call"]
