"""ATen's fused RNN cells where torch ships them for CUDA only: CPU kernels (a ``torch:cpu`` peer)
and the missing meta kernels (the client's shape inference).

For every device but the CPU, torch's ``nn.LSTM`` / ``nn.GRU`` (and their cells) take the fused
path: ``_thnn_fused_lstm_cell``, ``_thnn_fused_gru_cell`` and their backwards. An ``ember``
tensor is such a device, but torch has no CPU kernel for any of the four and no meta kernel for
the GRU pair, so a peer could not run them and the client could not infer their shapes. These
compositions of plain ATen ops follow the CUDA kernels (``aten/src/ATen/native/cuda/RNN.cu``)
gate by gate, workspace layout included, so forward and backward agree wherever they run.
Results equal local CPU torch to rounding (CPU's own cell adds the biases inside ``addmm``).
"""

from __future__ import annotations

from typing import Any

import torch

Tensor = torch.Tensor
# ``grad * (1 - y) * y`` and ``grad * (1 - y²)`` as ATen's own activation backwards compute them: one kernel
# each (a peer replaying an LSTM step runs these cells ~140 times a step: Python calls are its cost)
_sigmoid_bw, _tanh_bw = torch.ops.aten.sigmoid_backward.default, torch.ops.aten.tanh_backward.default


def lstm_cell(input_gates: Tensor, hidden_gates: Tensor, cx: Tensor, input_bias: Tensor | None = None,
              hidden_bias: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """``(hy, cy, workspace)``; the workspace holds the four activated gates ``[i, f, g, o]``."""
    gates = input_gates + hidden_gates
    if input_bias is not None and hidden_bias is not None:
        gates = gates + input_bias + hidden_bias
    i, f, g, o = gates.chunk(4, 1)  # activated in place: ``gates`` (a fresh sum) becomes the workspace
    i.sigmoid_(), f.sigmoid_(), g.tanh_(), o.sigmoid_()
    cy = torch.addcmul(f * cx, i, g)
    return o * cy.tanh(), cy, gates


def lstm_cell_backward_impl(grad_hy: Tensor | None, grad_cy: Tensor | None, cx: Tensor, cy: Tensor,
                            workspace: Tensor, has_bias: bool) -> tuple[Any, Any, Any]:
    """``(grad_gates, grad_cx, grad_bias)`` (undefined where nothing flows back)."""
    if grad_hy is None and grad_cy is None:
        return None, None, None
    i, f, g, o = workspace.chunk(4, 1)
    tc = cy.tanh()
    go = grad_hy if grad_hy is not None else torch.zeros_like(cy)
    gc = _tanh_bw(go * o, tc)  # go * o * (1 - tc²): one kernel where the expression took four
    if grad_cy is not None:
        gc = gc + grad_cy
    grad_gates = torch.cat([_sigmoid_bw(gc * g, i), _sigmoid_bw(gc * cx, f), _tanh_bw(gc * i, g),
                            _sigmoid_bw(go * tc, o)], 1)
    return grad_gates, gc * f, grad_gates.sum(0) if has_bias else None


def gru_cell(input_gates: Tensor, hidden_gates: Tensor, hx: Tensor, input_bias: Tensor | None = None,
             hidden_bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(hy, workspace)``; the workspace holds ``[r, z, n, hx, hn + b_hn]``."""
    if input_bias is not None and hidden_bias is not None:
        input_gates, hidden_gates = input_gates + input_bias, hidden_gates + hidden_bias
    ir, iz, in_ = input_gates.chunk(3, 1)
    hr, hz, hn = hidden_gates.chunk(3, 1)
    r, z = (ir + hr).sigmoid(), (iz + hz).sigmoid()
    n = (in_ + r * hn).tanh()
    return torch.addcmul(n, z, hx - n), torch.cat([r, z, n, hx, hn], 1)


def gru_cell_backward(grad_hy: Tensor, workspace: Tensor, has_bias: bool) -> tuple[Any, ...]:
    """``(grad_input_gates, grad_hidden_gates, grad_hx, grad_input_bias, grad_hidden_bias)``."""
    r, z, n, hx, hn = workspace.chunk(5, 1)
    gz = _sigmoid_bw(grad_hy * (hx - n), z)
    gn = _tanh_bw(grad_hy * torch.rsub(z, 1), n)
    gr = _sigmoid_bw(gn * hn, r)
    gi, gh = torch.cat([gr, gz, gn], 1), torch.cat([gr, gz, gn * r], 1)
    return gi, gh, grad_hy * z, gi.sum(0) if has_bias else None, gh.sum(0) if has_bias else None


KERNELS = {"_thnn_fused_lstm_cell": lstm_cell, "_thnn_fused_lstm_cell_backward_impl": lstm_cell_backward_impl,
           "_thnn_fused_gru_cell": gru_cell, "_thnn_fused_gru_cell_backward": gru_cell_backward}
_libraries: dict[str, Any] = {}  # a registration lives as long as its Library object


def install(key: str, replace: tuple[str, ...] = ()) -> list[str]:
    """Register these as the ``key`` ("CPU", "Meta") kernels of the ops that have none, and of those
    named in ``replace``; the names registered."""
    if key in _libraries:
        return []
    lib = _libraries[key] = torch.library.Library("aten", "IMPL")
    done = []
    for name, fn in KERNELS.items():
        if name in replace or not torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", key):
            lib.impl(name, fn, key)
            done.append(name)
    return done


__all__ = ["install", "lstm_cell", "lstm_cell_backward_impl", "gru_cell", "gru_cell_backward", "KERNELS"]
