"""``torch.ember.get_rng_state`` / ``set_rng_state``: the current Ember device's random stream as a state.

The stream lives on the peer (``server/execute/session_random.py``), so its state does too: ``get_rng_state``
returns an ember ``uint8`` tensor holding the generator's state bytes, snapshotted by the peer in order with
the ops before it (internal op ``torch.rng_state``, no round trip), and ``set_rng_state`` sets the stream
from such a tensor, or from its CPU copy (``torch.set_rng_state``). ``torch.utils.checkpoint`` saves the state
at a checkpointed forward and restores it for the recompute, so a dropout inside draws the same mask twice;
``torch.random.fork_rng(device_type="ember")`` works the same way. Offered by a torch CPU peer of this torch
version (the state's size is this process's CPU generator's): elsewhere ``available()`` is False, and
checkpoint leaves the device's stream alone, as before.

Under ``torch.compile``, a checkpointed region's random ops become torch's higher-order ops
``run_and_save_rng_state`` / ``run_with_rng_state``, whose kernels know cpu, cuda, hpu and xpu only;
:func:`install_compiled` adds ember to them over the same two ops (a traced call makes a fake state).
"""

from __future__ import annotations

from typing import Any

import torch

from ..protocol import messages as m
from ..protocol.codec import agreed_features
from . import _devices as Dv
from ._internal import call, cpu_peer

_SIZE = torch.Generator().get_state().numel()


def _device() -> Any:
    """The current Ember device when one exists (none is made here), else None."""
    from ..client.device import chosen_device
    return chosen_device() or (Dv._embedded[0] if Dv._embedded else None)


def _serves(dev: Any) -> bool:
    return dev is not None and cpu_peer(dev.info) and m.RNG_STATE_FEATURE in agreed_features(
        dev.session.welcome_features)


def available() -> bool:
    """Can the current Ember device's stream be saved and restored (``torch.ember._initialized``)?"""
    try:
        return _serves(_device())
    except Exception:  # noqa: BLE001 - no device, or a lost session: nothing to save
        return False


def _current() -> Any:
    dev = Dv.current_device()
    if not _serves(dev):
        raise NotImplementedError(f"the random state of {dev.address} ({dev.info.get('spec')}) cannot be saved: a "
                                  f"torch:cpu peer running torch {torch.__version__} offers it")
    Dv.apply_seed(dev.session)  # (a torch.manual_seed not yet sent: the state is the seeded one)
    return dev


def get_state() -> torch.Tensor:
    dev = _current()
    return call("torch.rng_state", [], [], [((_SIZE,), torch.uint8)], dev)[0]


def set_state(state: torch.Tensor) -> None:
    dev = _current()
    if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8 or state.shape != (_SIZE,):
        raise TypeError(f"set_rng_state takes a uint8 tensor of {_SIZE} bytes (from torch.ember.get_rng_state)")
    call("torch.set_rng_state", [], [state if state.device.type == "ember" else state.to("ember")], [], dev)


def _fake_state(args: Any, kwargs: Any) -> torch.Tensor | None:
    """A state for a call traced on fake tensors (``torch.compile`` tracing: nothing reaches the peer), else None."""
    from torch._guards import detect_fake_mode
    mode = detect_fake_mode((args, kwargs))
    if mode is None:
        return None
    with mode:
        return torch.empty(_SIZE, dtype=torch.uint8, device="ember")


def install_compiled() -> None:
    """Give torch's ``run_and_save_rng_state`` / ``run_with_rng_state`` (a compiled checkpointed region's random
    ops) ember kernels over :func:`get_state` / :func:`set_state`; other devices keep torch's own."""
    from torch._C import DispatchKey
    from torch._higher_order_ops.utils import registered_hop_fake_fns
    from torch._prims import rng_prims as R
    from torch.fx.experimental.proxy_tensor import ProxyTorchDispatchMode
    save, run_with, select = R.run_and_save_rng_state, R.run_with_rng_state, DispatchKey.BackendSelect
    if getattr(save.py_kernels[select], "_ember", False):
        return
    save_torch, save_fake, save_proxy = (save.py_kernels[select], registered_hop_fake_fns[save],
                                         save.python_key_table[ProxyTorchDispatchMode])
    with_torch = run_with.py_kernels[select]

    def save_select(op: Any, *args: Any, **kwargs: Any) -> Any:
        if R.get_device(args, kwargs) != "ember":
            return save_torch(op, *args, **kwargs)
        state = _fake_state(args, kwargs)
        return (get_state() if state is None else state), op(*args, **kwargs)

    def save_traced(op: Any, *args: Any, **kwargs: Any) -> Any:  # (fake mode: torch's calls its own select)
        return save_select(op, *args, **kwargs) if R.get_device(args, kwargs) == "ember" else \
            save_fake(op, *args, **kwargs)

    def save_proxied(mode: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        if R.get_device(args, kwargs) != "ember":
            return save_proxy(mode, op, *args, **kwargs)
        out = save_select(op, *args, **kwargs)
        proxy_args = R.pytree.tree_map(mode.tracer.unwrap_proxy, (op, *args))
        proxy_kwargs = R.pytree.tree_map(mode.tracer.unwrap_proxy, kwargs)
        out_proxy = mode.tracer.create_proxy("call_function", save, proxy_args, proxy_kwargs)
        return R.track_tensor_tree(out, out_proxy, constant=None, tracer=mode.tracer)

    def with_select(rng_state: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        if R.get_device(args, kwargs) != "ember":
            return with_torch(rng_state, op, *args, **kwargs)
        current = get_state()
        set_state(rng_state)
        try:
            return op(*args, **kwargs)
        finally:
            set_state(current)

    save_select._ember = True  # type: ignore[attr-defined]
    save.py_kernels[select], run_with.py_kernels[select] = save_select, with_select
    save.python_key_table[ProxyTorchDispatchMode] = save_proxied
    registered_hop_fake_fns[save] = save_traced
    save._dispatch_cache.clear()
    run_with._dispatch_cache.clear()


__all__ = ["available", "get_state", "set_state", "install_compiled"]
