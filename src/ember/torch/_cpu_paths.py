"""Where torch picks a code path by device, a CPU peer's tensors take CPU's.

Torch sends any accelerator's tensors down CUDA's multi-tensor paths (``_foreach_*`` kernels), ember's too.
On a torch CPU peer that rounds otherwise than CPU torch in a few places; these patches choose CPU's path
there, so that ember stays bit-equal to local CPU. On other peers (``torch:cuda``) torch's choice stands.
"""

from __future__ import annotations

from typing import Any

import torch

from . import _devices as Dv
from ._storage import ref_or_none


def optimizer_defaults() -> None:
    """Optimizers left at ``foreach=None`` take CPU's single-tensor path on a CPU peer's parameters where torch's two
    paths round otherwise: ``NAdam``, ``RAdam`` and ``ASGD`` always, every optimizer on float16 / bfloat16
    parameters (SGD with momentum, RMSprop, Adagrad... differ there). Torch picks the multi-tensor path for any
    accelerator, ember too; elsewhere the two are bit-equal and the multi-tensor one is kept (fewer ops)."""
    import importlib
    always = {"nadam", "radam", "asgd"}
    for name in ("sgd", "adam", "rmsprop", "adagrad", "adamax", "adadelta", "rprop", *sorted(always)):
        mod = importlib.import_module(f"torch.optim.{name}")
        orig = mod._default_to_fused_or_foreach
        if getattr(orig, "_ember", False):
            continue

        def default(params: Any, differentiable: bool, use_fused: bool = False, _orig: Any = orig,
                    _always: bool = name in always) -> Any:
            if torch.compiler.is_compiling():  # (a compiled step, traced: torch's choice, as in eager below for
                return _orig(params, differentiable, use_fused)  # float32; ember's own code would break the graph)
            ps = [p for p in params if p is not None]
            refs = [ref_or_none(p) for p in ps]
            if refs and all(r is not None and r.device.info.get("spec") == "torch:cpu" for r in refs) and \
                    (_always or any(p.dtype in (torch.float16, torch.bfloat16) for p in ps)):
                return False, False
            return _orig(params, differentiable, use_fused)
        default._ember = True  # type: ignore[attr-defined]
        mod._default_to_fused_or_foreach = default


def swa_path() -> None:
    """``AveragedModel`` averages a CPU peer's tensors by CPU's per-tensor code. Torch sends any accelerator's
    (``_get_foreach_kernels_supported_devices`` names ember) down CUDA's multi-tensor ``lerp``: 1e-9 off CPU's
    ``p + (q - p) / (n + 1)``, and failing on BatchNorm's integer counter with ``use_buffers=True``."""
    from torch.optim import swa_utils
    orig = swa_utils._get_foreach_kernels_supported_devices
    if getattr(orig, "_ember", False):
        return

    class Devices(list):
        def __contains__(self, name: object) -> bool:
            if name == "ember" and Dv.cpu_peer(Dv.current_device().info):
                return False
            return list.__contains__(self, name)

    def devices() -> list[str]:
        return Devices(orig())
    devices._ember = True  # type: ignore[attr-defined]
    swa_utils._get_foreach_kernels_supported_devices = devices


def install() -> None:
    optimizer_defaults()
    swa_path()


__all__ = ["install", "optimizer_defaults", "swa_path"]
