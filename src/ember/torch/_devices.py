"""Which Ember device and session an ATen call runs on, and the state the frontend keeps per session.

``"ember"`` tensors made by factory ops live on the current Ember device (the innermost
``with dev:``, else ``ember.set_default_device``, else the peer named by ``EMBER_PEER`` (a ticket,
``ws://…`` or ``tcp://…``; read when ``ember.torch`` is imported, connected at first use), else the
embedded ``"local:torch"`` peer);
every other op runs where its operands' storages live, all on one device. ``torch.manual_seed``
reaches each peer lazily: before a session's next random op, its generator is reseeded.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import torch

from ..client.device import Device
from ..errors import EmberError
from ..protocol import messages as m
from ..protocol import ops
from ._schema import WRITES, WRITTEN, OpInfo
from ._storage import StorageRef, live_session

_OP = m.OP
_lock = threading.Lock()
_embedded: list[Device] = []
_seeded: dict[int, int] = {}  # id(session) -> the seed generation it has applied
SEED = [0, 0]  # [value, generation]; generation 0: never seeded by the user
PEER = os.environ.get("EMBER_PEER", "").strip() or "local:torch"  # the default device's peer


class NotATorchDevice(EmberError, RuntimeError):
    """ATen ops were asked of an Ember device whose backend is not torch."""


class WrongDevice(EmberError, RuntimeError):
    """One op mixed tensors of two Ember devices, or an ember tensor with a CPU tensor."""


def current_device() -> Device:
    """The Ember device factory ops (``torch.zeros(..., device="ember")``) run on: the innermost
    ``with dev:``, else the default. On a thread Python did not start (torch's autograd engine runs a
    backward on one, for the user thread that called it) and outside any ``with``, the ``with dev:``
    device of the user threads, when they agree."""
    from ..client.device import chosen_device, connect, entered_device
    dev = entered_device() if isinstance(threading.current_thread(), threading._DummyThread) else None
    if dev is None:
        dev = chosen_device()
    if dev is None:
        with _lock:
            if not _embedded:
                if PEER.startswith("local"):  # the embedded peer's kernels take the user's thread count
                    import torch

                    from ..server.execute import aten as peer_aten
                    peer_aten.THREADS[0] = torch.get_num_threads()
                _embedded.append(connect(PEER))
            dev = _embedded[0]
    return dev



def _writes(name: str) -> bool | None:
    """``ClientSession.op_writes`` of a session ember.torch uses: ATen overloads by their schemas, the Array
    API's ops as that frontend says (none writes), anything else unknown."""
    w = WRITES.get(name)
    return w if w is not None else ops.writes(name)


def check_torch(dev: Device) -> None:
    kind = dev.info.get("backend")
    if kind == "torch":
        s = dev.session
        w = getattr(s, "op_writes", False)
        if w is None or w is ops.writes:  # (what this frontend's ops write: a read may overtake the rest of
            s.op_writes = _writes         # its step; a mesh's sessions are not split)
            s.op_written = WRITTEN.get
        return
    raise NotATorchDevice(
        f"ember tensors need a torch device, and {dev!r} is a {kind} device ({dev.info.get('spec')})",
        hint="serve one with `ember serve --device torch:cpu` (or torch:cuda:N) and ember.connect to it")


def cpu_peer(info: dict[str, Any]) -> bool:
    """Is the device of ``info`` (``Device.info``) a torch CPU peer running this torch? (A kernel's workspace size,
    a generator's state size, a data-dependent result's layout: this process's CPU torch's are the peer's.)"""
    return info.get("spec") == "torch:cpu" and str(info.get("name", "")).split()[1:2] == [torch.__version__]


def device_of(refs: list[StorageRef], i: OpInfo) -> Device:
    if not refs:
        dev = current_device()
        check_torch(dev)
        return dev
    dev = refs[0].device
    for r in refs:
        if r.device is not dev:
            raise TwoDevices(f"{i.name} mixes tensors of two Ember devices, {dev!r} and {r.device!r}",
                             hint="torch calls every Ember device ember:0, so a factory call (torch.arange(..., "
                                  "device=x.device), torch.zeros(...)) makes its tensor on the current one: the "
                                  "innermost `with dev:`, else the default device. Run each stage's code under "
                                  "`with dev:`, or move a tensor with ember.torch.to_device(t, device)")
    return dev


class TwoDevices(WrongDevice):
    """A call's tensors live on two Ember devices (``_foreach_*`` calls are split by device instead)."""


def materialize(r: StorageRef) -> None:
    """Allocate a pending storage on its peer (zeroed) before its first use."""
    n, r.pending = r.pending, None
    live_session(r).record([_OP, "torch.alloc", [], 0, [r.sid], {"n": n}])


def apply_seed(s: Any) -> None:
    """Before a random op: reseed the session's generator if torch.manual_seed ran since it last was."""
    value, gen = SEED
    if gen and _seeded.get(id(s)) != gen:
        _seeded[id(s)] = gen
        s.record([_OP, "torch.seed", [value], 1, [], None])


def manual_seed_all(seed: int) -> None:
    """``torch.manual_seed`` reaches every Ember peer: their generators restart from ``seed``."""
    SEED[0] = int(seed) & ((1 << 64) - 1)
    SEED[1] += 1


__all__ = ["current_device", "check_torch", "device_of", "materialize", "apply_seed", "manual_seed_all",
           "NotATorchDevice", "WrongDevice", "SEED"]
