"""``nn.GRU`` and ``nn.RNN`` layers on a CPU peer: torch's layer composite run whole, its backward recomputed.

CPU torch runs ``aten::gru.input``, ``rnn_tanh.input`` and ``rnn_relu.input`` as C++ composites
(``RNN.cpp``'s ``_rnn_impl_with_concat``): the input projection of every time step in one ``linear``,
then per step a cell of a few plain ops, whose autograd graph holds every step. ``ember.torch``
(``torch/_rnn.py``) used to send those ops one by one (~3 per step and layer forward, ~6 backward: a
35-step, 2-layer language model's step was ~600 messages, and the client's Python per op set its pace).
With feature ``"rnn_layers"`` it sends each layer as one call of the internal op ``torch.rnn_layer``,
which runs torch's composite for that layer as local CPU torch runs it, and the layer's backward as one
call of ``torch.rnn_layer_backward``, which runs the same composite again on the same operands with
autograd on and takes the gradients out of that graph: local CPU torch's own backward, rounding for
rounding. One layer's forward draws nothing (dropout sits between layers: the client sends it as its own
op, on the session's stream). The cost is one more forward on the peer.

Both calls name which operands require grad on the client (``grads``): the composite's arithmetic
depends on it (``matmul`` folds a 3-d input into one ``mm`` when the weight requires grad, and otherwise
may not: other rounding), so each runs on operands marked as the client's are. Nothing is kept between
the two calls: each is a function of its operands -- the layer's input, initial hidden state and
parameters, and for the backward the gradients of its outputs -- whose layouts are checked as any ATen
operand's are (``aten.operand``); torch's composite checks every size, and both results are checked
against the specs the client declared. The backward's graph lives for the call only; its activations
are the call's temporaries, as a convolution's workspace is. What is charged up front are the declared
outputs.

Messages (``OP``, ``smask`` 0, every argument an operand id; ``kwargs`` ``{"a", "l", "o"}``):

* ``torch.rnn_layer``: operands ``x, hx, *params``; ``a`` = ``[layer, has_biases, bidirectional, grads]``
  (``layer`` one of :data:`LAYERS`, ``grads`` a bool per operand); outputs ``output, h_n``.
* ``torch.rnn_layer_backward``: operands ``x, hx``, then the gradients of ``output`` and of ``h_n`` that
  are given, then ``*params``; ``a`` = ``[layer, has_biases, bidirectional, grads, with output's gradient,
  with h_n's]``; outputs the gradients of the operands ``grads`` marks, in order.

``l`` is each operand's layout, ``o`` each output's spec (``[index, size, stride, 0, dtype, bytes]``,
contiguous), as in an ATen call.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

#: The layer composites a client sends one layer at a time, by ATen name, with torch's own function for each.
LAYERS: dict[str, Callable[..., Any]] = {"gru": torch._VF.gru, "rnn_tanh": torch._VF.rnn_tanh,
                                         "rnn_relu": torch._VF.rnn_relu}
_FLOATS = (torch.float32, torch.float64)
Tensor = torch.Tensor


def _layer(a: Any, ts: list[Tensor]) -> tuple[Callable[..., Any], bool, bool, list[bool]]:
    """(torch's layer function, has_biases, bidirectional, grads) of a call whose ``a`` begins ``[layer,
    has_biases, bidirectional, grads]`` and whose operands ``ts`` are ``x``, ``hx``, then the parameters."""
    if type(a) is not list or len(a) < 4 or type(a[0]) is not str or a[0] not in LAYERS \
            or type(a[1]) is not bool or type(a[2]) is not bool or type(a[3]) is not list:
        raise ValueError(f"malformed RNN layer call: {str(a)[:80]}")
    n_params = (4 if a[1] else 2) * (2 if a[2] else 1)
    grads = a[3]
    if len(ts) != 2 + n_params or len(grads) != 2 + n_params or any(type(g) is not bool for g in grads):
        raise ValueError(f"an RNN layer call ({a[0]}, has_biases={a[1]}, bidirectional={a[2]}) takes {n_params} "
                         f"parameters and a requires-grad flag for each of its {2 + n_params} tensors")
    dtype = ts[0].dtype
    if dtype not in _FLOATS or any(t.dtype is not dtype for t in ts):
        raise ValueError("an RNN layer call's tensors are all of one floating dtype (float32 or float64)")
    return LAYERS[a[0]], a[1], a[2], grads


def _marked(ts: list[Tensor], grads: list[bool]) -> list[Tensor]:
    return [t.detach().requires_grad_(g) for t, g in zip(ts, grads)]


def layer(a: Any, ts: list[Tensor]) -> list[Tensor]:
    """``torch.rnn_layer``: ``[output, h_n]`` of one layer (no graph kept)."""
    fn, has_biases, bidirectional, grads = _layer(a, ts)
    if len(a) != 4:
        raise ValueError("malformed torch.rnn_layer call")
    with torch.no_grad():
        xs = _marked(ts, grads)
        out, hn = fn(xs[0], xs[1], xs[2:], has_biases, 1, 0.0, True, bidirectional, False)
    return [out, hn]


def layer_backward(a: Any, ts: list[Tensor]) -> list[Tensor]:
    """``torch.rnn_layer_backward``: the gradients of the operands marked in ``grads``, in order."""
    if type(a) is not list or len(a) != 6 or type(a[4]) is not bool or type(a[5]) is not bool or not (a[4] or a[5]):
        raise ValueError("malformed torch.rnn_layer_backward call (at least one output's gradient)")
    given = [i for i in (0, 1) if a[4 + i]]
    head = ts[:2] + ts[2 + len(given):]
    fn, has_biases, bidirectional, grads = _layer(a, head)
    outs_grad = ts[2:2 + len(given)]
    if any(g.dtype is not head[0].dtype for g in outs_grad):
        raise ValueError("an RNN layer's output gradients are of its dtype")
    with torch.enable_grad():
        xs = _marked(head, grads)
        outs = fn(xs[0], xs[1], xs[2:], has_biases, 1, 0.0, True, bidirectional, False)
        want = [x for x, g in zip(xs, grads) if g]
        got = torch.autograd.grad([outs[i] for i in given], want, outs_grad, allow_unused=True) if want else ()
    return [torch.zeros_like(x) if g is None else g for g, x in zip(got, want)]


__all__ = ["LAYERS", "layer", "layer_backward"]
