"""Is this torch one ``ember.torch`` can run on? Checked before anything else is imported."""

from __future__ import annotations

import torch

from ..errors import EmberError

TESTED = "2.13"


class UnsupportedTorch(EmberError, ImportError):
    """This torch lacks the pure-Python device API ember.torch is built on."""


def check_torch() -> None:
    acc = getattr(torch._C, "_acc", None)
    need = ("create_empty_tensor", "register_python_privateuseone_hook", "register_python_privateuseone_device_guard")
    from torch.utils import backend_registration as br
    if acc is None or not all(hasattr(acc, n) for n in need) or \
            not hasattr(br, "_setup_privateuseone_for_python_backend"):
        raise UnsupportedTorch(
            f"ember.torch needs torch's Python device API (torch._C._acc), which torch {torch.__version__} "
            f"lacks; it is tested with torch {TESTED}",
            hint=f"pip install 'ember[torch]' (torch {TESTED})")


__all__ = ["UnsupportedTorch", "check_torch", "TESTED"]
