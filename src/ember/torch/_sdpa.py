"""``scaled_dot_product_attention`` on ember tensors: the kernel the peer's device would pick.

torch's composite picks its kernel through a C++ dispatch stub (``_fused_sdp_choice``) that a Python device
cannot fill, so on ember it would always take the math path. Here the choice is the peer's: on a torch CPU
peer running this torch, CPU torch's own ``_fused_sdp_choice`` on CPU tensors of the same layouts, computed
here (no round trip, and the caller's ``sdpa_kernel`` context counts, as it does locally); on any other peer,
asked of it. Either is cached per device, layout, scalars (and, computed here, the kernel switches). A CPU
peer then runs the same fused CPU kernel local torch runs (bit-equal).

The kernel is registered on the autograd key and on the device's own key, so that ``torch.inference_mode``
(which skips autograd) picks as well; ``torch.func`` transforms and tracing tensors stand in as plain ember
tensors of their layout for the choice.
"""

from __future__ import annotations

from typing import Any

import torch

from . import _devices as Dv
from . import _dispatch as D
from . import _transfer as T
from ._schema import bound, info
from ._storage import ref_of

aten = torch.ops.aten
_FLASH = 1  # sdp::SDPBackend::flash_attention
_choices: dict[Any, Any] = {}
_CHOICES_MAX = 4096


def choice(op: Any, *args: Any, **kwargs: Any) -> Any:
    """``_fused_sdp_choice`` on ember tensors (a metadata-only choice that depends on the peer's hardware).

    CPU torch takes its flash kernel only without dropout (``dropout_p``), and a choice may turn on ``is_causal``,
    ``scale`` or ``enable_gqa`` too: the scalars are in the key."""
    i = info(op)
    values = bound(i, args, kwargs)
    template, operands, refs, scalars, key = D._walk(i, values)
    dev = Dv.device_of(refs, i)
    local = Dv.cpu_peer(dev.info)
    k = (op, id(dev), *key, *[(type(x), x) for x in scalars], *(_flags() if local else ()))
    v = _choices.get(k)
    if v is None:
        if len(_choices) >= _CHOICES_MAX:
            _choices.clear()
        if local:  # this process's CPU torch decides as the peer's would, on the same layouts
            from torch._subclasses.fake_tensor import unset_fake_temporarily
            from torch._subclasses.functional_tensor import disable_functional_mode
            with disable_functional_mode(), unset_fake_temporarily():  # (real CPU tensors while compile traces)
                v = op(*[_on_cpu(v) for v in args], **{k: _on_cpu(v) for k, v in kwargs.items()})
        else:
            v = T.run_dynamic(i, operands, scalars, template, D.layouts_of(operands), values)
        _choices[k] = v
    return v


def _flags() -> tuple[Any, ...]:
    """The process's attention-kernel switches (``sdpa_kernel`` sets them), which CPU torch's choice reads."""
    C = torch._C
    return (C._get_flash_sdp_enabled(), C._get_math_sdp_enabled(), C._get_mem_efficient_sdp_enabled(),
            C._get_cudnn_sdp_enabled(), tuple(C._get_sdp_priority_order()))


def _on_cpu(v: Any) -> Any:
    """An ember tensor as an uninitialized CPU tensor of its layout (the choice reads no values)."""
    if isinstance(v, torch.Tensor) and v.device.type == "ember":
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="cpu")
    return v


def _stand_in(t: Any) -> Any:
    """A tracing tensor (``torch.compile``: Dynamo's fake tensors, AOTAutograd's functional ones) or a
    ``torch.func`` wrapper as a plain ember tensor of its layout on the current device (never written: no message),
    so the peer can be asked which kernel it takes (the compiled graph then holds the kernel eager runs); anything
    else as it is."""
    from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
    from torch._subclasses.functional_tensor import FunctionalTensor, disable_functional_mode
    if isinstance(t, (FakeTensor, FunctionalTensor)):
        from torch.fx.experimental.symbolic_shapes import optimization_hint as hint
        size, stride = [hint(n) for n in t.shape], [hint(n) for n in t.stride()]  # (this call's sizes, no
        with disable_functional_mode(), unset_fake_temporarily():  # guard on them: dynamic=True stays dynamic;
            return torch.empty_strided(size, stride, dtype=t.dtype, device="ember")  # CPU's choice needs no size)
    if isinstance(t, torch.Tensor) and torch._C._functorch.is_functorch_wrapped_tensor(t):
        with torch._C._DisableFuncTorch():
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="ember")
    return t


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any = None, dropout_p: float = 0.0,
         is_causal: bool = False, *, scale: Any = None, enable_gqa: bool = False) -> torch.Tensor:
    """``scaled_dot_product_attention`` on ember tensors, by the kernel the peer's device picks."""
    real = [_stand_in(t) for t in (q, k, v, attn_mask)]
    picked = choice(aten._fused_sdp_choice.default, *real, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # as torch's convert_boolean_attn_mask
        attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device).masked_fill_(
            attn_mask.logical_not(), float("-inf"))
    if picked == _FLASH and not (attn_mask is not None and attn_mask.requires_grad) and Dv.device_of(
            [ref_of(real[0])], info(aten._fused_sdp_choice.default)).info.get("spec", "").startswith("torch:cpu"):
        # (a mask that requires grad -- T5's learned position bias -- takes the math path on CPU: its flash
        # kernel has no gradient for the mask; the peer sees values only, not requires_grad)
        return aten._scaled_dot_product_flash_attention_for_cpu.default(
            q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]
    return aten._scaled_dot_product_attention_math.default(
        q, k, v, attn_mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa)[0]


def native_mha(op: Any, q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> Any:
    """``_native_multi_head_attention`` (``nn.MultiheadAttention``'s inference fast path): the peer passes three
    operands of one storage in one layout as one tensor, as CPU's kernel sees ``m(x, x, x)`` (one GEMM for q, k and
    v; ``server/execute/device_gaps.py``); distinct tensors of the same memory go as copies, as CPU sees them."""
    if not (q is k and k is v):
        k = k.clone() if k is not q and _aliased(k, q) else k
        v = v.clone() if v is not q and v is not k and (_aliased(v, q) or _aliased(v, k)) else v
    return D.kernel_generic(op, q, k, v, *args, **kwargs)


def _aliased(a: Any, b: Any) -> bool:
    """Two tensors on one peer storage."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    r = getattr(a.untyped_storage(), "_ember", None)
    return r is not None and r is getattr(b.untyped_storage(), "_ember", None)


def register(lib: torch.library.Library) -> None:
    lib.impl("scaled_dot_product_attention", sdpa, "AutogradPrivateUse1")
    lib.impl("scaled_dot_product_attention", sdpa, "PrivateUse1")  # (inference mode skips the autograd key)


__all__ = ["choice", "sdpa", "native_mha", "register"]
