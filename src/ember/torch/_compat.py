"""Is this torch one ``ember.torch`` can run on? Checked before anything else is imported."""

from __future__ import annotations

from typing import Any

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


def hide_from_dynamo(modules: list[Any]) -> None:
    """Dynamo never compiles a frame of a function or method defined in ``modules``, nor any frame it calls,
    at no cost per call.

    torch's dispatcher calls ember's kernels (the PrivateUse1 fallback, the LSTM and SDPA kernels, ...)
    from inside a compiled region's eager parts, where Dynamo's frame hook is armed: unhidden, it
    tried to compile ember's own dispatch code at run time (the LSTM under ``torch.compile`` hit its
    recompile limit in ``_dispatch`` and ran at 0.3x instead of 0.5x). ``torch._dynamo.disable`` would
    do the same at a few microseconds per call; this marks the code objects once (a no-op where torch
    has no such hook)."""
    ev = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
    action, strategy = getattr(ev, "_FrameAction", None), getattr(ev, "_FrameExecStrategy", None)
    mark = getattr(ev, "set_code_exec_strategy", None)
    if action is None or strategy is None or mark is None:
        return
    skip = strategy(action.SKIP, action.SKIP)
    for mod in modules:
        for v in list(vars(mod).values()):
            if getattr(v, "__module__", None) != mod.__name__:
                continue
            for f in vars(v).values() if isinstance(v, type) else (v,):
                if hasattr(f, "__code__"):
                    _mark(f.__code__, mark, skip)


def _mark(code: Any, mark: Any, skip: Any) -> None:
    mark(code, skip)
    for c in code.co_consts:  # (functions made inside it: closures, one per op, share these)
        if hasattr(c, "co_consts"):
            _mark(c, mark, skip)


__all__ = ["UnsupportedTorch", "check_torch", "hide_from_dynamo", "TESTED"]
