"""Client tensors of the ``ember`` device: real ``torch.Tensor`` objects whose storage lives on a peer.

An ember tensor is a genuine torch tensor on ``ember:0`` with a null-data storage; its
sizes, strides and offset are real (set by running ``Tensor.set_``'s meta kernel with
"meta in TLS", as FakeTensor does). The remote object is the *storage*: the storage's
Python object (which torch preserves while the storage lives, and which views, ``detach``,
``nn.Parameter`` and ``.data`` share) carries a :class:`StorageRef` naming its id on one
Ember device's session. When torch frees the storage, the ref's ``__del__`` tells the
session to drop the id with its next batch.

A storage made by ``torch.empty``-like ops is *pending*: nothing is sent until its first
use, when the peer allocates it (zeroed) or an upload creates it whole.
"""

from __future__ import annotations

from typing import Any

import torch

from ..client.device import Device
from ..client.session import ClientSession
from ..errors import SessionLost

_create = torch._C._acc.create_empty_tensor
_meta_tls = torch._C._set_meta_in_tls_dispatch_include


class StorageRef:
    """A storage's identity on a peer: its id, session and device, and whether it exists there yet."""

    __slots__ = ("sid", "session", "device", "pending", "__weakref__")

    def __init__(self, sid: int, session: ClientSession, device: Device, pending: int | None = None) -> None:
        self.sid = sid
        self.session = session
        self.device = device
        self.pending = pending  # bytes to allocate on first use; None once the peer holds it

    def __del__(self) -> None:
        if self.pending is None:
            try:
                self.session.release(self.sid)
            except Exception:
                pass


def ref_of(t: torch.Tensor) -> StorageRef:
    """The peer storage behind an ember tensor."""
    r = getattr(t.untyped_storage(), "_ember", None)
    if r is None:
        raise RuntimeError("this ember tensor has no storage on a peer (it was not made by ember.torch)")
    return r


def ref_or_none(a: Any) -> StorageRef | None:
    """The peer storage behind ``a`` when it is an ember tensor made by ember.torch, else None."""
    if isinstance(a, torch.Tensor) and a.device.type == "ember":
        return getattr(a.untyped_storage(), "_ember", None)
    return None


def live_session(r: StorageRef) -> ClientSession:
    s = r.session
    lost = s.lost
    if lost is not None:
        if type(lost) is not SessionLost and isinstance(lost, SessionLost):  # (a mesh's: its own kind and hint)
            raise type(lost)(f"this tensor's session with {r.device.address} has ended: {lost.message}",
                             hint=lost.hint)
        raise SessionLost(f"this tensor's session with {r.device.address} has ended: {lost.message}",
                          hint="tensors do not survive their session; new work on the device reconnects")
    return s


def set_layout(t: torch.Tensor, storage: Any, offset: int, size: Any, stride: Any) -> torch.Tensor:
    """Point ``t`` at ``storage`` with this layout, without touching data (Tensor.set_'s meta kernel)."""
    _meta_tls(True)
    try:
        t.set_(storage, offset, size, stride)
    finally:
        _meta_tls(False)
    return t


def new_tensor(dtype: torch.dtype, size: Any, stride: Any, offset: int, ref: StorageRef | None = None,
               storage: Any = None) -> torch.Tensor:
    """An ember tensor with this layout: on ``storage`` (a view), or on a fresh storage named ``ref``."""
    t = _create((0,), dtype)
    if storage is None:
        storage = t.untyped_storage()
        storage._ember = ref
    return set_layout(t, storage, offset, size, stride)


def layout_of(t: torch.Tensor) -> list[Any]:
    """``[size, stride, offset, dtype]`` as the wire carries it."""
    return [list(t.shape), list(t.stride()), t.storage_offset(), dtype_name(t.dtype)]


def dtype_name(dt: torch.dtype) -> str:
    return str(dt)[6:]


__all__ = ["StorageRef", "ref_of", "live_session", "set_layout", "new_tensor", "layout_of", "dtype_name"]


def fresh_tensor(storages: dict[int, Any], sid: int, session: Any, device: int, dtype: Any, size: Any, stride: Any,
                 offset: int) -> torch.Tensor:
    """A replay's output on the new storage ``sid`` (one storage per id: ``storages`` remembers them)."""
    st = storages.get(sid)
    if st is None:
        t = new_tensor(dtype, size, stride, offset, ref=StorageRef(sid, session, device))
        storages[sid] = t.untyped_storage()
        return t
    return new_tensor(dtype, size, stride, offset, storage=st)
