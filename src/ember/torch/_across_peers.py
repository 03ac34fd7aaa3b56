"""One optimizer, one ``clip_grad_norm_`` over a model split across Ember devices (a pipeline: its first stage on
one peer, the rest on another).

torch calls every Ember device ``ember:0``, so its per-device grouping (``_group_tensors_by_device_and_dtype``)
puts the tensors of several peers in one ``_foreach_*`` call, and ``.to(first_device)`` moves nothing. Here a
``_foreach_*`` call over several Ember devices runs as one call per device, as torch's grouping would on CUDA
(a lone tensor argument, ``clip_grad_norm_``'s coefficient, moved to each); and ``clip_grad_norm_``'s total norm
gathers the per-tensor norms on the first tensor's device, as its ``norm.to(first_device)`` does on CUDA.
"""

from __future__ import annotations

from typing import Any

import torch

from ..client.device import Device
from ..protocol import aten as A
from ._devices import TwoDevices, WrongDevice
from ._schema import OpInfo, bound, call
from ._storage import ref_or_none
from ._transfer import to_device


def foreach_by_device(i: OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A ``_foreach_*`` call over several Ember devices as one call per device, its lists split by the device of
    the first list's tensors, in their order."""
    values = bound(i, args, kwargs)
    lists = [j for j, (_n, cat, _k, _d) in enumerate(i.args) if cat in (A.TENSOR_LIST, A.SCALAR_LIST)
             and isinstance(values[j], (list, tuple))]
    first = values[lists[0]]
    groups: dict[int, tuple[Device, list[int]]] = {}
    for k, t in enumerate(first):
        r = ref_or_none(t)
        if r is None or any(len(values[j]) != len(first) for j in lists):
            raise WrongDevice(f"{i.name} mixes tensors of two Ember devices with others", hint="move them to one")
        groups.setdefault(id(r.device), (r.device, []))[1].append(k)
    out: list[Any] = [None] * len(first)
    for dev, idx in groups.values():
        part = [[values[j][k] for k in idx] if j in lists else _onto(v, dev) for j, v in enumerate(values)]
        if len(groups) == 1 and all(part[j] is v for j, v in enumerate(values) if j not in lists):
            raise TwoDevices(f"{i.name} mixes tensors of two Ember devices", hint="move one with ember.torch.to_device")
        res = call(i, part)
        if isinstance(res, (list, tuple)):
            for k, v in zip(idx, res):
                out[k] = v
    return out if i.returns == ["List[Tensor]"] else None


def _onto(v: Any, dev: Device) -> Any:
    """A lone tensor argument on ``dev``, as torch's ``.to(device)`` would have put it."""
    r = ref_or_none(v)
    return v if r is None or r.device is dev else to_device(v, dev)


def install_clip_grad() -> None:
    """``clip_grad_norm_`` (and ``get_total_norm``) over gradients on several Ember devices."""
    import torch.nn.utils.clip_grad as cg
    orig = cg._get_total_norm
    if getattr(orig, "_ember", False):
        return

    def _get_total_norm(tensors: Any, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> torch.Tensor:
        ts = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        refs = [ref_or_none(t) for t in ts]
        if not refs or refs[0] is None or all(r is not None and r.device is refs[0].device for r in refs):
            return orig(ts, norm_type, error_if_nonfinite, foreach)
        first = refs[0].device
        norms = torch._foreach_norm(ts, float(norm_type)) if foreach is not False else \
            [torch.linalg.vector_norm(t, float(norm_type)) for t in ts]  # (torch's calls, on every device at once)
        total = torch.linalg.vector_norm(torch.stack([_onto(n, first) for n in norms]), float(norm_type))
        if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
            raise RuntimeError(f"The total norm of order {float(norm_type)} for gradients from `parameters` is "
                               "non-finite, so it cannot be clipped. To disable this error and scale the gradients "
                               "by the non-finite norm anyway, set `error_if_nonfinite=False`")
        return total
    _get_total_norm._ember = True  # type: ignore[attr-defined]
    cg._get_total_norm = _get_total_norm
    torch.nn.utils.get_total_norm = _get_total_norm


__all__ = ["foreach_by_device", "install_clip_grad"]
