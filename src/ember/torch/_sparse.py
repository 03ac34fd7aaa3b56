"""Sparse COO tensors on ember, written in dense ember ops.

A sparse ember tensor is torch's own ``SparseTensorImpl`` on the ember device (dispatch key
``SparsePrivateUse1``) whose indices and values are ordinary dense ember tensors. The peer never holds
a sparse tensor -- the protocol refuses every sparse op (``protocol/aten.py``), so nothing on the
wire is new and every index a sparse op uses reaches the peer as an operand of a dense op (an
``index_put_`` or an advanced index), checked there like any other. Each kernel below is a few dense
ops, as torch writes its own sparse kernels; the ones that read the impl's fields (``_indices``,
``_nnz``, ...) and the constructor run torch's device-agnostic ``SparseMeta`` kernels.

Held: making one (``to_sparse()`` / ``to_sparse(sparse_dim)``, ``torch.sparse_coo_tensor`` with ember
indices and values, a CPU sparse tensor ``.to("ember")``), reading it back (``.cpu()``, ``to_dense()``,
``indices()``/``values()``, ``coalesce()``), ``clone``, ``neg``, ``add``/``sub`` of two sparse tensors,
a dense tensor plus a sparse one (``add``, ``add_``, ``sub``, ``sub_``: an optimizer's step on a sparse gradient, by
CPU's kernel on the peer),
``mul`` by a dense tensor or a scalar, ``sum``, ``sparse_mask``, a matrix's ``t()``, and autograd through them;
and a sparse matrix times a dense one (``mm``, ``spmm``), which CPU torch's own kernel computes on the peer
(``server/execute/sparse_mm.py``: the peer rebuilds the sparse matrix there, its invariants checked). Any other
op on a sparse ember tensor, and sparse CSR/CSC/BSR/BSC layouts, raise ``NotImplementedError``
naming the op (``_device._sparse_refused``).
"""

from __future__ import annotations

from typing import Any

import torch

aten = torch.ops.aten
_META = torch._C.DispatchKeySet(torch._C.DispatchKey.SparseMeta)

#: Ops whose SparseMeta kernel only reads or sets the impl's fields: right for any device.
FIELD_OPS = ("_indices", "_values", "_nnz", "sparse_dim", "dense_dim", "is_coalesced", "_coalesced_",
             "_dimV", "indices", "values", "_sparse_coo_tensor_with_dims_and_tensors",
             "_sparse_coo_tensor_with_dims", "sparse_resize_", "sparse_resize_and_clear_",
             "copy_sparse_to_sparse_")  # (its indices and values copied by dense ember ops)


def _fields(name: str) -> Any:
    op = getattr(aten, name).default

    def kernel(*args: Any, **kwargs: Any) -> Any:
        return op.redispatch(_META, *args, **kwargs)
    return kernel


def _make(indices: torch.Tensor, values: torch.Tensor, size: Any, coalesced: bool) -> torch.Tensor:
    sparse_dim = indices.shape[0]
    return aten._sparse_coo_tensor_with_dims_and_tensors.default(
        sparse_dim, values.dim() - 1, list(size), indices, values, dtype=values.dtype, layout=torch.sparse_coo,
        device=values.device, pin_memory=False, is_coalesced=coalesced)


def _linear(indices: torch.Tensor, size: Any) -> torch.Tensor:
    """Each nonzero's row-major position over the sparse dims (what coalescing sorts by)."""
    lin = torch.zeros(indices.shape[1], dtype=torch.int64, device=indices.device)
    for d in range(indices.shape[0]):
        lin = lin * int(size[d]) + indices[d]
    return lin


def _at(dense: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``dense``'s values at each nonzero's sparse ``indices``: ``[nnz, *dense dims]`` (0 sparse dims: the whole
    tensor, once per nonzero)."""
    if indices.shape[0]:
        return dense[tuple(indices)]
    return dense.unsqueeze(0)[: indices.shape[1]]


def _to_sparse(x: torch.Tensor, sparse_dim: int | None = None) -> torch.Tensor:
    d = x.dim() if sparse_dim is None else sparse_dim
    if not 0 <= d <= x.dim():
        raise RuntimeError(f"sparse_dim must be in [0, {x.dim()}], got {d}")
    mask = x != 0
    if d < x.dim():
        mask = mask.flatten(d).any(-1) if d > 0 else mask.any().reshape(())
    indices = torch.nonzero(mask).t().contiguous() if d > 0 else \
        torch.zeros(0, int(bool(mask)), dtype=torch.int64, device=x.device)
    values = _at(x, indices)
    return _make(indices, values.contiguous(), x.shape, True)


def to_sparse_layout(x: torch.Tensor, *, layout: Any = None, blocksize: Any = None,
                     dense_dim: int | None = None) -> torch.Tensor:
    if layout not in (None, torch.sparse_coo) or blocksize is not None:
        raise NotImplementedError(f"to_sparse(layout={layout}) on ember: only sparse COO tensors are held "
                                  "(CSR/CSC/BSR/BSC are not); convert on CPU")
    return _to_sparse(x, None if dense_dim is None else x.dim() - dense_dim)


def to_sparse_dim(x: torch.Tensor, sparse_dim: int) -> torch.Tensor:
    return _to_sparse(x, sparse_dim)


def to_dense(s: torch.Tensor, dtype: Any = None, masked_grad: Any = None) -> torch.Tensor:
    values = s._values() if dtype is None else s._values().to(dtype)
    out = torch.zeros(s.shape, dtype=values.dtype, device=s.device)
    if s._nnz() == 0:
        return out
    return out.index_put_(tuple(s._indices()), values, accumulate=True)


def coalesce(s: torch.Tensor) -> torch.Tensor:
    indices, values = s._indices(), s._values()
    if s._nnz() == 0 or s.is_coalesced():
        return _make(indices.clone(), values.clone(), s.shape, True)
    lin = _linear(indices, s.shape)
    unique, inverse = torch.unique(lin, sorted=True, return_inverse=True)
    first = torch.full((unique.shape[0],), indices.shape[1], dtype=torch.int64, device=s.device)
    first = first.scatter_reduce(0, inverse, torch.arange(indices.shape[1], device=s.device), "amin")
    summed = torch.zeros((unique.shape[0], *values.shape[1:]), dtype=values.dtype, device=s.device)
    summed = summed.index_add(0, inverse, values)
    return _make(indices[:, first], summed, s.shape, True)


def clone(s: torch.Tensor, *, memory_format: Any = None) -> torch.Tensor:
    return _make(s._indices().clone(), s._values().clone(), s.shape, s.is_coalesced())


def neg(s: torch.Tensor) -> torch.Tensor:
    return _make(s._indices().clone(), -s._values(), s.shape, s.is_coalesced())


def _same_shape(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if a.shape != b.shape:
        raise RuntimeError(f"{what}: sparse tensors of sizes {list(a.shape)} and {list(b.shape)} must match")


def add(a: torch.Tensor, b: Any, *, alpha: Any = 1) -> torch.Tensor:
    if isinstance(b, torch.Tensor) and b.is_sparse and not a.is_sparse:
        return _dense_plus_sparse("add", a, b, alpha)
    if not (isinstance(b, torch.Tensor) and a.is_sparse and b.is_sparse):
        raise NotImplementedError("aten.add on ember: sparse + dense is not held (sparse + sparse and dense + sparse "
                                  "are); use a.to_dense() + b")
    _same_shape(a, b, "add")
    if a.sparse_dim() != b.sparse_dim():
        raise RuntimeError(f"add: expected 'self' and 'other' to have same density, but 'self' has "
                           f"{a.sparse_dim()} sparse dimensions while 'other' has {b.sparse_dim()}")
    vb = b._values() if alpha == 1 else b._values() * alpha
    dtype = torch.promote_types(a.dtype, b.dtype)
    return _make(torch.cat([a._indices(), b._indices()], 1), torch.cat([a._values().to(dtype), vb.to(dtype)]),
                 a.shape, False)


def sub(a: torch.Tensor, b: Any, *, alpha: Any = 1) -> torch.Tensor:
    return add(a, b, alpha=-alpha)


def add_(a: torch.Tensor, b: Any, *, alpha: Any = 1) -> torch.Tensor:
    """``dense.add_(sparse, alpha=...)``: every optimizer's step on a sparse gradient (SGD, Adagrad, SparseAdam on
    ``nn.Embedding(sparse=True)``), by CPU's own kernel on the peer, then copied into ``a``. (A sparse tensor added
    to in place -- SGD's momentum buffer on a sparse gradient -- is not held: done as ``add`` and a copy, SGD with
    momentum came out 2.4e-7 off CPU's in-place kernel.)"""
    if a.is_sparse or not isinstance(b, torch.Tensor):
        raise NotImplementedError("aten.add_ on ember: a sparse tensor added to in place is not held (dense.add_("
                                  "sparse) is; SGD with momentum on sparse gradients is not); use a = a + b")
    return a.copy_(_dense_plus_sparse("add_", a, b, alpha))


def mul_(a: torch.Tensor, b: Any) -> torch.Tensor:
    """``sparse.mul_(number or dense)`` (also ``torch._foreach_mul_``'s, one tensor at a time): ``mul``, copied into
    ``a``."""
    return a.copy_(mul(a, b))


def mul_out(a: Any, b: Any, *, out: torch.Tensor) -> torch.Tensor:
    return out.copy_(mul(a, b))


def copy_(a: torch.Tensor, b: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """A sparse tensor's indices and values replaced by copies of another's (torch's ``copy_sparse_to_sparse_``)."""
    if not (a.is_sparse and b.is_sparse):
        raise NotImplementedError("aten.copy_ on ember: a sparse tensor copied from a dense one (or back) is not "
                                  "held; use .to_sparse() / .to_dense()")
    return aten.copy_sparse_to_sparse_.default(a, b, non_blocking)


def sub_(a: torch.Tensor, b: Any, *, alpha: Any = 1) -> torch.Tensor:
    return add_(a, b, alpha=-alpha)


def _dense_plus_sparse(op: str, a: torch.Tensor, b: torch.Tensor, alpha: Any) -> torch.Tensor:
    """``a + alpha * b``, ``a`` dense and ``b`` sparse, by CPU torch's kernel on the peer (``torch.sparse_add``:
    it adds each nonzero with one fused multiply-add, as no composition of dense ops rounds)."""
    from ..protocol import messages as m
    from ._internal import agreed, call
    _same_shape(a, b, op)
    if a.dtype != b.dtype or a.dtype.is_complex or not agreed(a, m.SPARSE_ADD_FEATURE):
        raise NotImplementedError(f"aten.{op} on ember: a dense tensor plus a sparse one of its real dtype is held, on "
                                  f"a peer that runs torch.sparse_add (here {a.dtype} and {b.dtype}); use "
                                  ".to_dense() on the sparse one")
    alpha = alpha.item() if isinstance(alpha, torch.Tensor) else alpha
    alpha = alpha if type(alpha) in (int, float) else float(alpha)
    return call("torch.sparse_add", [b.is_coalesced(), alpha], [a, b._indices(), b._values()], [(a.shape, a.dtype)])[0]


def mul(a: Any, b: Any) -> torch.Tensor:
    if not (isinstance(a, torch.Tensor) and a.is_sparse):  # (a dense tensor or a number first: foreach's mul.out)
        a, b = b, a
    if isinstance(b, torch.Tensor) and b.is_sparse:
        raise NotImplementedError("aten.mul on ember: sparse * sparse is not held (sparse * dense is); "
                                  "use .to_dense() on one side")
    indices, values = a._indices(), a._values()
    if isinstance(b, torch.Tensor) and b.dim() > 0:
        if b.shape != a.shape:
            raise NotImplementedError("aten.mul on ember: a sparse tensor times a dense one of another shape "
                                      f"({list(a.shape)} and {list(b.shape)}) is not held")
        b = _at(b, indices)
    return _make(indices.clone(), values * b, a.shape, a.is_coalesced())


def sum_all(s: torch.Tensor, *, dtype: Any = None) -> torch.Tensor:
    return s._values().sum(dtype=dtype)


def sparse_mask(dense: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    _same_shape(dense, mask, "sparse_mask")
    indices = mask._indices()
    values = _at(dense, indices)
    return _make(indices.clone(), values.contiguous(), mask.shape, mask.is_coalesced())


def t(s: torch.Tensor) -> torch.Tensor:
    """A sparse matrix's transpose as CPU torch makes it: the indices' two rows swapped, not coalesced."""
    if s.dim() != 2 or s.sparse_dim() != 2:
        raise NotImplementedError("aten.t on ember: only a 2-d sparse matrix of two sparse dims is held")
    return _make(s._indices().flip(0), s._values().clone(), (s.shape[1], s.shape[0]), False)


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A sparse matrix times a dense one, by CPU torch's own kernel on the peer (``server/execute/sparse_mm.py``:
    graph networks' ``torch.spmm(adj, x)`` and its backward, bit-equal to local CPU)."""
    return _sparse_dense("mm", a, b)


def addmm(t: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: Any = 1, alpha: Any = 1) -> torch.Tensor:
    """``beta * t + alpha * (sparse @ dense)`` (``torch.addmm``, ``torch.sparse.mm`` / ``addmm``), by CPU's kernel."""
    if not isinstance(t, torch.Tensor) or t.is_sparse or t.shape != (a.shape[0], b.shape[1] if b.dim() == 2 else -1):
        raise NotImplementedError("aten.addmm on ember: a dense [rows, columns] self plus a sparse matrix times a "
                                  "dense one is held; use .to_dense() for the rest")
    return _sparse_dense("addmm", a, b, (t, beta, alpha))


def _sparse_dense(op: str, a: torch.Tensor, b: torch.Tensor, add: Any = None) -> torch.Tensor:
    from ..protocol import messages as m
    from ._internal import agreed, call
    if not a.is_sparse or b.is_sparse or a.dim() != 2 or a.sparse_dim() != 2 or b.dim() != 2 \
            or not agreed(b, m.SPARSE_MM_FEATURE):
        raise NotImplementedError(f"aten.{op} on ember: a 2-d sparse COO matrix times a dense matrix is held, on a "
                                  "peer that runs torch.sparse_mm; use .to_dense() for the rest")
    if a.shape[1] != b.shape[0]:
        raise RuntimeError(f"mat1 and mat2 shapes cannot be multiplied ({a.shape[0]}x{a.shape[1]} and "
                           f"{b.shape[0]}x{b.shape[1]})")
    if a.dtype != b.dtype or add is not None and add[0].dtype != b.dtype:
        raise RuntimeError(f"{op}: expected the matrices to have one dtype, but got: {a.dtype} and {b.dtype}")
    args = [a.shape[0], a.shape[1], a.is_coalesced()]
    operands = [a._indices(), a._values(), b]
    if add is not None:
        args += [x if type(x) in (int, float) else float(x) for x in add[1:]]  # beta, alpha
        operands.append(add[0])
    return call("torch.sparse_mm", args, operands, [((a.shape[0], b.shape[1]), b.dtype)])[0]


#: ATen name -> kernel for sparse ember operands (SparsePrivateUse1).
SPARSE_KERNELS = {"_to_dense": to_dense, "_coalesce": coalesce, "clone": clone, "neg": neg,
                  "add.Tensor": add, "sub.Tensor": sub, "add_.Tensor": add_, "sub_.Tensor": sub_,
                  "mul.Tensor": mul, "mul_.Tensor": mul_, "mul.out": mul_out, "copy_": copy_, "sum": sum_all,
                  "sparse_mask": sparse_mask, "t": t, "mm": mm, "addmm": addmm, "_sparse_addmm": addmm}
#: ATen name -> kernel for a dense ember operand making a sparse tensor (PrivateUse1).
DENSE_KERNELS = {"_to_sparse": to_sparse_layout, "_to_sparse.sparse_dim": to_sparse_dim}


def install() -> torch.library.Library:
    lib = torch.library.Library("aten", "IMPL")
    for name in FIELD_OPS:
        lib.impl(name, _fields(name), "SparsePrivateUse1")
    for name, kernel in SPARSE_KERNELS.items():
        lib.impl(name, kernel, "SparsePrivateUse1")
    for name, kernel in DENSE_KERNELS.items():
        lib.impl(name, kernel, "PrivateUse1")
    return lib


__all__ = ["install", "DENSE_KERNELS"]
