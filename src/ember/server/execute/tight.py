"""Storages that hold their tensor and nothing else.

A client can read a storage it names whole, so the peer adopts a kernel's result as a session's storage only when
that storage holds the result's elements and nothing else: dense, from byte 0 to its end. Any other result (a
kernel that shrank its output in place, ``unique_consecutive``; a view of a bigger buffer; a layout with holes)
is copied onto a zeroed storage of exactly its extent: memory a kernel left uninitialised can hold bytes another
session freed.
"""

from __future__ import annotations

from typing import Any

import torch

from ...protocol import aten as A


def is_tight(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage holds its elements and nothing else: dense from byte 0 to its end. Only such a
    result's storage is adopted as it is: another one may hold bytes no op of the session wrote (a kernel that
    shrank its output, ``unique_consecutive``; memory another session freed) and the client can read a storage
    whole."""
    if t.storage_offset() != 0 or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        return False
    return t.is_contiguous() or A.dense(t.shape, t.stride())


def adoptable(t: torch.Tensor, nbytes: int, ptrs: Any) -> bool:
    """Whether a kernel's result ``t`` becomes a session's storage of ``nbytes`` as it is: that storage is
    ``nbytes``, shares no operand's memory (``ptrs``: their storages' addresses) and :func:`is_tight`."""
    st = t.untyped_storage()
    return st.nbytes() == nbytes and st.data_ptr() not in ptrs and is_tight(t)


def tight(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when :func:`is_tight`, else a copy in its strides on a zeroed storage of exactly its extent."""
    if is_tight(t):
        return t
    extent = 0 if t.numel() == 0 else (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()
    buf = torch.zeros(extent, dtype=torch.uint8, device=t.device)
    return torch.empty((0,), dtype=t.dtype, device=t.device).set_(buf.untyped_storage(), 0, t.shape,
                                                                  t.stride()).copy_(t)


__all__ = ["is_tight", "tight", "adoptable"]
