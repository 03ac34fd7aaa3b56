"""``torch.ember.get_rng_state`` / ``set_rng_state``: the current Ember device's random stream as a state.

The stream lives on the peer (``server/execute/session_random.py``), so its state does too: ``get_rng_state``
returns an ember ``uint8`` tensor holding the generator's state bytes, snapshotted by the peer in order with
the ops before it (internal op ``torch.rng_state``, no round trip), and ``set_rng_state`` sets the stream
from such a tensor, or from its CPU copy (``torch.set_rng_state``). ``torch.utils.checkpoint`` saves the state
at a checkpointed forward and restores it for the recompute, so a dropout inside draws the same mask twice;
``torch.random.fork_rng(device_type="ember")`` works the same way. Offered by a torch CPU peer of this torch
version (the state's size is this process's CPU generator's): elsewhere ``available()`` is False, and
checkpoint leaves the device's stream alone, as before.
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


__all__ = ["available", "get_state", "set_state"]
