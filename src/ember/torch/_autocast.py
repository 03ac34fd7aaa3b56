"""``torch.autocast("ember", dtype=...)``: mixed precision on ember tensors, with CUDA's policy.

torch gives a PrivateUse1 device an autocast dispatch key (``AutocastPrivateUse1``) but registers
nothing for it: the first op under ``torch.autocast("ember")`` failed. Here every op falls through
that key except the ones CUDA's autocast handles, which get CUDA's policy
(``ATen/autocast_mode.h``, the lists below): matmuls, convolutions, linear layers, RNN cells
and attention run in the autocast dtype; the numerically touchy ops (exp, log, norms, losses,
softmax...) in float32; mixed-type ops at the widest type; ``binary_cross_entropy`` is refused as
on CUDA. Casts happen on the client, lazily, as ``_to_copy`` ops recorded like any other
(unlike CUDA, casted weights are not cached within a region: one cast per use).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

KEY = "AutocastPrivateUse1"
_EXCLUDE = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)

LOWER = """_convolution.deprecated _convolution conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d.input
conv_transpose3d.input convolution prelu addmm addmv addr matmul einsum mm mv linalg_vecdot linear addbmm baddbmm bmm
chain_matmul linalg_multi_dot _thnn_fused_lstm_cell _thnn_fused_gru_cell lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell
_scaled_dot_product_flash_attention scaled_dot_product_attention""".split()
FP32 = """acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow.Tensor_Scalar
pow.Tensor_Tensor pow.Scalar softplus layer_norm native_layer_norm rms_norm group_norm frobenius_norm.dim nuclear_norm
nuclear_norm.dim cosine_similarity poisson_nll_loss cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss
kl_div l1_loss smooth_l1_loss huber_loss mse_loss margin_ranking_loss multilabel_margin_loss soft_margin_loss
triplet_margin_loss multi_margin_loss binary_cross_entropy_with_logits dist pdist cdist renorm logsumexp
upsample_nearest1d _upsample_nearest_exact1d upsample_nearest2d _upsample_nearest_exact2d upsample_nearest3d
_upsample_nearest_exact3d upsample_linear1d upsample_bilinear2d _upsample_bilinear2d_aa upsample_trilinear3d
upsample_bicubic2d _upsample_bicubic2d_aa""".split()
FP32_SET_DTYPE = """prod prod.dim_int softmax.int log_softmax.int cumprod cumsum linalg_vector_norm linalg_matrix_norm
linalg_matrix_norm.str_ord sum sum.dim_IntList""".split()
FP32_APPEND_DTYPE = {"norm.Scalar": "ScalarOpt_dtype", "norm.ScalarOpt_dim": "ScalarOpt_dim_dtype"}
PROMOTE = "addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot scatter_add".split()
BANNED = {"binary_cross_entropy": "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to "
          "autocast. Many models use a sigmoid layer right before the binary cross entropy layer. In this case, "
          "combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits or "
          "torch.nn.BCEWithLogitsLoss. binary_cross_entropy_with_logits and BCEWithLogits are safe to autocast."}


def eligible(v: Any) -> bool:
    """A tensor autocast may cast: floating point, on ember, not float64."""
    return isinstance(v, torch.Tensor) and v.device.type == "ember" and v.is_floating_point() \
        and v.dtype is not torch.float64


def _cast(v: Any, dtype: torch.dtype) -> Any:
    if isinstance(v, torch.Tensor):
        return v.to(dtype) if eligible(v) and v.dtype is not dtype else v
    if isinstance(v, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in v):
        return type(v)(_cast(x, dtype) for x in v)
    return v


def _tensors(args: Any) -> Any:
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (x for x in a if isinstance(x, torch.Tensor))


def _casting(op: Any, dtype_of: Callable[[tuple[Any, ...], dict[str, Any]], torch.dtype]) -> Callable[..., Any]:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            dt = dtype_of(args, kwargs)
            return op(*(_cast(a, dt) for a in args), **{k: _cast(v, dt) for k, v in kwargs.items()})
    return kernel


def _lower(_args: Any, _kwargs: Any) -> torch.dtype:
    return torch.get_autocast_dtype("ember")


def _fp32(_args: Any, _kwargs: Any) -> torch.dtype:
    return torch.float32


def _widest(args: Any, kwargs: Any) -> torch.dtype:
    """CUDA's ``promote_type``: the autocast dtype, unless an eligible operand is float32."""
    ts = [t for t in _tensors([*args, *kwargs.values()]) if eligible(t)]
    return torch.float32 if any(t.dtype is not torch.get_autocast_dtype("ember") for t in ts) \
        else torch.get_autocast_dtype("ember")


def _set_dtype(op: Any) -> Callable[..., Any]:
    """float32 through the op's own ``dtype`` argument, when its first operand is eligible and the
    caller chose no dtype."""
    names = [a.name for a in op._schema.arguments]
    at = names.index("dtype")

    def kernel(*args: Any, **kwargs: Any) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            given = args[at] if len(args) > at else kwargs.get("dtype")
            if given is None and args and eligible(args[0]):
                if len(args) > at:
                    args = (*args[:at], torch.float32, *args[at + 1:])
                else:
                    kwargs = {**kwargs, "dtype": torch.float32}
            return op(*args, **kwargs)
    return kernel


def _append_dtype(op: Any, with_dtype: Any) -> Callable[..., Any]:
    """``norm``: an eligible call goes to the overload that takes a dtype, with float32."""
    rest = op._schema.arguments

    def kernel(*args: Any, **kwargs: Any) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            if args and eligible(args[0]):
                full = [*args, *(kwargs.get(a.name, a.default_value) for a in rest[len(args):])]
                return with_dtype(*full, dtype=torch.float32)
            return op(*args, **kwargs)
    return kernel


def _refuse(why: str) -> Callable[..., Any]:
    def kernel(*_args: Any, **_kwargs: Any) -> Any:
        raise RuntimeError(why)
    return kernel


def _overload(name: str) -> Any:
    op, _, overload = name.partition(".")
    packet = getattr(torch.ops.aten, op, None)
    return None if packet is None else getattr(packet, overload or "default", None)


def install() -> list[Any]:
    """Register the fallthrough and the policies; the Library objects (keep them alive)."""
    fall = torch.library.Library("_", "IMPL")
    fall.fallback(torch.library.fallthrough_kernel, KEY)
    lib = torch.library.Library("aten", "IMPL")
    kernels: dict[str, Callable[[Any], Callable[..., Any]]] = {}
    kernels.update({n: lambda op: _casting(op, _lower) for n in LOWER})
    kernels.update({n: lambda op: _casting(op, _fp32) for n in FP32})
    kernels.update({n: _set_dtype for n in FP32_SET_DTYPE})
    kernels.update({n: lambda op: _casting(op, _widest) for n in PROMOTE})
    for name, make in kernels.items():
        op = _overload(name)
        if op is not None:  # (an op a torch version lacks is simply not there to autocast)
            lib.impl(name, make(op), KEY)
    for name, other in FP32_APPEND_DTYPE.items():
        op, with_dtype = _overload(name), _overload(f"{name.split('.')[0]}.{other}")
        if op is not None and with_dtype is not None:
            lib.impl(name, _append_dtype(op, with_dtype), KEY)
    for name, why in BANNED.items():
        lib.impl(name, _refuse(why), KEY)
    return [fall, lib]


__all__ = ["install", "eligible", "KEY"]
