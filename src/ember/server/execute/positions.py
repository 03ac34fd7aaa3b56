"""Operands whose *values* or *sizes* a CPU ATen kernel trusts as memory positions.

A handful of PyTorch's CPU kernels read or write memory at positions taken from an operand
without checking them: they trust that the operand came from the matching forward kernel
(``max_pool2d``'s ``indices``, ``embedding``'s indices in its backward, ``segment_reduce``'s
offsets, CTC targets, grouped matmuls' offsets) or that a per-channel operand has one value per
channel (batch norm's statistics, layer norm's saved mean). Through torch that always holds; a
client writing raw ``OP`` messages can break it and make the peer read or write outside a storage,
or hand back memory no kernel wrote (a crash, a heap corruption, or another session's bytes read
back). Found by ``bench/bench_aten_positions.py`` and by real models (each found case is a
regression test in ``tests/test_torch_positions.py``).

:func:`checker` gives, for such an op, a check run on the bound arguments before the kernel: it
raises ``ValueError`` naming the operand and the bound, so the call's outputs are poisoned with
the reason and the kernel never runs. Ops not listed get no check (their kernels check, or take
no positions from values). The checks cost one min/max (or sum) over the checked operands.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from ...protocol.aten import MAX_ELEMENTS

Named = dict[str, Any]
Check = Callable[[Named], None]


class PositionError(ValueError):
    """An operand's values or size would make a kernel reach outside its memory."""


def _fail(op: str, what: str) -> None:
    raise PositionError(f"{op}: {what} (refused on the peer: the kernel would reach outside its memory)")


def _in_range(op: str, name: str, t: Any, lo: int, hi: int) -> None:
    """Every value of integer tensor ``t`` lies in ``[lo, hi)``."""
    if t is None or not isinstance(t, torch.Tensor) or t.numel() == 0:
        return
    if t.is_floating_point() or t.is_complex() or t.dtype is torch.bool:
        _fail(op, f"{name} must be an integer tensor, got {t.dtype}")
    mn, mx = int(t.min()), int(t.max())
    if mn < lo or mx >= hi:
        _fail(op, f"{name} holds values in [{mn}, {mx}], outside [{lo}, {hi})")


def _numel(op: str, name: str, t: Any, want: int, optional: bool = True) -> None:
    if t is None:
        if not optional:
            _fail(op, f"{name} is required")
        return
    if t.numel() != want:
        _fail(op, f"{name} has {t.numel()} elements where {want} are read")


def _shape(op: str, name: str, t: Any, want: Any) -> None:
    if t is not None and tuple(t.shape) != tuple(want):
        _fail(op, f"{name} has shape {tuple(t.shape)} where {tuple(want)} is read")


def _prod(xs: Any) -> int:
    n = 1
    for x in xs:
        n *= int(x)
    return n


# ---- pooling: indices are positions in each input plane -------------------------------------------

def _pool(k: int) -> Check:
    def check(a: Named) -> None:
        op, x, g, idx = "max pooling backward", a["self"], a["grad_output"], a["indices"]
        _shape(op, "indices", idx, g.shape)
        _in_range(op, "indices", idx, 0, _prod(x.shape[-k:]) if x.dim() >= k else 1)
    return check


def _fractional(k: int) -> Check:
    def check(a: Named) -> None:
        s = a["random_samples"]
        if s is not None and s.numel():
            if not s.is_floating_point():
                _fail("fractional_max_pool", "random_samples must be floating point")
            if not bool(((s >= 0) & (s < 1)).all()):
                _fail("fractional_max_pool", "random_samples must lie in [0, 1) (NaN or others give positions)")
    return check


# ---- embedding ---------------------------------------------------------------------------------

def _embedding_backward(a: Named) -> None:
    _in_range("embedding backward", "indices", a["indices"], 0, int(a["num_weights"]))


def _bag_forward(a: Named) -> None:
    op, idx, off = "embedding_bag", a["indices"], a["offsets"]
    _in_range(op, "offsets", off, 0, idx.numel() + 1)
    _in_range(op, "indices", idx, 0, a["weight"].size(0) if a["weight"].dim() else 0)
    _numel(op, "per_sample_weights", a.get("per_sample_weights"), idx.numel())


def _bag_backward(a: Named) -> None:
    op, g, idx, o2b = "embedding_bag backward", a["grad"], a["indices"], a["offset2bag"]
    bags = g.size(0) if g.dim() else 0
    _in_range(op, "indices", idx, 0, int(a["num_weights"]))
    mode = int(a["mode"])
    _in_range(op, "offsets", a.get("offsets"), 0, idx.numel() + 1)
    _in_range(op, "bag_size", a["bag_size"], 0, idx.numel() + 1)
    if mode == 2:  # max: positions in the weight from maximum_indices (-1 marks an empty bag)
        _shape(op, "maximum_indices", a["maximum_indices"], g.shape)
        _in_range(op, "maximum_indices", a["maximum_indices"], -1, int(a["num_weights"]))
        return
    _in_range(op, "maximum_indices", a["maximum_indices"], -1, max(int(a["num_weights"]), idx.numel() + 1))
    _offset2bag(op, o2b, a.get("offsets"), idx.numel(), bags)
    if mode == 1:
        bs = a["bag_size"]
        if bs is None or bs.numel() < bags:
            _fail(op, f"bag_size has {0 if bs is None else bs.numel()} elements where {bags} are read")
    _numel(op, "per_sample_weights", a.get("per_sample_weights"), idx.numel())


def _bag_psw_backward(a: Named) -> None:
    op, g, idx, o2b = "embedding_bag per-sample-weights backward", a["grad"], a["indices"], a["offset2bag"]
    _in_range(op, "indices", idx, 0, a["weight"].size(0) if a["weight"].dim() else 0)
    _in_range(op, "offsets", a["offsets"], 0, idx.numel() + 1)
    _offset2bag(op, o2b, a["offsets"], idx.numel(), g.size(0) if g.dim() else 0)


def _offset2bag(op: str, o2b: Any, offsets: Any, n: int, bags: int) -> None:
    """``offset2bag`` (each index's bag) within ``bags``; an empty one, which the CPU kernels rebuild from the
    offsets (``sum`` mode's fast path leaves it empty: ``make_offset2bag``), rebuilt here as they do and checked
    (offsets not starting at 0 would make bag -1, more offsets than bags a bag past the gradient's rows)."""
    if o2b is not None and o2b.numel():
        _numel(op, "offset2bag", o2b, n)
        _in_range(op, "offset2bag", o2b, 0, bags)
        return
    if not n:
        return
    if not isinstance(offsets, torch.Tensor) or offsets.dim() != 1 or not offsets.numel():
        _fail(op, "an empty offset2bag is rebuilt from the offsets, and there are none")
    rebuilt = torch.zeros(n + 1, dtype=torch.int64, device=offsets.device)
    rebuilt.index_add_(0, offsets.long(), torch.ones(offsets.numel(), dtype=torch.int64, device=offsets.device))
    rebuilt[0] -= 1
    _in_range(op, "offset2bag (rebuilt from the offsets)", rebuilt.cumsum(0)[:n], 0, bags)


# ---- segment_reduce ----------------------------------------------------------------------------

def _segments(a: Named) -> None:
    op, data = "segment_reduce", a["data"]
    axis = int(a.get("axis", 0))
    if not -data.dim() <= axis < max(data.dim(), 1):
        _fail(op, f"axis {axis} is outside the data's {data.dim()} dims")
    n = data.size(axis) if data.dim() else 1
    lengths, offsets = a.get("lengths"), a.get("offsets")
    if offsets is not None:
        if offsets.dim() == 0 or offsets.size(-1) == 0:
            _fail(op, "offsets must hold at least one value per row")
        _in_range(op, "offsets", offsets, 0, n + 1)
        if offsets.numel() and bool((offsets.diff(dim=-1) < 0).any()):
            _fail(op, "offsets must not decrease")
        segs = offsets.size(-1) - 1
    elif lengths is not None:
        _in_range(op, "lengths", lengths, 0, n + 1)
        if lengths.numel() and bool((lengths.sum(-1) > n).any()):
            _fail(op, f"a row of lengths sums past data.size(axis) = {n}")
        segs = lengths.size(-1) if lengths.dim() else 1
    else:
        return
    for name in ("grad", "output"):
        t = a.get(name)
        if t is not None:
            want = list(data.shape)
            if want:
                want[axis] = segs
            _shape(op + " backward", name, t, want)


# ---- CTC: targets are class positions ----------------------------------------------------------

def _lengths(v: Any) -> list[int]:
    return [int(x) for x in (v.reshape(-1).tolist() if isinstance(v, torch.Tensor) else v)]


def _ctc(a: Named) -> None:
    op, lp, tg = "ctc_loss", a["log_probs"], a["targets"]
    if lp.dim() not in (2, 3) or tg.dim() > 2:
        return  # the kernel checks dims itself
    classes, batch = lp.size(-1), lp.size(1) if lp.dim() == 3 else 1
    tl, il = _lengths(a["target_lengths"]), _lengths(a["input_lengths"])
    if len(il) != batch or len(tl) != batch or any(not 0 <= n <= lp.size(0) for n in il):
        _fail(op, f"input_lengths {il[:8]} / target_lengths {tl[:8]} do not fit log_probs of shape {tuple(lp.shape)}")
    if tg.dim() == 2:
        if len(tl) != tg.size(0) or any(not 0 <= n <= tg.size(1) for n in tl):
            _fail(op, f"target_lengths {tl[:8]} do not fit targets of shape {tuple(tg.shape)}")
        read = tg[torch.arange(tg.size(1), device=tg.device)[None, :] < torch.tensor(tl, device=tg.device)[:, None]]
    else:
        if any(n < 0 for n in tl) or sum(tl) > tg.numel():
            _fail(op, f"target_lengths {tl[:8]} do not fit {tg.numel()} targets")
        read = tg[:sum(tl)]
    _in_range(op, "targets", read, 0, classes)
    if "log_alpha" in a:
        _shape(op + " backward", "log_alpha", a["log_alpha"], (batch, lp.size(0), 2 * max(tl, default=0) + 1))
        _numel(op + " backward", "neg_log_likelihood", a["neg_log_likelihood"], batch)
        _numel(op + " backward", "grad", a["grad"], batch)


# ---- normalisation: one statistic per channel / per row -------------------------------------------

_PER_CHANNEL = ("weight", "bias", "running_mean", "running_var")


def _batch_norm(a: Named) -> None:
    op, x = "batch_norm", a["input"]
    c = x.size(1) if x.dim() >= 2 else 0
    if x.dim() < 2:
        _fail(op, f"input must have at least 2 dims, got {x.dim()}")
    for name in _PER_CHANNEL:
        if name in a:
            _numel(op, name, a[name], c)
    g = a.get("grad_out", a.get("grad_output"))
    if g is not None:
        _shape(op + " backward", "grad_out", g, x.shape)
        train = bool(a.get("train", a.get("update", True)))
        for name in ("save_mean", "save_invstd", "save_var", "save_var_transform"):
            t = a.get(name)
            if t is not None and (train or t.numel()):
                _numel(op + " backward", name, t, c)
        if train and a.get("save_mean") is None:
            _fail(op + " backward", "save_mean is required in training mode")
        if not train and (a.get("running_mean") is None or a.get("running_var") is None):
            _fail(op + " backward", "running statistics are required in evaluation mode")


def _layer_norm_backward(a: Named) -> None:
    op, x, shape = "layer_norm backward", a["input"], list(a["normalized_shape"])
    if len(shape) > x.dim() or list(x.shape[x.dim() - len(shape):]) != shape:
        return  # the kernel checks the shape itself
    m = _prod(x.shape[:x.dim() - len(shape)])
    _shape(op, "grad_out", a["grad_out"], x.shape)
    _numel(op, "mean", a["mean"], m)
    _numel(op, "rstd", a["rstd"], m)
    for name in ("weight", "bias"):
        _numel(op, name, a.get(name), _prod(shape))


def _weight_norm_backward(a: Named) -> None:
    op, v, dim = "weight_norm backward", a["saved_v"], int(a["dim"])
    if not -v.dim() <= dim < max(v.dim(), 1):
        _fail(op, f"dim {dim} is outside the weight's {v.dim()} dims")
    n = v.size(dim) if v.dim() else 1
    _shape(op, "grad_w", a["grad_w"], v.shape)
    _numel(op, "saved_g", a["saved_g"], n)
    _numel(op, "saved_norms", a["saved_norms"], n)


def _weight_norm(a: Named) -> None:
    """``_weight_norm_interface(v, g, dim)``: the CPU kernel writes ``v.size(dim)`` norms and reads as many ``g``."""
    op, v, dim = "weight_norm", a["v"], int(a.get("dim", 0))
    if not -v.dim() <= dim < max(v.dim(), 1):
        _fail(op, f"dim {dim} is outside the weight's {v.dim()} dims")
    _numel(op, "g", a["g"], v.size(dim) if v.dim() else 1, optional=False)


def _cholesky_solve_helper(a: Named) -> None:
    """``_cholesky_solve_helper(self, A, upper)``: LAPACK's potrs solves ``self``'s rows in place, trusting that they
    are ``A``'s (the public ``cholesky_solve`` broadcasts and checks them first)."""
    op, b, m = "cholesky_solve", a["self"], a["A"]
    if m.dim() < 2 or m.size(-1) != m.size(-2) or b.dim() != m.dim() or b.shape[:-2] != m.shape[:-2] \
            or b.size(-2) != m.size(-1):
        _fail(op, f"self of shape {tuple(b.shape)} does not fit A of shape {tuple(m.shape)}")


def _flash(a: Named) -> None:
    """CPU flash attention indexes ``key``/``value`` by their length, with a whole number of query heads per key
    head (GQA), and its mask by ``[batch, heads, L, S]``: each must fit the query."""
    op, q, k, v, mask = "flash attention", a["query"], a["key"], a["value"], a.get("attn_mask")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or k.size(0) != q.size(0) or not k.size(1) \
            or q.size(1) % k.size(1) or v.shape[:3] != k.shape[:3] or k.size(3) != q.size(3):
        _fail(op, f"query {tuple(q.shape)}, key {tuple(k.shape)} and value {tuple(v.shape)} do not fit")
    full = (*q.shape[:3], k.size(2))
    if isinstance(mask, torch.Tensor):
        try:
            ok = torch.broadcast_shapes(mask.shape, full) == full
        except RuntimeError:
            ok = False
        if not ok:
            _fail(op, f"attn_mask of shape {tuple(mask.shape)} does not broadcast to {full}")


def _flash_backward(a: Named) -> None:
    """Its backward also indexes ``out``, ``grad_out`` and ``logsumexp`` by the query's length: each must have the
    shape the forward gave it."""
    _flash(a)
    op, q, v = "flash attention backward", a["query"], a["value"]
    want = (*q.shape[:3], v.size(3))
    _shape(op, "out", a["out"], want)
    _shape(op, "grad_out", a["grad_out"], want)
    _shape(op, "logsumexp", a["logsumexp"], q.shape[:3])


def ctc_written(op: Any) -> Callable[[list[Any], dict[str, Any]], Any] | None:
    """How ``_ctc_loss`` runs on a peer: its CPU kernel makes ``log_alpha`` with ``empty`` and writes only each
    sample's first ``input_length`` steps and ``2 * target_length + 1`` states; the rest held whatever the
    allocator had (freed bytes, another session's among them), and a client may read any output. The rest is
    zeroed after the kernel (the backward reads only what it wrote)."""
    if op._schema.name != "aten::_ctc_loss" or any(x.alias_info is not None and x.alias_info.is_write
                                                   for x in op._schema.arguments):
        return None  # (an out= overload writes tensors it was given)

    def run(args: list[Any], kwargs: dict[str, Any]) -> Any:
        nll, alpha = op(*args, **kwargs)
        if alpha.dim() == 3 and alpha.numel():
            il, tl = _lengths(args[2]), _lengths(args[3])
            dev = alpha.device
            t = torch.arange(alpha.size(1), device=dev)[None, :, None]
            st = torch.arange(alpha.size(2), device=dev)[None, None, :]
            unwritten = (t >= torch.tensor(il, device=dev)[:, None, None]) | \
                (st >= 2 * torch.tensor(tl, device=dev)[:, None, None] + 1)
            alpha.masked_fill_(unwritten & (t >= 1), 0)  # (step 0 is written for every state)
        return nll, alpha
    return run


def _cdist_backward(a: Named) -> None:
    op, x1, x2 = "cdist backward", a["x1"], a["x2"]
    if x1.dim() < 2 or x2.dim() < 2:
        return
    try:
        batch = torch.broadcast_shapes(x1.shape[:-2], x2.shape[:-2])
    except RuntimeError:
        return  # the kernel refuses it itself
    want = (*batch, x1.size(-2), x2.size(-2))
    _shape(op, "grad", a["grad"], want)
    _shape(op, "cdist", a["cdist"], want)


def _pdist_backward(a: Named) -> None:
    op, x = "pdist backward", a["self"]
    n = x.size(0) if x.dim() else 0
    _numel(op, "grad", a["grad"], n * (n - 1) // 2)
    _numel(op, "pdist", a["pdist"], n * (n - 1) // 2)


def _grad_like(grad: str, like: str, what: str) -> Check:
    def check(a: Named) -> None:
        _shape(what, grad, a[grad], a[like].shape)
    return check


def _adaptive_avg_backward(k: int) -> Check:
    def check(a: Named) -> None:
        g, x = a["grad_output"], a["self"]
        if g.dim() != x.dim() or g.shape[:-k] != x.shape[:-k]:
            _fail("adaptive_avg_pool backward", f"grad_output of shape {tuple(g.shape)} does not match the input's "
                                                f"{tuple(x.shape)} outside the pooled dims")
    return check


def _grid_backward(a: Named) -> None:
    g, x, grid = a["grad_output"], a["input"], a["grid"]
    if x.dim() >= 2 and grid.dim() >= 2:
        _shape("grid_sampler backward", "grad_output", g, (x.size(0), x.size(1), *grid.shape[1:-1]))


def _margin_backward(a: Named) -> None:
    x = a["self"]
    n = x.size(0) if x.dim() == 2 else 1
    _numel("margin loss backward", "grad_output", a["grad_output"], n if int(a["reduction"]) == 0 else 1)


def _grouped(a: Named) -> None:
    """``_grouped_mm``'s ``offs`` split one dimension into the groups: the CPU kernel writes each group's part of
    the output and leaves the rest of it as allocated, unwritten. Offsets that are not a partition of that whole
    dimension (decreasing, negative, short of its end) would hand the caller uninitialized memory: another
    session's freed bytes. Refused; a partition (empty groups included: an expert with no tokens) runs."""
    op, offs, x, w = "grouped mm", a.get("offs"), a["self"], a["mat2"]
    if offs is None or not isinstance(offs, torch.Tensor) or not isinstance(x, torch.Tensor) \
            or not isinstance(w, torch.Tensor):
        return  # (the kernel refuses what it cannot take: a 3D x 3D call has no offsets)
    if offs.dim() != 1 or offs.dtype not in (torch.int32, torch.int64):
        _fail(op, f"offs must be a 1-D integer tensor, got {offs.dim()}-D {offs.dtype}")
    n = x.size(0) if x.dim() == 2 and w.dim() == 3 else w.size(-1) if x.dim() == 3 else x.size(-1)
    if offs.numel() == 0:
        _fail(op, "offs is empty")
    o = offs.to(torch.int64)
    if int(o[0]) < 0 or (offs.numel() > 1 and bool((o[1:] < o[:-1]).any())) or int(o[-1]) != n:
        _fail(op, f"offs must rise from 0 to {n} (a partition of the grouped dimension), got {offs.tolist()[:16]}")


def _fused_optimizer(op: str, per_param: tuple[str, ...], optional: tuple[str, ...], steps: bool) -> Check:
    """CPU's fused optimizer kernels (``_fused_adam_``, ``_fused_adamw_``, ``_fused_sgd_``, ``_fused_adagrad_``) run
    over each parameter's ``numel`` elements from the data pointer of the parameter and of each of its state
    tensors, and read one element of each step count, of ``lr`` (a tensor) and of ``grad_scale`` / ``found_inf``.
    They check the lists' lengths and dtypes, not the sizes: a gradient smaller than its parameter is read and
    written past its end (a crash, another session's bytes). Each tensor must hold its parameter's ``numel``
    elements from its offset within its storage; an optional list is empty or one per parameter."""
    def linear(name: str, t: Any, n: int) -> None:
        if not isinstance(t, torch.Tensor):
            _fail(op, f"{name} is required")
        if t.numel() != n or t.storage_offset() + n > t.untyped_storage().nbytes() // max(t.element_size(), 1):
            _fail(op, f"{name} has {t.numel()} elements where {n} are read from its offset {t.storage_offset()}")

    def check(a: Named) -> None:
        params = a["self"]
        lists = {name: a.get(name) or [] for name in (*per_param, *optional)}
        for name, ts in lists.items():
            if len(ts) != len(params) and not (name in optional and not ts):
                _fail(op, f"{name} has {len(ts)} tensors for {len(params)} parameters")
        if op == "fused sgd" and a.get("momentum") and not lists["momentum_buffer_list"]:
            _fail(op, "momentum_buffer_list is required with momentum")
        if op.startswith("fused adam") and a.get("amsgrad") and not lists["max_exp_avg_sqs"]:
            _fail(op, "max_exp_avg_sqs is required with amsgrad")
        for i, p in enumerate(params):
            n = p.numel() if isinstance(p, torch.Tensor) else 0
            linear(f"self[{i}]", p, n)
            for name, ts in lists.items():
                if ts:
                    linear(f"{name}[{i}]", ts[i], n)
        counts = a.get("state_steps") or [] if steps else []
        if steps and len(counts) != len(params):
            _fail(op, f"state_steps has {len(counts)} tensors for {len(params)} parameters")
        for name, t in [("lr", a.get("lr")), ("grad_scale", a.get("grad_scale")), ("found_inf", a.get("found_inf")),
                        *[(f"state_steps[{i}]", t) for i, t in enumerate(counts)]]:
            if isinstance(t, torch.Tensor) and t.numel() < 1:
                _fail(op, f"{name} has no element where one is read")
    return check


_ADAM = ("grads", "exp_avgs", "exp_avg_sqs")


def _fft_dims(a: Named) -> None:
    """``_fft_r2c`` / ``_fft_c2c`` / ``_fft_c2r``: the internal kernels take ``dim`` as given (no wrap, no check)."""
    x, dims = a["self"], a["dim"]
    if not isinstance(dims, (list, tuple)) or len(set(dims)) != len(dims) \
            or any(type(d) is not int or not 0 <= d < x.dim() for d in dims):
        _fail("fft", f"dims {str(dims)[:60]} must be distinct and within the input's {x.dim()} dims")
    n = a.get("last_dim_size")
    if n is not None and (type(n) is not int or n < 1):
        _fail("fft", f"last_dim_size {n!r} must be positive")


def _heads(embed: str | None, heads: str) -> Check:
    """The fused attention kernels (``nn.MultiheadAttention``'s and ``nn.TransformerEncoderLayer``'s inference fast
    path) divide by the number of heads before any check: a positive count, dividing the embedding."""
    def check(a: Named) -> None:
        h = a[heads]
        if embed is not None:
            e = a[embed]
        else:  # (qkv packs the three projections in its last dim)
            e = a["qkv"].shape[-1] // 3 if a["qkv"].dim() else 0
        if type(h) is not int or h < 1 or type(e) is not int or e < 1 or e % h:
            _fail("multi-head attention", f"{h!r} heads for an embedding of {e!r}: a positive count dividing it")
    return check


def _unfold_backward(a: Named) -> None:
    """``unfold_backward``: the gradient of ``input.unfold(dim, size, step)``, its shape as that unfold's."""
    g, sizes, dim, size, step = a["grad_in"], list(a["input_sizes"]), a["dim"], a["size"], a["step"]
    n = len(sizes)
    if not (type(dim) is int and -max(n, 1) <= dim < max(n, 1) and type(size) is int and type(step) is int
            and size >= 1 and step >= 1 and all(type(k) is int and k >= 0 for k in sizes)):
        _fail("unfold_backward", f"dim {dim!r}, size {size!r}, step {step!r} or sizes {sizes} out of range")
    d = dim % max(n, 1)
    length = sizes[d] if n else 1
    if size > length:
        _fail("unfold_backward", f"size {size} exceeds the dimension's {length}")
    want = [*sizes[:d], (length - size) // step + 1, *sizes[d + 1:], size] if n else [(1 - size) // step + 1, size]
    _shape("unfold_backward", "grad_in", g, want)

def _bincount_bytes(a: Named) -> int:
    """``bincount``'s output: ``max(self) + 1`` bins (at least ``minlength``), of 8 bytes at most."""
    x, least = a.get("self"), a.get("minlength") or 0
    top = int(x.max()) + 1 if isinstance(x, torch.Tensor) and x.numel() and not x.is_floating_point() else 0
    return max(top, int(least), 0) * 8


def _repeat_bytes(a: Named) -> int:
    """``repeat_interleave``'s output: ``sum(repeats)`` repeats of a slice of ``self`` (of one int64 without it)."""
    r, x = a.get("repeats"), a.get("self")
    if not isinstance(r, torch.Tensor):  # (repeats is self, for the one-operand overload)
        r, x = x, None
    if not isinstance(r, torch.Tensor) or not r.numel() or r.is_floating_point():
        return 0
    if r.min() < 0 or float(r.double().sum()) > MAX_ELEMENTS:  # (an int64 sum wraps: 4 x 2^62 + 8 sums to 8,
        _fail("repeat_interleave", "repeats must be non-negative and sum to at most 2^36")  # and the kernel trusts it)
    per, item = 1, 8
    if isinstance(x, torch.Tensor) and x.numel():
        dim = a.get("dim")
        per = x.numel() // max(1, x.shape[dim] if dim is not None and x.dim() else r.numel())
        item = x.element_size()
    return max(int(r.sum()), 0) * per * item


def _histogram_bytes(a: Named) -> int:
    """``histogram(bins=n)``: n counts and n + 1 edges; the dd kernels: the product of the bins, and their edges
    (no meta kernel sizes these; the bins are literals)."""
    bins = a.get("bins")
    if isinstance(bins, int):
        return (2 * bins + 1) * 8
    if isinstance(bins, (list, tuple)) and all(isinstance(n, int) for n in bins):
        return (math.prod(max(n, 0) for n in bins) + sum(bins) + len(bins)) * 8
    return 0


#: Ops whose outputs' sizes come from operand *values* (or literals no meta kernel reads), not shapes: the bytes they
#: allocate (an upper bound), charged to the session before the kernel runs (a crafted ``bincount`` of one int64
#: holding 2^31 made the peer allocate 16 GiB, whatever the session's budget; data-dependent results are charged
#: once they exist).
SIZED: dict[str, Callable[[Named], int]] = {
    "bincount": _bincount_bytes, "repeat_interleave": _repeat_bytes, "histogram": _histogram_bytes,
    "_histogramdd_from_bin_cts": _histogram_bytes, "_histogramdd_bin_edges": _histogram_bytes}


def sizer(op: Any) -> Callable[[list[Any], dict[str, Any]], int] | None:
    """The bytes ATen overload ``op`` allocates, from its bound ``(args, kwargs)``; None unless :data:`SIZED`."""
    return bound(op, SIZED.get(op._schema.name.split("::")[-1]))


#: Checks that read the operands' layouts (shapes, numels) and literal arguments only, never a value nor a scalar: a
#: registered graph's step of such an op is checked once when its program is lowered (its layouts are the
#: same at every replay) and then runs unchecked on the fast path (``step_maker._layouts_pass``).
LAYOUT_CHECKS = frozenset({"native_layer_norm_backward", "_log_softmax_backward_data", "_softmax_backward_data",
                           "_scaled_dot_product_flash_attention_for_cpu", "_weight_norm_interface",
                           "_scaled_dot_product_flash_attention_for_cpu_backward", "_cholesky_solve_helper"})

#: Ops whose ``unsafe=True`` (skip the kernel's own checks) may pass through: the check here covers what it skips.
UNSAFE_CHECKED = frozenset({"segment_reduce"})

CHECKS: dict[str, Check] = {
    "max_pool2d_with_indices_backward": _pool(2), "adaptive_max_pool2d_backward": _pool(2),
    "fractional_max_pool2d_backward": _pool(2), "max_pool3d_with_indices_backward": _pool(3),
    "adaptive_max_pool3d_backward": _pool(3), "fractional_max_pool3d_backward": _pool(3),
    "fractional_max_pool2d": _fractional(2), "fractional_max_pool3d": _fractional(3),
    "embedding_dense_backward": _embedding_backward, "embedding_backward": _embedding_backward,
    "_embedding_bag": _bag_forward, "_embedding_bag_forward_only": _bag_forward, "embedding_bag": _bag_forward,
    "_embedding_bag_backward": _bag_backward, "_embedding_bag_dense_backward": _bag_backward,
    "_embedding_bag_per_sample_weights_backward": _bag_psw_backward,
    "segment_reduce": _segments, "_segment_reduce_backward": _segments,
    "_ctc_loss": _ctc, "ctc_loss": _ctc, "_ctc_loss_backward": _ctc,
    **{n: _batch_norm for n in ("native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
                                "_batch_norm_with_update", "_batch_norm_with_update_functional", "_batch_norm_no_update",
                                "batch_norm_update_stats", "native_batch_norm_backward", "batch_norm_backward",
                                "batch_norm", "_batch_norm_impl_index", "_batch_norm_impl_index_backward",
                                "instance_norm", "_native_batch_norm_legit_functional")},
    "native_layer_norm_backward": _layer_norm_backward,
    "_weight_norm_interface_backward": _weight_norm_backward, "_weight_norm_interface": _weight_norm,
    "_cholesky_solve_helper": _cholesky_solve_helper,
    "_scaled_dot_product_flash_attention_for_cpu": _flash,
    "_scaled_dot_product_flash_attention_for_cpu_backward": _flash_backward,
    "_cdist_backward": _cdist_backward, "_pdist_backward": _pdist_backward,
    "_log_softmax_backward_data": _grad_like("grad_output", "output", "log_softmax backward"),
    "_softmax_backward_data": _grad_like("grad_output", "output", "softmax backward"),
    "_adaptive_avg_pool2d_backward": _adaptive_avg_backward(2),
    "_adaptive_avg_pool3d_backward": _adaptive_avg_backward(3),
    "grid_sampler_2d_backward": _grid_backward, "grid_sampler_3d_backward": _grid_backward,
    "multi_margin_loss_backward": _margin_backward, "multilabel_margin_loss_backward": _margin_backward,
    "_grouped_mm": _grouped, "_scaled_grouped_mm": _grouped, "_scaled_grouped_mm_v2": _grouped,
    "_fft_r2c": _fft_dims, "_fft_c2c": _fft_dims, "_fft_c2r": _fft_dims, "unfold_backward": _unfold_backward,
    "_native_multi_head_attention": _heads("embed_dim", "num_head"),
    "_transformer_encoder_layer_fwd": _heads("embed_dim", "num_heads"),
    "_transform_bias_rescale_qkv": _heads(None, "num_heads"),
    **{name + suffix: check for name, check in (
        ("_fused_adam", _fused_optimizer("fused adam", _ADAM, ("max_exp_avg_sqs",), True)),
        ("_fused_adamw", _fused_optimizer("fused adamw", _ADAM, ("max_exp_avg_sqs",), True)),
        ("_fused_sgd", _fused_optimizer("fused sgd", ("grads",), ("momentum_buffer_list",), False)),
        ("_fused_adagrad", _fused_optimizer("fused adagrad", ("grads", "state_sums"), (), True)))
       for suffix in ("_", "")},  # (in place, and the functional overload)
}


def checker(op: Any) -> Callable[[list[Any], dict[str, Any]], None] | None:
    """The position check of ATen overload ``op`` on its bound ``(args, kwargs)``, or None."""
    return bound(op, CHECKS.get(op._schema.name.split("::")[-1]))


def bound(op: Any, check: Callable[[Named], Any] | None) -> Callable[[list[Any], dict[str, Any]], Any] | None:
    """``check`` (of named arguments) as a check of ``op``'s bound ``(args, kwargs)``; None for None."""
    if check is None:
        return None
    names = [a.name for a in op._schema.arguments if not a.kwarg_only]

    def run(args: list[Any], kwargs: dict[str, Any]) -> Any:
        named = dict(zip(names, args))
        named.update(kwargs)
        return check(named)
    return run


__all__ = ["checker", "sizer", "ctc_written", "bound", "CHECKS", "SIZED", "UNSAFE_CHECKED", "LAYOUT_CHECKS",
           "PositionError"]
