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


_RUNNERS = {"aten::histc": _histc}


def runner(op: Any) -> Callable[[list[Any], dict[str, Any]], Any] | None:
    """How ``op`` runs on bound ``(args, kwargs)`` when its CPU kernel lacks what CUDA's takes, else None."""
    if op._schema.overload_name:  # (the functional overloads only: ``histc.out`` writes a given tensor)
        return None
    make = _RUNNERS.get(op._schema.name)
    return make(op) if make is not None else None


__all__ = ["runner"]
