"""oneDNN's LSTM layer on a CPU peer: ``mkldnn_rnn_layer`` and its backward.

CPU torch runs ``nn.LSTM`` (float32; bfloat16 where the CPU has oneDNN's bfloat16) as one ``mkldnn_rnn_layer``
call per layer and direction, whose autograd backward is one ``mkldnn_rnn_layer_backward`` call (its gradients in
float32 either way); an ``ember`` tensor would otherwise take the
per-time-step cells (~10 ATen ops per step and layer). The client sends these two kernels (``ember.torch``'s
``_rnn``), so a CPU peer computes exactly what local CPU torch does, in two ops per layer.

Both CPU kernels hand every operand's data pointer to oneDNN with sizes taken from ``input``'s sizes and
``hidden_size`` alone, trusting that weights, states, outputs and workspace match them: through torch they
always do. A client writing raw ``OP`` messages could break that and make the peer read or write outside a
storage, so :func:`checker` checks every operand's shape, dtype and density first. The workspace is
oneDNN's own buffer, whose size only oneDNN knows: the peer learns it from each forward it runs
(:func:`runner`), and for sizes no forward had (or forgotten) runs the forward on zeros once
(:func:`workspace_bytes`), only when the workspace sent holds at least the gates' part of it, so that
probe allocates a small multiple of what the caller already holds.

The forward saves its workspace only with grad mode on (and runs oneDNN's inference kernel otherwise,
whose results differ in the last bits). Its ``train`` argument is otherwise unread by the kernel, so the
client sends its grad mode there, and the peer runs the forward in that mode (:func:`runner`).
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from typing import Any, Callable

import torch

from .positions import PositionError, bound

LSTM = 2  # ideep::rnn_kind::LSTM, the ``mode`` argument
LAYER, BACKWARD = "mkldnn_rnn_layer", "mkldnn_rnn_layer_backward"
Named = dict[str, Any]


class LayerMismatch(PositionError):
    """An operand of the LSTM layer kernels that does not match the sizes oneDNN is given."""

    def __init__(self, op: str, what: str) -> None:
        self.detail = f"{op}: {what}"
        super().__init__(f"{self.detail} (refused on the peer: the oneDNN kernel would read or write outside "
                         f"its operands)")


def _fail(op: str, what: str) -> None:
    raise LayerMismatch(op, what)


def _dense(op: str, name: str, t: Any, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> None:
    """``t`` is a dense (contiguous) tensor of ``shape`` and ``dtype``: oneDNN reads it through its data pointer."""
    _like(op, name, t, shape, dtype)
    if not t.is_contiguous():
        _fail(op, f"{name} must be contiguous")


def _like(op: str, name: str, t: Any, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> None:
    """``t`` is a tensor of ``shape`` and ``dtype`` (any strides: the kernel makes it contiguous first)."""
    if not isinstance(t, torch.Tensor):
        _fail(op, f"{name} is required")
    if tuple(t.shape) != shape or t.dtype is not dtype:
        _fail(op, f"{name} is {tuple(t.shape)} {t.dtype} where {shape} {dtype} is read")


#: The dtypes oneDNN's LSTM layer takes on a CPU (bfloat16 where the CPU has it: CPU torch's own ``use_mkldnn`` test).
DTYPES = (torch.float32, torch.bfloat16)


def _sizes(op: str, a: Named) -> tuple[int, int, int, int, torch.dtype]:
    """``(T, N, I, H, dtype)`` after checking the literal arguments and the input and weights (all of the input's
    dtype)."""
    if a["mode"] != LSTM:
        _fail(op, f"mode {a['mode']} is not an LSTM ({LSTM})")
    if list(a["batch_sizes"]):
        _fail(op, "packed sequences (batch_sizes) are not supported")
    x, h = a["input"], a["hidden_size"]
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.numel() == 0 or h < 1:
        _fail(op, "input must be a non-empty (T, N, I) tensor and hidden_size positive")
    t, n, i = (int(s) for s in x.shape)
    dt = x.dtype
    if dt not in DTYPES:
        _fail(op, f"input is {dt}, not one of {[str(d) for d in DTYPES]}")
    _dense(op, "input", x, (t, n, i), dt)
    w = [a.get(f"weight{k}") for k in range(4)] if "weight0" in a else [a.get(f"weight{k}") for k in range(1, 5)]
    _like(op, "weight_ih", w[0], (4 * h, i), dt)
    _like(op, "weight_hh", w[1], (4 * h, h), dt)
    if a["has_biases"]:
        _like(op, "bias_ih", w[2], (4 * h,), dt)
        _like(op, "bias_hh", w[3], (4 * h,), dt)
    return t, n, i, h, dt


def check_layer(a: Named) -> None:
    op = "LSTM layer"
    t, n, i, h, dt = _sizes(op, a)
    _dense(op, "hx", a["hx_"], (n, h), dt)
    _dense(op, "cx", a["cx_"], (n, h), dt)


def check_layer_backward(a: Named) -> None:
    op = "LSTM layer backward"
    t, n, i, h, dt = _sizes(op, a)
    for name, key, shape in (("hx", "hx_", (n, h)), ("cx", "cx_tmp", (n, h)), ("output", "output", (t, n, h)),
                             ("hy", "hy_", (n, h)), ("cy", "cy_", (n, h))):
        _dense(op, name, a[key], shape, dt)
    for name, shape in (("grad_output", (t, n, h)), ("grad_hy", (n, h)), ("grad_cy", (n, h))):
        if a[name] is not None:
            _like(op, name, a[name], shape, dt)
    ws = a["workspace"]
    held = ws.numel() if isinstance(ws, torch.Tensor) and ws.dtype is torch.uint8 else 0
    _dense(op, "workspace", ws, (expected_workspace(op, (t, n, i, h, bool(a["reverse"]), dt), held),), torch.uint8)


Sizes = tuple[int, int, int, int, bool, torch.dtype]  # (T, N, I, H, reverse, dtype)
_learnt: OrderedDict[Sizes, int] = OrderedDict()
_learnt_lock = threading.Lock()
MAX_LEARNT = 4096


def learn(sizes: Sizes, nbytes: int) -> None:
    """Remember the workspace size a forward of these sizes made (the oldest forgotten past MAX_LEARNT)."""
    with _learnt_lock:
        _learnt[sizes] = nbytes
        _learnt.move_to_end(sizes)
        while len(_learnt) > MAX_LEARNT:
            _learnt.popitem(last=False)


def expected_workspace(op: str, sizes: Sizes, held: int) -> int:
    """The workspace bytes oneDNN reads for ``sizes``: as a forward made it, or probed once when the ``held``
    bytes sent cover at least the gates oneDNN keeps there (T x N x 4H floats)."""
    with _learnt_lock:
        known = _learnt.get(sizes)
    if known is not None:
        return known
    t, n, _i, h, _r, dt = sizes
    gates = t * n * 4 * h * dt.itemsize
    if held < gates:
        _fail(op, f"workspace holds {held} bytes, fewer than the {gates} of its gates alone")
    nbytes = workspace_bytes(*sizes)
    learn(sizes, nbytes)
    return nbytes


@functools.lru_cache(maxsize=64)
def workspace_bytes(t: int, n: int, i: int, h: int, reverse: bool, dtype: torch.dtype = torch.float32) -> int:
    """The bytes of the workspace oneDNN's LSTM training forward saves for these sizes (run once on zeros)."""
    z = functools.partial(torch.zeros, dtype=dtype, device="cpu")
    with torch.enable_grad():
        r = torch.ops.aten.mkldnn_rnn_layer.default(z(t, n, i), z(4 * h, i), z(4 * h, h), z(4 * h), z(4 * h),
                                                    z(n, h), z(n, h), reverse, [], LSTM, h, 1, True, False,
                                                    False, True)
    return int(r[3].numel())


def meta_layer(input: Any, weight0: Any, weight1: Any, weight2: Any, weight3: Any, hx_: Any, cx_: Any,  # noqa: A002
               reverse: bool, batch_sizes: Any, mode: int, hidden_size: int, num_layers: int, has_biases: bool,
               bidirectional: bool, batch_first: bool, train: bool) -> tuple[Any, ...]:
    """The forward's outputs on meta operands as the CPU kernel makes them (torch's meta kernel gives the
    workspace 0 bytes; here it has oneDNN's size, and is undefined when ``train``, the grad mode, is off),
    after the peer's checks, so a bad call fails where it is made."""
    try:
        check_layer({"input": input, "weight0": weight0, "weight1": weight1, "weight2": weight2,
                     "weight3": weight3, "hx_": hx_, "cx_": cx_, "mode": mode, "batch_sizes": batch_sizes,
                     "hidden_size": hidden_size, "has_biases": has_biases})
    except LayerMismatch as e:  # torch's way for a bad call of an op: a RuntimeError, raised at the call
        raise RuntimeError(f"{e.detail}: oneDNN would read or write outside its operands") from None
    t, n, i = (int(s) for s in input.shape)
    ws = input.new_empty((workspace_bytes(t, n, i, hidden_size, bool(reverse), input.dtype),), dtype=torch.uint8) \
        if train else None
    return input.new_empty((t, n, hidden_size)), hx_.new_empty(hx_.shape), cx_.new_empty(cx_.shape), ws


CHECKS: dict[str, Callable[[Named], None]] = {LAYER: check_layer, BACKWARD: check_layer_backward}


def checker(op: Any) -> Callable[[list[Any], dict[str, Any]], None] | None:
    """The operand check of ``op`` on its bound ``(args, kwargs)`` (either overload name), or None."""
    return bound(op, CHECKS.get(op._schema.name.split("::")[-1]))


def runner(op: Any) -> Callable[[list[Any], dict[str, Any]], Any] | None:
    """For the forward layer (else None): a call of its kernel on bound ``(args, kwargs)`` in the grad mode
    its ``train`` names, which learns the size of the workspace it made."""
    if op._schema.name != f"aten::{LAYER}" or op._schema.overload_name:
        return None
    names = [a.name for a in op._schema.arguments]
    train, reverse, hidden = names.index("train"), names.index("reverse"), names.index("hidden_size")

    def run(args: list[Any], kwargs: dict[str, Any]) -> Any:
        with torch.set_grad_enabled(args[train] is True):
            res = op(*args, **kwargs)
        if res[3] is not None:
            t, n, i = (int(s) for s in args[0].shape)
            learn((t, n, i, int(args[hidden]), bool(args[reverse]), args[0].dtype), int(res[3].numel()))
        return res
    return run


__all__ = ["LayerMismatch", "meta_layer", "CHECKS", "checker", "check_layer", "check_layer_backward", "workspace_bytes",
           "expected_workspace", "learn", "runner", "LSTM"]
