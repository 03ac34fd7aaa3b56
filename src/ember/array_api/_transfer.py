"""``x.to_device(dev)``: the cheapest path between two devices.

* same device: the array itself;
* same peer, other device: MOVE on the source session + FETCH(token) on the
  target session; the peer hands the tensor over in-process;
* different peers: EXPOSE (capability bound to the target's peer id) on the
  source + FETCH(source address, capability) on the target; the target downloads
  directly from the source, the payload never passes through this client;
* the embedded ``local`` peer, or ``via_client=True``: download here, upload there.
"""

from __future__ import annotations

import os
from typing import Any

from ..client.device import is_embedded
from ..client.progress import choose
from ..errors import TransferError
from ..protocol import messages as m
from ..transport import is_iroh_address
from . import _validate as V
from ._array import RemoteArray
from ._device import check_dtype, resolve


def to_device(self: RemoteArray, device: Any, /, *, stream: Any = None, **kw: Any) -> RemoteArray:
    """This array on ``device`` (the same object when it is already there)."""
    if device is self._dev or device is None:
        return self
    return move(self, resolve(device), **kw)


RemoteArray.to_device = to_device  # type: ignore[attr-defined]


def move(x: RemoteArray, device: Any, *, via_client: bool = False, downloads: int = 1, ttl: float = 300.0,
         timeout: float = 120.0, progress: bool | None = None) -> RemoteArray:
    """``progress``: a bar for a large move (True always, False never, None as ``ember.set_progress``
    says). Through the client it counts bytes down and up; between peers the client sees no bytes,
    so the bar waits for the move to finish (the call then returns once it has)."""
    dst = resolve(device)
    via_client = V.flag("via_client", via_client)
    downloads = V.integer("downloads", downloads, lo=1)
    ttl, timeout = V.positive_real("ttl", ttl), V.positive_real("timeout", timeout)
    if progress is not None:
        progress = V.flag("progress", progress)
    src = x.device
    if dst is src:
        return x
    check_dtype(dst, x.dtype)
    if via_client or is_embedded(src.address) or is_embedded(dst.address):
        from ._creation import upload
        return upload(x.to_numpy(progress=progress), dst, progress)
    out = _move(x, dst, downloads, ttl, timeout)
    n = x.dtype.itemsize * x.size
    prog = choose(progress, n)
    if prog is not None:
        bar = prog.bar(n, f"move {n / 2**20:.0f} MiB")
        try:
            dst.sync(timeout)
            bar.update_to(n)
        finally:
            bar.close()
    return out


def _move(x: RemoteArray, dst: Any, downloads: int, ttl: float, timeout: float) -> RemoteArray:
    src = x.device
    ss, ds = x._session, dst.session
    if ss.lost is not None:
        raise TransferError(f"the source device's session is gone: {ss.lost.message}",
                            hint="arrays do not survive their session; recompute the value")
    tid = next(ds.ids)
    if ss.welcome.get("instance") == ds.welcome.get("instance"):
        token = os.urandom(32)
        ss.record([m.MOVE, x._id, token])
        ss.flush()
        ds.record([m.FETCH, tid, None, token, timeout])
    else:
        if is_iroh_address(src.address) != is_iroh_address(dst.address):
            raise TransferError(
                f"{src.address[:24]}… and {dst.address[:24]}… are reached over different transports "
                "(iroh and WebSocket), so the peers cannot reach each other directly",
                hint="relay through this client: x.to_device(device, via_client=True)")
        cap = os.urandom(32)
        bound = ds.welcome.get("transfer_id") if is_iroh_address(src.address) else None
        ss.send_alone([m.EXPOSE, x._id, cap, bound, downloads, ttl])
        ds.record([m.FETCH, tid, src.address, cap, timeout])
    return RemoteArray(tid, x.shape, x.dtype, dst, ds)
