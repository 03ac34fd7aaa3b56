"""ATen's fused RNN cells where torch ships them for CUDA only: CPU kernels (a ``torch:cpu`` peer)
and the missing meta kernels (the client's shape inference).

For every device but the CPU, torch's ``nn.LSTM`` / ``nn.GRU`` (and their cells) take the fused
path: ``_thnn_fused_lstm_cell``, ``_thnn_fused_gru_cell`` and their backwards. An ``ember``
tensor is such a device, but torch has no CPU kernel for any of the four and no meta kernel for
the GRU pair, so a peer could not run them and the client could not infer their shapes. These
compositions of plain ATen ops follow the CUDA kernels (``aten/src/ATen/native/cuda/RNN.cu``)
gate by gate, workspace layout included, so forward and backward agree wherever they run. Their
arithmetic is CPU torch's own cell's (``RNN.cpp``'s ``LSTMCell`` / ``GRUCell`` and autograd's backward of
it), rounding for rounding: biases added as ``addmm`` adds them, no fused multiply-adds, the gradients
summed as autograd sums them; so the cells on a CPU peer are bit-equal to local CPU torch.
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
    if input_bias is not None and hidden_bias is not None:  # (as CPU's addmm(b_hh, ...).add_(addmm(b_ih, ...)))
        gates = (hidden_gates + hidden_bias) + (input_gates + input_bias)
    else:
        gates = hidden_gates + input_gates
    i, f, g, o = gates.chunk(4, 1)  # activated in place: ``gates`` (a fresh sum) becomes the workspace
    i.sigmoid_(), f.sigmoid_(), g.tanh_(), o.sigmoid_()
    cy = (f * cx).add_(i * g)  # (two roundings, as CPU's cell: addcmul may fuse them into one)
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
    """``(hy, workspace)``; the workspace holds ``[r, z, n, hx, hn + b_hn]``. The activations run in place on the
    gates' column blocks, as CPU's cell runs them: an elementwise kernel over a strided block rounds its
    transcendentals as over that block, not as over a contiguous copy."""
    if input_bias is not None and hidden_bias is not None:
        ig, hg = input_gates + input_bias, hidden_gates + hidden_bias
    else:
        ig, hg = input_gates, hidden_gates.clone()  # (hg is written in place below)
    ir, iz, in_ = ig.unsafe_chunk(3, 1)
    hr, hz, hn = hg.unsafe_chunk(3, 1)
    r = hr.add_(ir).sigmoid_()
    z = hz.add_(iz).sigmoid_()
    hn0 = hn.clone()
    n = in_.add(hn.mul_(r)).tanh_()
    return (hx - n).mul_(z).add_(n), torch.cat([r, z, n, hx, hn0], 1)  # (CPU's cell's roundings, no addcmul)


def gru_cell_backward(grad_hy: Tensor, workspace: Tensor, has_bias: bool) -> tuple[Any, ...]:
    """``(grad_input_gates, grad_hidden_gates, grad_hx, grad_input_bias, grad_hidden_bias)``."""
    r, z, n, hx, hn = workspace.chunk(5, 1)
    gz = _sigmoid_bw(grad_hy * (hx - n), z)
    gn = _tanh_bw(grad_hy - grad_hy * z, n)  # (n's two gradients as autograd sums them for CPU's cell)
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
