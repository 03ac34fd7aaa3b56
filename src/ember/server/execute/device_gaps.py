"""Calls a CUDA device takes and this torch's CPU kernel refuses, run on a CPU peer as CUDA answers them.

Code written for accelerators picks its path by device type: anything but ``"cpu"`` gets the CUDA path.
An ember tensor is such a device, so a ``torch:cpu`` peer receives calls CPU torch never makes. Most are
ordinary; a few are CUDA-only kernels (the fused RNN cells: :mod:`.rnn_cells`) or dtypes the CPU kernel
lacks. Each entry here runs one such call by a CPU kernel that gives CUDA's result:

* ``histc`` of an integer tensor (Hugging Face's Mixture-of-Experts counts tokens per expert with it: "on
  CUDA, no float copy"): the CPU kernel takes floating point only. Run on a float64 copy (exact for every
  int32 and for int64 below 2**53) and cast back: CUDA's integer bins, ``(x - min) * bins // (max - min)``
  with the last edge in the last bin, are the same bins.
"""

from __future__ import annotations

from typing import Any, Callable

import torch


def _histc(op: Any) -> Callable[[list[Any], dict[str, Any]], Any]:
    def run(args: list[Any], kwargs: dict[str, Any]) -> Any:
        x = args[0]
        if not isinstance(x, torch.Tensor) or x.is_floating_point() or x.is_complex() or x.dtype is torch.bool:
            return op(*args, **kwargs)  # (the kernel's own answer, errors included)
        return op(x.to(torch.float64), *args[1:], **kwargs).to(x.dtype)
    return run


def _self_attention(op: Any) -> Callable[[list[Any], dict[str, Any]], Any]:
    """``_native_multi_head_attention(q, k, v, ...)``: CPU's kernel projects q, k and v with one GEMM when they are
    one tensor (``is_same``), which rounds otherwise than three. The wire carries operands, not objects: three
    operands of one storage in one layout are one tensor again (the client sends a copy where its three were
    different tensors of the same memory: ``ember.torch._sdpa``)."""
    def run(args: list[Any], kwargs: dict[str, Any]) -> Any:
        q, k, v = args[:3]
        if all(isinstance(t, torch.Tensor) for t in (q, k, v)) and _same(q, k) and _same(q, v):
            args = [q, q, q, *args[3:]]
        return op(*args, **kwargs)
    return run


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and a.dtype is b.dtype \
        and a.shape == b.shape and a.stride() == b.stride() and a.storage_offset() == b.storage_offset()


_RUNNERS = {"aten::histc": _histc, "aten::_native_multi_head_attention": _self_attention}


def runner(op: Any) -> Callable[[list[Any], dict[str, Any]], Any] | None:
    """How ``op`` runs on bound ``(args, kwargs)`` when its CPU kernel lacks what CUDA's takes, else None."""
    if op._schema.overload_name:  # (the functional overloads only: ``histc.out`` writes a given tensor)
        return None
    make = _RUNNERS.get(op._schema.name)
    return make(op) if make is not None else None


__all__ = ["runner"]
