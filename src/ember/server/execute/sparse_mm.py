"""A sparse COO matrix times a dense one on a CPU peer, by CPU torch's own kernel (``torch.sparse_mm``).

The peer holds no sparse tensors (``protocol/aten.py`` refuses every sparse ATen op): a sparse ember tensor
is dense indices and values on the peer (``ember/torch/_sparse.py``). Graph networks multiply one by a
dense matrix every layer (pytorch/examples' gcn: ``torch.spmm(adj, x)``, and autograd's ``adj.t() @
grad``), and CPU torch does it with one kernel that adds each nonzero's row of products in the order of
the nonzeros, rounding as no composition of dense ops does. ``torch.sparse_mm`` rebuilds the sparse
matrix on the peer from its indices and values -- ``sparse_coo_tensor`` with its invariants checked:
every index within the sizes, and a matrix the client calls coalesced really sorted and unique -- and runs
that kernel: bit-equal to local CPU.

Message (:mod:`.internal_calls`): operands ``indices`` (int64, ``[2, nnz]``), ``values`` (``[nnz]``),
``dense`` (``[m, k]``); ``a`` = ``[n, m, coalesced]``; one output, ``[n, k]`` of the values' dtype. With ``a`` =
``[n, m, coalesced, beta, alpha]`` and a fourth operand ``t``: ``addmm(t, sparse, dense, beta, alpha)``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

Tensor = torch.Tensor
#: The largest side of a sparse matrix (an int64 linear index of its nonzeros must not overflow).
MAX_SIDE = 1 << 31


def sparse_mm(a: Any, ts: list[Tensor]) -> list[Tensor]:
    """``[sparse(indices, values, (n, m)) @ dense]``, or with ``a`` = ``[n, m, coalesced, beta, alpha]`` and a fourth
    operand ``t``: ``[addmm(t, sparse, dense, beta=beta, alpha=alpha)]`` (``torch.sparse.mm``, ``torch.addmm``)."""
    if type(a) is not list or len(a) not in (3, 5) or len(ts) != len(a) - (0 if len(a) == 3 else 1) \
            or any(type(x) is not int or not 0 <= x < MAX_SIDE for x in a[:2]) or type(a[2]) is not bool \
            or any(type(x) not in (int, float) for x in a[3:]):
        raise ValueError(f"malformed torch.sparse_mm call: a = [rows, columns, coalesced] and three operands, or "
                         f"[rows, columns, coalesced, beta, alpha] and four; got {str(a)[:60]}")
    indices, values, dense = ts[:3]
    if indices.dtype is not torch.int64 or indices.dim() != 2 or indices.shape[0] != 2 or values.dim() != 1:
        raise ValueError("torch.sparse_mm: int64 indices of shape [2, nnz] and values of shape [nnz]")
    s = torch.sparse_coo_tensor(indices, values, (a[0], a[1]), is_coalesced=a[2], check_invariants=True)
    return [torch.mm(s, dense) if len(a) == 3 else torch.addmm(ts[3], s, dense, beta=a[3], alpha=a[4])]


def sparse_add(a: Any, ts: list[Tensor]) -> list[Tensor]:
    """``[dense + alpha * sparse(indices, values, dense.shape)]`` (``dense.add_(sparse, alpha=...)``)."""
    if type(a) is not list or len(a) != 2 or type(a[0]) is not bool or type(a[1]) not in (int, float) \
            or len(ts) != 3:
        raise ValueError(f"malformed torch.sparse_add call: a = [coalesced, alpha] and three operands; "
                         f"got {str(a)[:60]}")
    dense, indices, values = ts
    if indices.dtype is not torch.int64 or indices.dim() != 2 or not 0 < indices.shape[0] <= dense.dim() \
            or values.dtype != dense.dtype or values.dim() != 1 + dense.dim() - indices.shape[0]:
        raise ValueError("torch.sparse_add: int64 indices of shape [sparse_dim, nnz] and values of shape "
                         "[nnz, *dense_dims] of the dense tensor's dtype")
    sides = dense.shape[:indices.shape[0]]
    if any(n >= MAX_SIDE for n in sides) or math.prod(sides) >= 1 << 62:
        raise ValueError("torch.sparse_add: each sparse dimension under 2**31, their product under 2**62")
    s = torch.sparse_coo_tensor(indices, values, dense.shape, is_coalesced=a[0], check_invariants=True)
    return [torch.add(dense, s, alpha=a[1])]


__all__ = ["sparse_mm", "sparse_add", "MAX_SIDE"]
