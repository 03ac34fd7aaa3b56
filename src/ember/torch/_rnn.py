"""``nn.LSTM``, ``nn.LSTMCell`` and ``nn.GRUCell`` on a CPU peer as CPU torch runs them.

The cells (``aten::lstm_cell``, ``aten::gru_cell``) are composites that take a fused kernel
(``_thnn_fused_lstm_cell``, ``_thnn_fused_gru_cell``) on any device but the CPU, as on CUDA, adding the
biases inside it, where CPU torch adds them inside ``addmm``: other rounding (1e-17 in a float64 model's
gradients, pytorch/examples' time_sequence_prediction). On a CPU peer, :func:`lstm_cell` and
:func:`gru_cell` make the gates with ``addmm`` as CPU torch does and hand them to the fused cell without
biases; the peer's fused kernels compute the rest with CPU's rounding. Bit-equal results, three ops.

The layer: one oneDNN layer op per layer and direction.

``aten::lstm.input`` is a composite that picks its path by device: on a CPU tensor (float32, oneDNN
enabled) it runs ``mkldnn_rnn_layer`` per layer and direction, whose backward is one
``mkldnn_rnn_layer_backward``; on any other device it falls back to per-time-step cells, ~10 ATen ops
per time step and layer, forward and backward (~1,800 ops for a 2-layer, 35-step language-model step,
where CPU torch runs 4 kernels). An ``ember`` tensor is such another device. This kernel, registered for
``AutogradPrivateUse1``, takes CPU's path when the peer is a torch CPU device of this torch version:
the same kernels in the same order (``aten/src/ATen/native/mkldnn/RNN.cpp``'s ``mkldnn_rnn``), so the
results are bit-equal to local CPU torch, and autograd records the layer ops as it does on CPU. Anything
else (other peers, dtypes, projections, oneDNN switched off, autocast) takes torch's own composite, as before.

The kernel's ``train`` argument carries the caller's grad mode (the CPU kernel saves its workspace only
with grad on, and reads nothing else from that argument): the peer runs the layer in that mode
(``server/execute/rnn_layer.py``, which also checks the operands and sizes the workspace).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.autograd.forward_ad as _fwd_ad

from ..protocol import messages as m
from ..server.execute.rnn_layer import LSTM
from . import _dispatch as D
from ._internal import agreed, call, cpu_peer
from ._storage import ref_or_none

aten = torch.ops.aten
Tensor = torch.Tensor
#: ATen's own C++ composite (the fused cells on a non-CPU device); ``OpOverload.decompose`` would take
#: torch._decomp's Python one instead (plain cell ops: other rounding, no autocast of the cells)
_COMPOSITE = torch._C.DispatchKey.CompositeImplicitAutograd


def _transformed() -> bool:
    """``torch.func`` transforms or forward-mode AD are on: ember's own RNN kernels (a layer per peer call, the
    fused cells) have no rules for them, so CPU's cells run in plain ops instead (:data:`_PLAIN_STEPS`,
    differentiable every way)."""
    return torch._C._are_functorch_transforms_active() or _fwd_ad._current_level >= 0


def _cpu_peer(t: Tensor) -> bool:
    """Whether ``t`` lives on a torch CPU peer running this torch (oneDNN's workspace sizes must agree)."""
    while torch._C._functorch.is_functorch_wrapped_tensor(t):  # (torch.func's wrappers: the tensor inside)
        t = torch._C._functorch.get_unwrapped(t)
    ref = ref_or_none(t)
    return ref is not None and cpu_peer(ref.device.info)


def takes_onednn(input: Tensor, hx: list[Tensor], params: list[Tensor], n_params: int) -> bool:  # noqa: A002
    """CPU torch's test (``use_mkldnn``: float32, or bfloat16 where oneDNN has it; no projections) for a peer that is
    a CPU; not under autocast, where ember follows CUDA's policy (the cells in the low-precision type:
    ``_autocast.py``). Calls torch would refuse (``n_params`` parameters expected) go to its composite, which says
    why."""
    return (torch.backends.mkldnn.is_available() and torch._C._get_mkldnn_enabled() and len(hx) == 2
            and not torch.is_autocast_enabled(input.device.type) and len(params) == n_params
            and _onednn_dtype(input.dtype) and input.numel() != 0 and input.dim() == 3
            and all(t.dtype is input.dtype for t in (*hx, *params))
            and hx[0].dim() == 3 and hx[1].dim() == 3 and hx[0].shape[2] == hx[1].shape[2] and _cpu_peer(input))


def _onednn_dtype(dtype: torch.dtype) -> bool:
    """CPU torch's dtype test for oneDNN's LSTM: float32, or bfloat16 where this CPU has oneDNN's bfloat16."""
    return dtype is torch.float32 or dtype is torch.bfloat16 and _bf16_supported()


@functools.lru_cache(maxsize=1)
def _bf16_supported() -> bool:
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def lstm(input: Tensor, hx: list[Tensor], params: list[Tensor], has_biases: bool, num_layers: int,  # noqa: A002
         dropout: float, train: bool, bidirectional: bool, batch_first: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``aten::lstm.input`` on ember tensors (see the module's docstring)."""
    per, dirs = 4 if has_biases else 2, 2 if bidirectional else 1
    args = (params, has_biases, num_layers, dropout, train, bidirectional, batch_first)
    # forward AD: CPU's cells in plain ops (oneDNN's layer and the fused cells have no forward derivative; torch.func's
    # other transforms take oneDNN's layer below, as CPU does)
    if _fwd_ad._current_level >= 0 and len(hx) == 2 and hx[0].shape[2] == hx[1].shape[2]:  # (no projections)
        return _lstm_stack(_lstm_plain_step, input, hx, *args)
    if not takes_onednn(input, hx, params, per * num_layers * dirs):
        if len(hx) == 2 and _layers_ok(input, [*hx], params, per, num_layers * dirs) \
                and hx[0].shape[2] == hx[1].shape[2]:  # (no projections)
            return _lstm_stack(_lstm_step, input, hx, *args)
        return aten.lstm.input._op_dk(_COMPOSITE, input, hx, params, has_biases, num_layers, dropout, train,
                                      bidirectional, batch_first)
    x = (input.transpose(0, 1) if batch_first else input).contiguous()
    h0, c0 = hx[0].contiguous(), hx[1].contiguous()
    hidden = h0.shape[2]
    grad = torch.is_grad_enabled()
    hy, cy = [], []
    for layer in range(num_layers):
        outs = []
        for d in range(dirs):
            k = layer * dirs + d
            w = params[k * per:(k + 1) * per]
            b_ih = w[2] if has_biases else torch.zeros(w[0].shape, dtype=w[0].dtype, device=w[0].device)
            b_hh = w[3] if has_biases else torch.zeros(w[1].shape, dtype=w[1].dtype, device=w[1].device)
            o, h, c, _ = aten.mkldnn_rnn_layer.default(x, w[0], w[1], b_ih, b_hh, h0[k], c0[k], d > 0, [], LSTM,
                                                       hidden, num_layers, has_biases, bidirectional, batch_first,
                                                       grad)
            outs.append(o)
            hy.append(h)
            cy.append(c)
        x = outs[0] if dirs == 1 else torch.cat(outs, -1)
        if dropout != 0 and train and layer < num_layers - 1:
            x = torch.dropout(x, dropout, True)
    out = x.transpose(0, 1) if batch_first else x
    return out, torch.stack(hy, 0), torch.stack(cy, 0)


def _lstm_stack(step: Any, input: Tensor, hx: list[Tensor], *args: Any) -> tuple[Tensor, Tensor, Tensor]:  # noqa: A002
    """``nn.LSTM`` as :func:`_stack` of cells ``step``: (output, final hidden states, final cell states)."""
    out, last = _stack(step, input, list(zip(hx[0].unbind(0), hx[1].unbind(0))), *args)
    return out, torch.stack([h for h, _ in last], 0), torch.stack([c for _, c in last], 0)


def _layers_ok(input: Tensor, hx: list[Tensor], params: list[Tensor], per: int, n_hidden: int) -> bool:  # noqa: A002
    """A layer call on a CPU peer that CPU torch would run as its own composite (``RNN.cpp``'s ``FullLayer``):
    batched, one dtype, not under autocast, well formed -- ``per`` parameters and one hidden state in each of
    ``hx`` per layer and direction (``n_hidden``) -- (else torch's composite, which says what is wrong)."""
    return (input.dim() == 3 and input.shape[0] > 0 and len(params) == per * n_hidden
            and all(h.dim() == 3 and h.shape[0] == n_hidden for h in hx)
            and all(t.dtype is input.dtype for t in (*hx, *params)) and input.dtype.is_floating_point
            and not torch.is_autocast_enabled(input.device.type) and _cpu_peer(input))


def _stack(step: Any, input: Tensor, hiddens: list[Any], params: list[Tensor], has_biases: bool,  # noqa: A002
           num_layers: int, dropout: float, train: bool, bidirectional: bool, batch_first: bool) -> tuple[Any, Any]:
    """CPU torch's layer stack for an RNN of cells ``step`` (``_rnn_impl`` with ``FullLayer``): per layer and
    direction, every time step's input projection in one ``linear`` over the whole sequence, then the cell per
    step on its row. On any other device torch projects step by step, which rounds otherwise. Returns (the
    output, each layer's and direction's final hidden)."""
    per, dirs = 4 if has_biases else 2, 2 if bidirectional else 1
    x = input.transpose(0, 1) if batch_first else input
    last: list[Any] = []
    for layer in range(num_layers):
        outs = []
        for d in range(dirs):
            k = layer * dirs + d
            w = params[k * per:(k + 1) * per]
            b_ih, b_hh = (w[2], w[3]) if has_biases else (None, None)
            rows = aten.linear.default(x, w[0], b_ih).unbind(0)
            h, ys = hiddens[k], []
            for row in (reversed(rows) if d else rows):
                h = step(row, h, w[1], b_hh)
                ys.append(h[0] if type(h) is tuple else h)
            outs.append(torch.stack(ys[::-1] if d else ys, 0))
            last.append(h)
        x = outs[0] if dirs == 1 else torch.cat(outs, outs[0].dim() - 1)
        if dropout != 0 and train and layer < num_layers - 1:
            x = torch.dropout(x, dropout, True)
    if batch_first:
        x.transpose_(0, 1)
    return x, last


def _lstm_step(row: Tensor, h: tuple[Tensor, Tensor], w_hh: Tensor, b_hh: Tensor | None) -> tuple[Tensor, Tensor]:
    """CPU's ``LSTMCell`` on a projected input row: ``linear_hh(hx).add_(row)``, then the gates; the fused cell
    computes the gates with CPU's rounding (``server/execute/rnn_cells.py``)."""
    hy, cy, _ = aten._thnn_fused_lstm_cell.default(row, aten.linear.default(h[0], w_hh, b_hh), h[1])
    return hy, cy


def _gru_step(row: Tensor, h: Tensor, w_hh: Tensor, b_hh: Tensor | None) -> Tensor:
    """CPU's ``GRUCell`` on a projected input row, by the fused cell (as :func:`_lstm_step`)."""
    return aten._thnn_fused_gru_cell.default(row, aten.linear.default(h, w_hh, b_hh), h)[0]


def _rnn_layers(name: str, step: Any) -> Any:
    """``aten::<name>.input`` (``nn.GRU``, ``nn.RNN``) on ember tensors: on a CPU peer, CPU torch's composite,
    one layer per call (:class:`_PeerLayer`), or where the peer cannot, its steps (:func:`_stack`); torch's own
    composite elsewhere."""
    op = getattr(aten, name).input

    def layers(input: Tensor, hx: Tensor, params: list[Tensor], has_biases: bool, num_layers: int,  # noqa: A002
               dropout: float, train: bool, bidirectional: bool, batch_first: bool) -> tuple[Tensor, Tensor]:
        if _transformed():
            out, last = _stack(_PLAIN_STEPS[name], input, list(hx.unbind(0)), params, has_biases, num_layers,
                               dropout, train, bidirectional, batch_first)
            return out, torch.stack(last, 0)
        if not _layers_ok(input, [hx], params, 4 if has_biases else 2, num_layers * (2 if bidirectional else 1)):
            return op._op_dk(_COMPOSITE, input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
                             batch_first)
        if _whole_layers(input):
            return _by_layer(name, input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
                             batch_first)
        out, last = _stack(step, input, list(hx.unbind(0)), params, has_biases, num_layers, dropout, train,
                           bidirectional, batch_first)
        return out, torch.stack(last, 0)
    return layers


def _whole_layers(input: Tensor) -> bool:  # noqa: A002
    """Does the peer run a layer whole (feature ``"rnn_layers"``)? Not while a capture or an optimizer step
    records the calls (they see ops through the dispatcher, and this layer's backward is recorded by hand)."""
    return D.note is None and D.guide is None and input.dtype in (torch.float32, torch.float64) \
        and agreed(input, m.RNN_FEATURE)


def _by_layer(name: str, input: Tensor, hx: Tensor, params: list[Tensor], has_biases: bool,  # noqa: A002
              num_layers: int, dropout: float, train: bool, bidirectional: bool, batch_first: bool) -> tuple[Any, Any]:
    """CPU torch's ``_rnn_impl_with_concat``, one layer (both directions) per :class:`_PeerLayer`: the same
    layer composites on the same operands, the dropout between layers its own op, as there."""
    per, dirs = 4 if has_biases else 2, 2 if bidirectional else 1
    x = input.transpose(0, 1) if batch_first else input
    last = []
    for layer in range(num_layers):
        k = layer * dirs
        x, h = _PeerLayer.apply(name, has_biases, bidirectional, x, hx[k:k + dirs], *params[k * per:(k + dirs) * per])
        last.append(h)
        if dropout != 0 and train and layer < num_layers - 1:
            x = torch.dropout(x, dropout, True)
    return (x.transpose(0, 1) if batch_first else x), (last[0] if num_layers == 1 else torch.cat(last, 0))


class _PeerLayer(torch.autograd.Function):
    """One layer of ``nn.GRU`` / ``nn.RNN`` on a CPU peer: forward, one call of the peer's ``torch.rnn_layer``
    (torch's layer composite, run as CPU torch runs it); backward, one call of ``torch.rnn_layer_backward``,
    which recomputes that layer with autograd on (``server/execute/rnn_recompute.py``). Both say which operands
    require grad here: the composite's rounding depends on it."""

    @staticmethod
    def forward(ctx: Any, name: str, has_biases: bool, bidirectional: bool, x: Tensor, hx: Tensor,
                *params: Tensor) -> tuple[Tensor, Tensor]:
        ctx.set_materialize_grads(False)  # (an unused output's gradient stays None, as in CPU torch's graph)
        ctx.grads = [t.requires_grad for t in (x, hx, *params)]
        ctx.layer = [name, has_biases, bidirectional, ctx.grads]
        ctx.save_for_backward(x, hx, *params)
        dirs, hidden = 2 if bidirectional else 1, params[1].shape[1]
        like = [(x.shape[0], x.shape[1], dirs * hidden), (dirs, x.shape[1], hidden)]
        return tuple(call("torch.rnn_layer", ctx.layer, [x, hx, *params], [(s, x.dtype) for s in like]))

    @staticmethod
    def backward(ctx: Any, g_out: Tensor | None, g_hn: Tensor | None) -> tuple[Any, ...]:
        x, hx, *params = ctx.saved_tensors
        given = [g for g in (g_out, g_hn) if g is not None]
        if not given or not any(ctx.grads):
            return (None,) * (3 + len(ctx.grads))
        if torch.is_grad_enabled():  # create_graph (a gradient penalty, a Hessian): the layer's composite recorded
            return _PeerLayer._differentiable(ctx, g_out, g_hn)  # here, differentiated with a graph
        operands = [x, hx, *given, *params]
        wanted = [t for t, g in zip((x, hx, *params), ctx.grads) if g]
        got = iter(call("torch.rnn_layer_backward", [*ctx.layer, g_out is not None, g_hn is not None], operands,
                        [(t.shape, t.dtype) for t in wanted]))
        return (None, None, None, *[next(got) if g else None for g in ctx.grads])


    @staticmethod
    def _differentiable(ctx: Any, g_out: Tensor | None, g_hn: Tensor | None) -> tuple[Any, ...]:
        """The backward as a differentiable function of the saved operands: the layer recomputed here from them in
        CPU's plain cells (:data:`_PLAIN_STEPS`), then ``autograd.grad`` with ``create_graph``, so that a second
        derivative flows back to them."""
        name, has_biases, bidirectional, grads = ctx.layer
        x, hx, *params = ctx.saved_tensors
        out = _stack(_PLAIN_STEPS[name], x, list(hx.unbind(0)), params, has_biases, 1, 0.0, False, bidirectional,
                     False)
        out = (out[0], torch.stack(out[1], 0))
        pairs = [(o, g) for o, g in zip(out, (g_out, g_hn)) if g is not None]
        wanted = [t for t, g in zip((x, hx, *params), grads) if g]
        got = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], create_graph=True,
                                       allow_unused=True))
        return (None, None, None, *[next(got) if g else None for g in grads])


def _simple_step(act: Any) -> Any:
    """CPU's ``SimpleCell``: ``act(linear_hh(h).add_(row))`` (``act``: ``tanh`` or ``relu``; all out of place, the same
    values, so that ``vmap`` may batch the row alone)."""
    def step(row: Tensor, h: Tensor, w_hh: Tensor, b_hh: Tensor | None) -> Tensor:
        return act(aten.linear.default(h, w_hh, b_hh) + row)
    return step


def _lstm_plain_step(row: Tensor, h: tuple[Tensor, Tensor], w_hh: Tensor, b_hh: Tensor | None) -> tuple[Tensor,
                                                                                                         Tensor]:
    """CPU's ``LSTMCell`` on a projected input row, in plain ops (``RNN.cpp``'s, out of place, so that ``vmap`` may
    batch any of them): differentiable every way."""
    i, f, g, o = (aten.linear.default(h[0], w_hh, b_hh) + row).unsafe_chunk(4, 1)
    cy = f.sigmoid() * h[1] + i.sigmoid() * g.tanh()
    return o.sigmoid() * cy.tanh(), cy


def _gru_plain_step(row: Tensor, h: Tensor, w_hh: Tensor, b_hh: Tensor | None) -> Tensor:
    """CPU's ``GRUCell`` on a projected input row, in plain ops (as :func:`_lstm_plain_step`)."""
    ir, ii, in_ = row.unsafe_chunk(3, 1)
    hr, hi, hn = aten.linear.default(h, w_hh, b_hh).unsafe_chunk(3, 1)
    reset, update = (hr + ir).sigmoid(), (hi + ii).sigmoid()
    new = (in_ + hn * reset).tanh()
    return (h - new) * update + new


_PLAIN_STEPS = {"gru": _gru_plain_step, "rnn_tanh": _simple_step(torch.tanh), "rnn_relu": _simple_step(torch.relu)}


def _cell_ok(input: Tensor, hx: list[Tensor], w_ih: Tensor, w_hh: Tensor, gates: int) -> bool:  # noqa: A002
    """A batched cell call CPU torch would take its composite path for, on a CPU peer, not under autocast
    (anything else, malformed calls included, goes to torch's own composite, which says what is wrong)."""
    if input.dim() != 2 or w_ih.dim() != 2 or w_hh.dim() != 2 or any(h.dim() != 2 for h in hx):
        return False
    n, hidden = input.shape[0], w_hh.shape[1]
    return (input.shape[1] == w_ih.shape[1] and w_ih.shape[0] == w_hh.shape[0] == gates * hidden
            and all(tuple(h.shape) == (n, hidden) for h in hx)
            and not torch.is_autocast_enabled(input.device.type) and _cpu_peer(input))


def lstm_cell(input: Tensor, hx: list[Tensor], w_ih: Tensor, w_hh: Tensor, b_ih: Tensor | None = None,  # noqa: A002
              b_hh: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``aten::lstm_cell`` (``nn.LSTMCell``) on ember tensors. Torch's composite takes the fused cell for any
    device but the CPU, as on CUDA, with the biases added inside it; CPU torch adds them inside ``addmm``
    (``RNN.cpp``'s ``LSTMCell``: ``linear_hh(hx).add_(linear_ih(input))``), which rounds otherwise. On a CPU
    peer this makes the gates as CPU does and gives them to the fused cell without biases, whose kernel
    computes the rest with CPU's rounding (``server/execute/rnn_cells.py``): bit-equal, and three ops."""
    if _transformed() and len(hx) == 2:
        return _lstm_plain_step(aten.linear.default(input, w_ih, b_ih), (hx[0], hx[1]), w_hh, b_hh)
    if len(hx) != 2 or not _cell_ok(input, hx, w_ih, w_hh, 4):
        return aten.lstm_cell.default._op_dk(_COMPOSITE, input, hx, w_ih, w_hh, b_ih, b_hh)
    hy, cy, _ = aten._thnn_fused_lstm_cell.default(aten.linear.default(input, w_ih, b_ih),
                                                   aten.linear.default(hx[0], w_hh, b_hh), hx[1])
    return hy, cy


def gru_cell(input: Tensor, hx: Tensor, w_ih: Tensor, w_hh: Tensor, b_ih: Tensor | None = None,  # noqa: A002
             b_hh: Tensor | None = None) -> Tensor:
    """``aten::gru_cell`` (``nn.GRUCell``) on ember tensors, as :func:`lstm_cell`: the gates made as CPU torch
    makes them (``addmm`` with the biases), then the fused cell without biases."""
    if _transformed():
        return _gru_plain_step(aten.linear.default(input, w_ih, b_ih), hx, w_hh, b_hh)
    if not _cell_ok(input, [hx], w_ih, w_hh, 3):
        return aten.gru_cell.default._op_dk(_COMPOSITE, input, hx, w_ih, w_hh, b_ih, b_hh)
    return aten._thnn_fused_gru_cell.default(aten.linear.default(input, w_ih, b_ih),
                                             aten.linear.default(hx, w_hh, b_hh), hx)[0]


def install() -> Any:
    """Register :func:`lstm`, :func:`lstm_cell` and :func:`gru_cell` for ember tensors; returns the library
    (the registrations live as long as it)."""
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("lstm.input", lstm, "AutogradPrivateUse1")
    lib.impl("lstm_cell", lstm_cell, "AutogradPrivateUse1")
    lib.impl("gru_cell", gru_cell, "AutogradPrivateUse1")
    lib.impl("gru.input", _rnn_layers("gru", _gru_step), "AutogradPrivateUse1")
    lib.impl("rnn_tanh.input", _rnn_layers("rnn_tanh", _simple_step(torch.tanh)), "AutogradPrivateUse1")
    lib.impl("rnn_relu.input", _rnn_layers("rnn_relu", _simple_step(torch.relu)), "AutogradPrivateUse1")
    return lib


__all__ = ["install", "lstm", "lstm_cell", "gru_cell", "takes_onednn"]
