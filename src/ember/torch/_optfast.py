"""Adam, AdamW and SGD steps replayed without running their Python, once a host model of the step is trusted.

:mod:`._optstep` replays a recorded optimizer step by running the optimizer's Python and checking each
ATen call against the recording. That is exact whatever the optimizer does, but it costs the optimizer's
own Python (~120 µs a step for torch's foreach AdamW, more with more parameter groups) plus ~10 µs per
checked call, every step: on a small model, a sixth of the client's step.

For torch's own ``Adam``, ``AdamW`` and ``SGD`` on their default paths (Adam: foreach or fused; SGD:
foreach; not capturable, differentiable, maximizing or amsgrad; number hyper-parameters), what the step's
Python does on the host is small and known. Per parameter group, Adam's foreach path adds one to each
parameter's CPU step count and derives the step's scalars from those counts and the group's
hyper-parameters (bias corrections, step sizes, the decay factor); the fused path and SGD take the
hyper-parameters as they are. Each hands its calls every parameter with a grad, that grad, and the
parameter's state tensors. A :class:`HostModel` does the same, in the same Python float arithmetic, and
names the tensors the step binds. It is trusted only after it has agreed with :data:`AGREE` guided replays
in a row: its scalars equal the checked calls' value for value (type and all), and its tensors are the
replays' bound storages, one for one. From then on each step checks what could make the Python take
another path:

* the parameter groups (how many, which parameters have grads: the plan's key already), hyper-parameters
  other than ``lr`` unchanged, ``lr`` a number (a schedule changes it freely: it is one of the scalars);
* every bound tensor (parameter, grad, state tensor) an ember tensor on the plan's session with the layout
  it had when the model was trusted, no two of them in one storage; each CPU step count a CPU tensor;
* no ``grad_scale`` / ``found_inf`` on the optimizer (torch's foreach paths refuse them).

When all hold, the CPU step counts are incremented by the very call torch makes, and the recording is
replayed with the model's scalars: bit-equal to the guided replay, which is bit-equal to eager. When any
does not, the step runs guided, as before (which records again if the Python now differs), and the model
is learnt again. ``EMBER_OPTIMIZER_MODEL=0`` keeps every step guided.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ._dispatch import _wire_scalar as _wire

#: guided replays in a row a model must agree with before steps skip the optimizer's Python
AGREE = 2
#: guided replays no model predicted before a plan stops asking; times a trusted model may be dropped (a
#: hyper-parameter or a layout changed) and learnt again
TRIES, DROPS = 2 * AGREE, 16
#: hyper-parameters whose value must stay what the model was trusted with (``lr`` is a scalar of the step)
_FIXED = {"adam": ("betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach", "capturable", "differentiable",
                   "fused", "decoupled_weight_decay"),
          "sgd": ("momentum", "dampening", "nesterov", "weight_decay", "maximize", "foreach", "differentiable",
                  "fused")}
_ONE = None  # torch.tensor(1.0) for the step counts' increment, made on first use
#: host models on (``EMBER_OPTIMIZER_MODEL=0``: every replayed step guided)
ON = [os.environ.get("EMBER_OPTIMIZER_MODEL", "1").strip().lower() not in ("0", "false", "no", "off")]
_NUM = (float, int)


def _layout(t: Any) -> tuple[Any, ...]:
    """A tensor's ``(dtype, shape, stride, offset)``, as the recordings compare them (:mod:`._optstep` too)."""
    return (t.dtype, t.shape, t.stride(), t.storage_offset())


def _kind(func: Any, opt: Any) -> str | None:
    """``"adam"`` for torch's Adam and AdamW, ``"sgd"`` for its SGD (exactly those classes, their own step)."""
    name, module = getattr(func, "__qualname__", ""), getattr(func, "__module__", "")
    if type(opt) in (torch.optim.Adam, torch.optim.AdamW) and (name, module) == ("Adam.step", "torch.optim.adam"):
        return "adam"
    if type(opt) is torch.optim.SGD and (name, module) == ("SGD.step", "torch.optim.sgd"):
        return "sgd"
    return None


def _foreach(group: dict[str, Any]) -> bool:
    """Does torch take the foreach path (asked, or neither foreach nor fused set: ``fused=False`` alone means
    the for-loop)?"""
    foreach, fused = group.get("foreach"), group.get("fused")
    return bool(foreach) or (foreach is None and fused is None)


def _path(kind: str, group: dict[str, Any]) -> str | None:
    """Which of torch's paths this group's step takes, when the model knows it: ``"adam"`` (foreach: CPU step
    counts, scalars derived on the host), ``"adam-fused"`` (step counts on the device, counted there) or
    ``"sgd"`` (foreach); else None (amsgrad, maximize, capturable, differentiable, tensor hyper-parameters, the
    for-loop: guided replays only)."""
    if group.get("capturable") or group.get("differentiable") or group.get("maximize") \
            or type(group.get("lr")) not in _NUM or type(group.get("weight_decay")) not in _NUM:
        return None
    if kind == "sgd":
        ok = type(group.get("momentum")) in _NUM and type(group.get("dampening")) in _NUM and _foreach(group)
        return "sgd" if ok else None
    betas = group.get("betas")
    if group.get("amsgrad") or type(betas) is not tuple or len(betas) != 2 or not all(type(b) in _NUM for b in betas) \
            or type(group.get("eps")) not in _NUM:
        return None
    if group.get("fused"):
        return "adam-fused" if not group.get("foreach") else None
    return "adam" if _foreach(group) else None


def _scalars(group: dict[str, Any], path: str, counts: list[float]) -> list[list[Any]]:
    """The scalars of the group's calls that reach the peer, one list per call, computed as torch's
    ``_multi_tensor_adam`` (non-capturable), ``_fused_adam`` or ``_multi_tensor_sgd`` computes them."""
    lr, wd = group["lr"], group["weight_decay"]
    out: list[list[Any]] = []
    if path == "sgd":
        momentum = group["momentum"]
        if wd != 0:
            out.append([wd])  # _foreach_add(grads, params, alpha=wd)
        if momentum != 0:
            out += [[momentum], [1 - group["dampening"]]]  # bufs: _foreach_mul_, _foreach_add_
            if group["nesterov"]:
                out.append([momentum])  # _foreach_add_(grads, bufs, alpha=momentum)
        out.append([-lr])  # _foreach_add_(params, grads, alpha=-lr)
        return [[_wire(v) for v in call] for call in out]
    (beta1, beta2), eps = group["betas"], group["eps"]
    if path == "adam-fused":  # _foreach_add_(steps, 1), then _fused_adam(w)_(..., lr, beta1, beta2, weight_decay, eps)
        return [[1], [_wire(v) for v in (lr, beta1, beta2, wd, eps)]]
    if wd != 0:
        out.append([1 - lr * wd] if group["decoupled_weight_decay"] else [wd])  # _foreach_mul_ / _foreach_add
    out += [[1 - beta1], [beta2], [1 - beta2]]  # lerp_, mul_, addcmul_
    per: dict[float, tuple[Any, Any]] = {}  # (the counts are mostly one value: each computed once)
    for c in counts:
        if c not in per:
            bc1, bc2 = 1 - beta1 ** c, 1 - beta2 ** c
            per[c] = (_wire(bc2 ** 0.5), _wire((lr / bc1) * -1))
    pairs = [per[c] for c in counts]
    out = [[_wire(v) for v in call] for call in out]  # sqrt, div_, add_, addcdiv_:
    return out + [[], [a for a, _ in pairs], [_wire(eps)], [b for _, b in pairs]]


def _step_scalars(groups: list[dict[str, Any]], paths: list[str], counts: list[list[Any]],
                  active: list[bool]) -> list[list[Any]]:
    """The whole step's scalars, one list per call, from the groups that make calls and their step counts (as
    the step leaves them: incremented)."""
    out: list[list[Any]] = []
    for g, path, c, act in zip(groups, paths, counts, active):
        if act:  # (a group with no grads makes no call)
            out += _scalars(g, path, [s.item() for s in c])
    return out


def _tensors(opt: Any, paths: list[str]) -> tuple[list[Any], list[list[Any]], list[bool]] | None:
    """(the tensors a step binds, in model order: per parameter with a grad, itself, its grad, and its state's
    tensors -- Adam's exp_avg and exp_avg_sq and, fused, its step count; SGD's momentum buffer when it has
    momentum --, and per group the CPU step counts of Adam's foreach path) or None when a parameter's state
    is not a made one; and per group whether it makes any call (has a parameter with a grad)."""
    ts: list[Any] = []
    counts: list[list[Any]] = []
    active: list[bool] = []
    state = opt.state
    for g, path in zip(opt.param_groups, paths):
        c: list[Any] = []
        n = len(ts)
        momentum = path == "sgd" and g["momentum"] != 0
        for p in g["params"]:
            gr = p.grad
            if gr is None:
                continue
            if path == "sgd" and not momentum:
                ts += (p, gr)
                continue
            st = state.get(p)
            if st is None:
                return None
            try:
                if momentum:
                    ts += (p, gr, st["momentum_buffer"])
                    continue
                ts += (p, gr, st["exp_avg"], st["exp_avg_sq"])
                c.append(st["step"])
            except KeyError:
                return None
            if path == "adam-fused":
                ts.append(c[-1])
        counts.append(c if path == "adam" else [])
        active.append(len(ts) > n)
    return ts, counts, active


class HostModel:
    """A trusted model of one plan's optimizer step: its kind and paths, the hyper-parameters it was trusted
    with, which of its tensors binds each input of the recorded graph, and their layouts."""

    __slots__ = ("session", "kind", "fixed", "paths", "n_groups", "reg_src", "lays", "active")

    def __init__(self, session: Any, kind: str, fixed: list[tuple[Any, ...]], paths: list[str], reg_src: list[int],
                 lays: list[Any], active: list[bool]) -> None:
        self.session, self.kind, self.fixed, self.paths, self.n_groups = session, kind, fixed, paths, len(fixed)
        self.reg_src, self.lays, self.active = reg_src, lays, active

    def step(self, opt: Any) -> tuple[list[Any], list[list[Any]]] | None:
        """Run the step's host part (the step counts) and give (the storages bound, the scalars), or None,
        having changed nothing, when the Python could take another path than the model's."""
        groups = opt.param_groups
        if len(groups) != self.n_groups or getattr(opt, "grad_scale", None) is not None \
                or getattr(opt, "found_inf", None) is not None:
            return None
        keys = _FIXED[self.kind]
        for g, fixed in zip(groups, self.fixed):
            if tuple(g.get(k) for k in keys) != fixed or type(g.get("lr")) not in _NUM:
                return None
        paths = self.paths
        got = _tensors(opt, paths)
        if got is None:
            return None
        ts, counts, active = got
        lays = self.lays
        if len(ts) != len(lays) or active != self.active:
            return None
        refs = []
        session = self.session
        for t, lay in zip(ts, lays):
            try:
                r = t.untyped_storage()._ember
            except AttributeError:
                return None
            if r.session is not session or _layout(t) != lay:
                return None
            refs.append(r)
        if len(set(map(id, refs))) != len(refs):
            return None
        Tensor = torch.Tensor
        for c in counts:
            for s in c:
                if type(s) is not Tensor or not s.is_cpu:
                    return None
        global _ONE
        one = _ONE = _ONE if _ONE is not None else torch.tensor(1.0, device="cpu")
        for c in counts:
            if c:
                torch._foreach_add_(c, one, alpha=1.0)  # as torch does for CPU step counts
        return [refs[j] for j in self.reg_src], _step_scalars(groups, paths, counts, active)


class Trust:
    """One recorded step's host model: learnt from its guided replays, trusted after :data:`AGREE` of them in a
    row, dropped (and learnt again, up to :data:`DROPS` times) when a step no longer fits it."""

    __slots__ = ("model", "agreed", "misses", "drops")

    def __init__(self) -> None:
        self.model: HostModel | None | bool = None  # False: no model predicts this step (never asked again)
        self.agreed = self.misses = self.drops = 0

    def run(self, opt: Any, drop: bool = True) -> tuple[list[Any], list[list[Any]]] | None:
        """The step by the trusted model (:meth:`HostModel.step`), or None: none, off, or it does not fit this
        step (``drop``: then it is learnt again from the guided replays)."""
        model = self.model
        if not model or not ON[0]:
            return None
        got = model.step(opt)  # type: ignore[union-attr]
        if got is None and drop:
            self.drops += 1
            self.model, self.agreed = None if self.drops < DROPS else False, 0
        return got

    def after_guided(self, func: Any, opt: Any, session: Any, bound: list[Any], scalars: list[list[Any]]) -> None:
        """After a guided replay (its bound storages, its calls' scalars): does a model predict it?"""
        if self.model is not None or not ON[0]:
            return
        m = learn(func, opt, session, bound, scalars)
        if m is None:
            self.agreed, self.misses = 0, self.misses + 1
            if self.misses >= TRIES:
                self.model = False
        else:
            self.agreed += 1
            if self.agreed >= AGREE:
                self.model = m


def learn(func: Any, opt: Any, session: Any, bound: list[Any], scalars: list[list[Any]]) -> HostModel | None:
    """After a guided replay of ``opt``'s step (its inputs bound to the storages ``bound``, its calls' scalars
    ``scalars``): the model of that step, when it predicts both exactly; else None."""
    kind = _kind(func, opt)
    if kind is None:
        return None
    paths = [_path(kind, g) for g in opt.param_groups]
    if None in paths:
        return None
    got = _tensors(opt, paths)  # type: ignore[arg-type]
    if got is None:
        return None
    ts, counts, active = got
    try:
        refs = [t.untyped_storage()._ember for t in ts]
        want = _step_scalars(opt.param_groups, paths, counts, active)  # type: ignore[arg-type]
    except Exception:
        return None
    if len(want) != len(scalars) or any(len(a) != len(b) or any(type(x) is not type(y) or x != y
                                                                  for x, y in zip(a, b))
                                        for a, b in zip(want, scalars)):
        return None
    where = {id(r): j for j, r in enumerate(refs)}
    if len(where) != len(refs):
        return None  # (two of the tensors share a storage)
    reg_src = [where.get(id(r), -1) for r in bound]
    if -1 in reg_src or any(t.is_complex() for t in ts):
        return None
    fixed = [tuple(g.get(k) for k in _FIXED[kind]) for g in opt.param_groups]
    return HostModel(session, kind, fixed, paths, reg_src, [_layout(t) for t in ts], active)  # type: ignore[arg-type]


__all__ = ["AGREE", "DROPS", "ON", "TRIES", "HostModel", "Trust", "learn"]
