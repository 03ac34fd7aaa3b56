"""Shapes, strides and dtypes without a round trip: run the overload on meta tensors, once per layout.

On a cache miss every operand becomes a meta view of one meta base per remote storage
(so aliasing is the same as on the peer), the overload runs on metas, and each output
is classified: the input object itself (in-place, ``out=``), a view of an operand's
storage, a fresh storage, or a non-tensor value. The result, a :class:`Plan`, is cached
under the op and its operands' layouts, alias pattern and literal arguments (scalar
*values* are left out of the key, their types kept), so a training step runs the meta
kernels only in its first iteration.
"""

from __future__ import annotations

from typing import Any

import torch

from ..protocol import aten as A
from ..server.execute import rnn_layer
from . import _iter_layout
from ._schema import OpInfo, call
from ._storage import dtype_name

FRESH, VIEW, INPUT, NONE, VALUE = 0, 1, 2, 3, 4


class DataDependent(Exception):
    """The outputs' shapes depend on the values (nonzero, boolean masks...): ask the peer."""


class Plan:
    """What one (op, layouts, literals) does: the message's fixed part and how to build the outputs."""

    __slots__ = ("send", "kwargs", "outputs", "n_fresh", "relayout", "ret", "fresh_nbytes", "value", "grow")

    def __init__(self) -> None:
        self.send = True
        self.kwargs: dict[str, Any] = {}
        self.outputs: list[tuple[Any, ...]] = []   # per flat return: (FRESH, k, dtype, size, stride, off) ...
        self.n_fresh = 0
        self.relayout: list[tuple[int, tuple[int, ...], tuple[int, ...], int]] = []
        self.ret = "one"   # one | tuple | list | none
        self.fresh_nbytes: list[int] = []
        self.value = False  # a non-tensor result: run remotely and read
        self.grow: list[tuple[int, int]] = []  # (operand, bytes): written operands resized before the op


def infer(i: OpInfo, values: list[Any], operands: list[torch.Tensor], template: list[Any],
          layouts: list[Any]) -> Plan:
    """Run the overload on metas and describe its outputs (raises the op's own error for bad calls)."""
    return _infer(i, values, operands, template, layouts, None)[0]


def infer_on_cpu(i: OpInfo, values: list[Any], operands: list[torch.Tensor], template: list[Any],
                 layouts: list[Any], bufs: dict[int, torch.Tensor]) -> tuple[Plan, list[Any]]:
    """``infer`` by the overload itself on CPU tensors over ``bufs`` (``id(storage)`` -> its bytes, a CPU
    ``uint8`` tensor), for a data-dependent call whose deciding operands the client knows; and the CPU results."""
    return _infer(i, values, operands, template, layouts, bufs)


def _infer(i: OpInfo, values: list[Any], operands: list[torch.Tensor], template: list[Any], layouts: list[Any],
           bufs: dict[int, torch.Tensor] | None) -> tuple[Plan, list[Any]]:
    on = "meta" if bufs is None else "cpu"
    bases: dict[int, torch.Tensor] = {}
    metas: list[torch.Tensor] = []
    for t in operands:
        st = t.untyped_storage()
        base = bases.get(id(st))
        if base is None:
            base = bases[id(st)] = torch.empty((st.nbytes(),), dtype=torch.uint8, device="meta") if bufs is None \
                else bufs[id(st)]
        metas.append(torch.empty((0,), dtype=t.dtype, device=on).set_(
            base.untyped_storage(), t.storage_offset(), t.shape, t.stride()))
    it = iter(metas)
    mvalues = []
    for (_n, cat, _k, _d), v in zip(i.args, values):
        if cat == A.TENSOR and isinstance(v, torch.Tensor):
            v = next(it)
        elif cat == A.TENSOR_LIST and v is not None:
            v = [next(it) if isinstance(x, torch.Tensor) else x for x in v]
        elif cat == A.DEVICE and v is not None:
            v = torch.device(on)
        mvalues.append(v)
    before = [(tuple(m.shape), tuple(m.stride()), m.storage_offset()) for m in metas]
    flag = _META_DIFFERS.get(i.base)
    if bufs is None and (flag is not None and any(n == flag and v for (n, *_r), v in zip(i.args, values)) or
                         i.base in _META_DIFFERS_1D and operands and operands[0].dim() <= 1):
        raise DataDependent(f"{i.name}: the meta kernel's shapes differ from the devices' here")
    evaluating = i.base in _EVAL_STATS and not any(n == "training" and v for (n, *_r), v in zip(i.args, values))
    if evaluating and any(i.writes):
        raise DataDependent(f"{i.name}: in evaluation the devices' saved statistics are empty")
    own = _OWN_META.get(i.name) if bufs is None else None
    try:
        res = own(*mvalues) if own is not None else call(i, mvalues)
    except NotImplementedError as e:
        raise DataDependent(str(e)) from None
    except RuntimeError as e:
        if "data-dependent" in str(e) or "without output_size" in str(e) or \
                "meta" in str(e).lower() and "kernel" in str(e).lower():
            raise DataDependent(str(e)) from None
        raise
    if bufs is None and isinstance(res, torch.Tensor) and _iter_layout.elementwise(i.op, i.base) \
            and not any(res is mt for mt in metas):  # a fresh output: laid out as CPU's TensorIterator lays it
        res = _iterator_layout(i, values, mvalues, res)
    if evaluating:  # CPU and CUDA save no statistics in evaluation (the meta kernel sizes them)
        res = (res[0], *[torch.empty((0,), dtype=r.dtype, device="meta") for r in res[1:3]], *res[3:])
    plan = Plan()
    flat: list[Any]
    if isinstance(res, torch.Tensor):
        flat = [res]
    elif isinstance(res, (tuple, list)):
        flat = list(res)
        plan.ret = "list" if isinstance(res, list) else "tuple"
        mask = next((v for (n, *_r), v in zip(i.args, values) if n == "output_mask"), None)
        if mask is not None and bufs is None:  # (a backward's unwanted gradients: the devices make none, where
            flat = [None if k < len(mask) and not mask[k] else r for k, r in enumerate(flat)]  # BN's meta does)
    elif res is None:
        flat, plan.ret = [], "none"
    else:
        flat = [res]
    base_ids = {b.untyped_storage()._cdata: n for n, b in enumerate(bases.values())}
    first_of_base = {}
    for k, t in enumerate(operands):
        first_of_base.setdefault(id(t.untyped_storage()), k)
    order = list(bases)
    specs: list[list[Any]] = []
    for pos, r in enumerate(flat):
        if r is None:  # an undefined tensor (convolution_backward's unneeded gradients...)
            plan.outputs.append((NONE,))
            continue
        if not isinstance(r, torch.Tensor):  # a value the meta kernel knew from metadata alone
            plan.outputs.append((VALUE, r))
            continue
        j = next((k for k, mt in enumerate(metas) if r is mt), None)
        if j is not None:
            plan.outputs.append((INPUT, j))
            continue
        b = base_ids.get(r.untyped_storage()._cdata)
        if b is not None:
            plan.outputs.append((VIEW, first_of_base[order[b]], r.dtype, tuple(r.shape), tuple(r.stride()),
                                 r.storage_offset()))
            continue
        nbytes = max(r.untyped_storage().nbytes(), A.layout_extent(
            [list(r.shape), list(r.stride()), r.storage_offset(), dtype_name(r.dtype)], _ITEMSIZE))
        if nbytes > A.INT64[1]:
            raise RuntimeError(f"{i.name}: a tensor of {nbytes} bytes is too large for any device")
        plan.outputs.append((FRESH, plan.n_fresh, r.dtype, tuple(r.shape), tuple(r.stride()), r.storage_offset()))
        plan.fresh_nbytes.append(nbytes)
        specs.append([pos, list(r.shape), list(r.stride()), r.storage_offset(), dtype_name(r.dtype), nbytes])
        plan.n_fresh += 1
    for k, (m, b) in enumerate(zip(metas, before)):
        now = (tuple(m.shape), tuple(m.stride()), m.storage_offset())
        if now != b:
            plan.relayout.append((k, now[0], now[1], now[2]))
    writes = any(w for w in i.writes)
    pure_view = not writes and plan.n_fresh == 0
    plan.send = not (i.inplace_view or pure_view or i.alloc)
    if plan.send and plan.relayout:  # out= to resize: sized here, so the peer's kernel keeps the client's layout
        layouts = list(layouts)
        for k, size, stride, off in plan.relayout:
            lay = [list(size), list(stride), off, layouts[k][3]]
            layouts[k] = lay
            plan.grow.append((k, A.layout_extent(lay, _ITEMSIZE)))
    plan.kwargs = {"a": template, "l": layouts, "o": specs}
    return plan, flat


def _iterator_layout(i: OpInfo, values: list[Any], mvalues: list[Any], res: torch.Tensor) -> torch.Tensor:
    """``res`` (a meta kernel's output) in the layout CPU's TensorIterator gives it (``_iter_layout``)."""
    operands = []
    overload = i.name.rsplit(".", 1)[1]
    for (name, cat, _k, _d), v, mv in zip(i.args, values, mvalues):
        if cat == A.SCALAR and v is not None and _iter_layout.wraps_scalar(overload, name):
            operands.append(((), (), 8))
            continue
        if cat != A.TENSOR or v is None:
            continue
        if isinstance(mv, torch.Tensor):
            operands.append((tuple(mv.shape), tuple(mv.stride()), mv.element_size()))
        elif isinstance(v, (bool, int, float, complex)):  # a wrapped number: a 0-d operand
            operands.append(((), (), 8))
    if not operands:
        return res
    shape, strides = _iter_layout.output_layout(i.name, i.base, operands)
    if shape != tuple(res.shape) or strides == tuple(res.stride()):
        return res
    return torch.empty_strided(shape, strides, dtype=res.dtype, device="meta")


def _lstsq_meta(a: Any, b: Any, rcond: Any = None, driver: Any = None) -> Any:
    """``linalg_lstsq``'s outputs laid out as CPU torch lays them (the solution column-major in each matrix, a view of
    a buffer of ``max(m, n)`` rows), taken from CPU torch's own kernel on zeroed operands of the same layouts (once per
    call shape: the plan is cached). torch's meta kernel makes the solution contiguous, and a sum over it rounded
    otherwise; FakeTensor refuses the op."""
    def cpu(t: Any) -> Any:
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu").zero_()
    sol = torch.ops.aten.linalg_lstsq.default(cpu(a), cpu(b), rcond, driver=driver)[0]
    out = torch.ops.aten.linalg_lstsq.default(a, b, rcond, driver=driver)  # (the rest as the meta kernel says: the
    return (torch.empty_strided(sol.shape, sol.stride(), dtype=sol.dtype, device="meta"), *out[1:])  # full-rank sizes)


def _grouped_mm_meta(a: torch.Tensor, b: torch.Tensor, offs: Any = None, bias: Any = None,
                     out_dtype: Any = None) -> torch.Tensor:
    """``_grouped_mm``'s output as the devices make it. torch's meta kernel also checks CUDA's rules (bfloat16
    only) where the CPU kernel takes float32 too (a Mixture-of-Experts layer in Hugging Face's transformers);
    the peer's own kernel checks what it takes."""
    from torch._meta_registrations import _create_grouped_mm_output_tensor
    return _create_grouped_mm_output_tensor(a, b, offs, out_dtype)


def _as_on_cpu(name: str) -> Any:
    """The overload run on fake CPU tensors of the metas' layouts: FakeTensor's own rules, which ask the CPU
    backend's choices. torch's meta kernel of a convolution leaves every output contiguous ("meta tensors have
    no device info"), where the CPU kernel follows a channels-last input (ConvNeXt's depthwise convolutions):
    the peer then kept the CPU result in the other layout, and a later reduction over it rounded otherwise."""
    _ns, packet, overload = name.split(".")
    op = getattr(getattr(torch.ops.aten, packet), overload)

    def meta(*args: Any) -> Any:
        from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
        mode, cpu = FakeTensorMode(), torch.device("cpu")

        def fake(t: Any) -> Any:
            return FakeTensor(mode, t, cpu) if isinstance(t, torch.Tensor) and t.device.type == "meta" else t

        def back(t: Any) -> Any:
            return _retyped(t, t.dtype) if isinstance(t, torch.Tensor) else t
        vals = [[fake(x) for x in a] if isinstance(a, list) else fake(a) for a in args]
        names = [(a.name, a.kwarg_only) for a in op._schema.arguments]
        with mode:  # (the values come in schema order: keyword-only ones by name)
            out = op(*[v for v, (_, kw) in zip(vals, names) if not kw],
                     **{n: v for v, (n, kw) in zip(vals, names) if kw})
        return back(out) if not isinstance(out, tuple) else tuple(back(t) for t in out)
    return meta


def _retyped(t: Any, dtype: Any) -> Any:
    """A meta tensor of ``t``'s layout in ``dtype``."""
    return torch.empty_strided(t.shape, t.stride(), dtype=dtype, device="meta")


def _stats_as_on_cpu(name: str, params: tuple[int, ...]) -> Any:
    """A norm's meta kernel, its saved statistics (outputs 1 and 2) typed as the CPU kernel types them: in the
    input's dtype when that is float16 / bfloat16 and the first given of the parameters (``params``: weight,
    bias, running stats) is of it too, else float32 (``is_mixed_type`` / ``param_scalar_type`` in ATen's
    ``layer_norm.cpp``, ``group_norm.cpp``, ``Normalization.cpp``). The meta kernels keep float32 (layer and
    batch norm, as CUDA does) or the input's dtype (group norm), and the peer's result was refused for the
    difference: no half-precision ``LayerNorm`` ran."""
    _ns, packet, overload = name.split(".")
    op = getattr(getattr(torch.ops.aten, packet), overload)

    def meta(*args: Any) -> Any:
        out = op(*args)
        x = args[0]
        if x.dtype in (torch.float16, torch.bfloat16):
            given = next((args[k].dtype for k in params if k < len(args) and isinstance(args[k], torch.Tensor)), None)
            dtype = x.dtype if given in (None, x.dtype) else torch.float32
            out = (out[0], *[_retyped(t, dtype) for t in out[1:3]], *out[3:])
        return out
    return meta


def _weight_norm_meta(v: Any, g: Any, dim: int = 0) -> Any:
    """``_weight_norm_interface``: its saved norm in float32 for a float16 / bfloat16 ``v``, as the CPU kernel keeps
    it (the meta kernel keeps float16 in float16)."""
    w, norm = torch.ops.aten._weight_norm_interface.default(v, g, dim)
    if v.dtype in (torch.float16, torch.bfloat16) and norm.dtype is not torch.float32:
        norm = _retyped(norm, torch.float32)
    return w, norm


def _embedding_bag_meta(name: str) -> Any:
    """``_embedding_bag``'s outputs, its ``offset2bag`` empty in ``sum`` mode without a ``padding_idx``, as the CPU
    kernel's fast path leaves it (the backward rebuilds it from the offsets). The meta kernel sizes it one per
    index, and the peer stored zeros there (``server/execute/declared.LENIENT``): every index in bag 0, wrong
    gradients."""
    op = getattr(torch.ops.aten, name.split(".")[1]).default

    def meta(*args: Any) -> Any:
        out = op(*args)
        mode, padding_idx = args[4], args[8] if len(args) > 8 else -1
        if mode == 0 and (padding_idx is None or padding_idx < 0):
            out = (out[0], torch.empty((0,), dtype=out[1].dtype, device="meta"), *out[2:])
        return out
    return meta


def _returns_nothing(*args: Any) -> None:
    return None


def _group_norm_backward_meta(grad_out: Any, x: Any, mean: Any, rstd: Any, weight: Any, *rest: Any) -> Any:
    """``native_group_norm_backward``'s gradients typed as the CPU kernel makes them (``empty_like`` the input and
    the weight); the meta kernel follows the statistics' dtype, float32 for a half input under float32 weights."""
    out = torch.ops.aten.native_group_norm_backward.default(grad_out, x, mean, rstd, weight, *rest)
    like = (x, weight, weight)
    return tuple(t if t is None or w is None or t.dtype is w.dtype else _retyped(t, w.dtype) for t, w in zip(out, like))


_OWN_META = {"aten.mkldnn_rnn_layer.default": rnn_layer.meta_layer, "aten._grouped_mm.default": _grouped_mm_meta,
             "aten.convolution.default": _as_on_cpu("aten.convolution.default"),
             "aten.convolution_backward.default": _as_on_cpu("aten.convolution_backward.default"),
             "aten.pixel_shuffle.default": _as_on_cpu("aten.pixel_shuffle.default"),
             **{n: _as_on_cpu(n) for n in ("aten._fft_r2c.default", "aten._fft_c2c.default", "aten._fft_c2r.default",
                                           "aten.linalg_eig.default", "aten._linalg_svd.default")},
             **{n: _stats_as_on_cpu(n, params) for n, params in (
                 ("aten.native_layer_norm.default", (2, 3)), ("aten.native_group_norm.default", (1, 2)),
                 ("aten.native_batch_norm.default", (1, 2, 3, 4)),
                 ("aten._native_batch_norm_legit.default", (1, 2, 3, 4)),
                 ("aten._native_batch_norm_legit.no_stats", (1, 2)),
                 ("aten._native_batch_norm_legit_no_training.default", (1, 2, 3, 4)))},
             "aten.native_group_norm_backward.default": _group_norm_backward_meta,
             "aten.linalg_lstsq.default": _lstsq_meta,
             "aten._weight_norm_interface.default": _weight_norm_meta,
             **{n: _embedding_bag_meta(n) for n in ("aten._embedding_bag.default",
                                                    "aten._embedding_bag_forward_only.default")},
             # fused optimizer steps that torch has no meta kernel for (a tensor learning rate, Adagrad): they
             # write their operands in place and return nothing
             **{n: _returns_nothing for n in ("aten._fused_adam_.tensor_lr", "aten._fused_adamw_.tensor_lr",
                                              "aten._fused_sgd_.default", "aten._fused_sgd_.tensor_lr",
                                              "aten._fused_adagrad_.default",
                                              "aten._fused_adagrad_.tensor_lr")}}
"""Ops whose meta kernel sizes an output otherwise than the CPU kernel (oneDNN's LSTM workspace), lays it out
otherwise (a convolution's or ``pixel_shuffle``'s memory format; LAPACK's column-major eigenvectors and ``Vh``; an
n-d real FFT's strides), types it otherwise (a float16 / bfloat16 norm's
saved mean and inverse std: float32 in the meta kernel, as CUDA keeps them; the input's dtype on the CPU when its
weight is of it too) or refuses what it takes (``_grouped_mm`` in float32): shaped here."""

_META_DIFFERS = {"_embedding_bag": "include_last_offset", "_embedding_bag_forward_only": "include_last_offset"}
"""Ops whose meta kernel infers other auxiliary shapes than the CPU/CUDA kernels when a flag is set: run as
data-dependent (the peer's own shapes come back), never guessed."""

_META_DIFFERS_1D = frozenset({"multi_margin_loss", "multilabel_margin_loss_forward"})
"""... and ops whose meta kernel shapes a 0-d or 1-d input's results otherwise than the devices do."""

_EVAL_STATS = frozenset({"native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_no_training"})
"""Batch norms whose saved mean and inverse std are empty on the devices when not training."""

_ITEMSIZE = {dtype_name(d): d.itemsize for d in (
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
    torch.float32, torch.float64, torch.complex64, torch.complex128, torch.uint16, torch.uint32, torch.uint64,
    torch.complex32)}

def install_meta() -> Any:
    """Meta kernels torch lacks for ops whose output shapes follow from their arguments (``torch.histogramdd``'s
    parts: one edge tensor of ``bins[i] + 1`` values per dim, the histogram of ``bins``); returns the library."""
    import torch
    lib = torch.library.Library("aten", "IMPL")

    def bin_edges(x: Any, bins: Any, range: Any = None, weight: Any = None, density: bool = False) -> Any:  # noqa: A002
        torch._check(x.dim() >= 1 and x.shape[-1] == len(bins), lambda: "histogramdd: one bin count per dim")
        return [x.new_empty(int(b) + 1) for b in bins]

    def from_cts(x: Any, bins: Any, range: Any = None, weight: Any = None, density: bool = False) -> Any:  # noqa: A002
        return x.new_empty([int(b) for b in bins])

    def from_tensors(x: Any, bins: Any, *, weight: Any = None, density: bool = False) -> Any:
        return x.new_empty([max(b.numel() - 1, 0) for b in bins])

    lib.impl("_histogramdd_bin_edges", bin_edges, "Meta")
    lib.impl("_histogramdd_from_bin_cts", from_cts, "Meta")
    lib.impl("_histogramdd_from_bin_tensors", from_tensors, "Meta")
    return lib


__all__ = ["install_meta", "Plan", "infer", "DataDependent", "FRESH", "VIEW", "INPUT", "NONE", "VALUE"]
