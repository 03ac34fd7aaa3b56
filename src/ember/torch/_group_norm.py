"""``native_group_norm``'s gradient on a channels-last input, as CPU torch computes it.

torch's autograd formula (``derivatives.yaml``) hands ``native_group_norm_backward`` the gradient and the input
in the input's own memory format on a CPU tensor, and made contiguous on any other device (as for CUDA). On
ember the peer's CPU kernel then ran on contiguous copies, rounding otherwise than local CPU: a GroupNorm after
an attention block (diffusers' UNets and VAEs, whose ``reshape(B, C, H, W)`` of a transposed tensor has
channels-last strides) trained 2e-7 off from the first step. Here the ``AutogradPrivateUse1`` kernel takes
CPU's formula for such an input; any other call (a contiguous input, no gradient wanted, forward-mode AD,
``torch.func``) is torch's own autograd kernel, unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.autograd.forward_ad as _fwd_ad

aten = torch.ops.aten
_AUTOGRAD = torch._C.DispatchKey.Autograd


def _format(t: torch.Tensor) -> torch.memory_format:
    """``Tensor.suggest_memory_format()`` (channels-last for a 4-d / 5-d tensor laid out so)."""
    if t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if t.dim() == 5 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return torch.contiguous_format


class _GroupNorm(torch.autograd.Function):
    @staticmethod
    def forward(x: Any, w: Any, b: Any, n: int, c: int, hw: int, group: int, eps: float) -> Any:  # type: ignore[override]
        with torch._C._AutoDispatchBelowAutograd():
            return aten.native_group_norm.default(x, w, b, n, c, hw, group, eps)

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        x, w, b, n, c, hw, group, eps = inputs
        ctx.save_for_backward(x, w, b, output[1], output[2])
        ctx.sizes, ctx.eps = (n, c, hw, group), eps
        ctx.mark_non_differentiable(output[1], output[2])

    @staticmethod
    def backward(ctx: Any, grad: Any, _mean: Any, _rstd: Any) -> Any:  # type: ignore[override]
        if grad is None:
            return (None,) * 8
        x, w, b, mean, rstd = ctx.saved_tensors
        need = ctx.needs_input_grad
        if torch.is_grad_enabled():  # (create_graph: torch's twice-differentiable formula, the same on every device)
            y = aten.native_group_norm.default._op_dk(_AUTOGRAD, x, w, b, *ctx.sizes, ctx.eps)[0]
            wanted = [t if t is not None and need[j] else None for j, t in enumerate((x, w, b))]
            got = iter(torch.autograd.grad(y, [t for t in wanted if t is not None], grad, create_graph=True))
            return (*[None if t is None else next(got) for t in wanted], None, None, None, None, None)
        fmt = _format(x)
        gx, gw, gb = aten.native_group_norm_backward.default(
            grad.contiguous(memory_format=fmt), x.contiguous(memory_format=fmt), mean, rstd, w, *ctx.sizes,
            [need[0], w is not None and need[1], need[2]])
        return gx, gw, gb, None, None, None, None, None


def native_group_norm(x: Any, w: Any, b: Any, n: int, c: int, hw: int, group: int, eps: float) -> Any:
    if _format(x) is not torch.contiguous_format and torch.is_grad_enabled() \
            and any(t is not None and t.requires_grad for t in (x, w, b)) \
            and not torch._C._are_functorch_transforms_active() and _fwd_ad._current_level < 0:
        return _GroupNorm.apply(x, w, b, n, c, hw, group, eps)
    return aten.native_group_norm.default._op_dk(_AUTOGRAD, x, w, b, n, c, hw, group, eps)


def install() -> torch.library.Library:
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("native_group_norm", native_group_norm, "AutogradPrivateUse1")
    return lib


__all__ = ["install"]
