"""Tensor movement: same-peer rendezvous and peer-to-peer downloads under capabilities.

Same peer, other device: the source session's worker *puts* its value under a
random token, the target session's worker *takes* it: no network, and no host
copy when both devices share a backend.

Different peers: the source exposes the value under a 32-byte capability bound
to the target's authenticated peer id, with a download count and a TTL; the
target peer dials the source on a *transfer* stream and downloads the bytes
directly. The client only sends the two small messages (EXPOSE to the source,
FETCH to the target) and never carries the payload. WebSocket peers have no
authenticated identity, so there the capability alone grants the download.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ProtocolError, TransferError
from ..protocol import codec
from ..protocol import messages as m
from ..transport.base import FrameConnection
from .backends import Backend
from .telemetry import OFF

log = logging.getLogger("ember.server.transfer")

#: How long a download waits for a capability that the source has not announced (network reordering).
UNANNOUNCED_WAIT = 5.0


@dataclass
class Exposed:
    value: Any                     # the array, or None when ``error`` says why not
    backend: Backend | None
    peer_id: str | None            # the only peer allowed to download (None: anyone holding the capability)
    downloads: int
    expires: float
    error: str | None = None


class TransferHub:
    """A server's exposed tensors and pending same-peer moves; bounded, thread-safe."""

    def __init__(self, max_entries: int = 4096) -> None:
        self.max_entries = max_entries
        self._cond = threading.Condition()
        self._exposed: dict[bytes, Exposed] = {}
        self._announced: dict[bytes, float] = {}
        self._local: dict[bytes, Exposed] = {}

    # ---- peer to peer --------------------------------------------------------------
    def announce(self, cap: bytes, ttl: float) -> None:
        """The session pump saw EXPOSE arrive: downloads may wait for the worker to reach it."""
        with self._cond:
            self._announced[cap] = time.monotonic() + min(ttl, 3600.0)

    def expose(self, cap: bytes, entry: Exposed) -> None:
        with self._cond:
            self._purge()
            if len(self._exposed) >= self.max_entries:
                raise TransferError(f"this peer already exposes {self.max_entries} tensors; "
                                    "capabilities are freed when used up or expired")
            self._exposed[cap] = entry
            self._announced.pop(cap, None)
            self._cond.notify_all()

    def claim(self, cap: bytes, peer_id: str | None, timeout: float) -> tuple[Any, Backend]:
        """Take one download of ``cap`` for ``peer_id`` or raise TransferError with the reason."""
        start = time.monotonic()
        deadline = start + timeout
        with self._cond:
            while cap not in self._exposed:
                now = time.monotonic()
                limit = self._announced.get(cap, 0.0)
                wait_until = min(deadline, limit) if limit else min(deadline, start + UNANNOUNCED_WAIT)
                if now >= wait_until:
                    raise TransferError("unknown capability (never exposed here, or already gone)")
                self._cond.wait(wait_until - now)
            e = self._exposed[cap]
            if e.peer_id is not None and peer_id != e.peer_id:
                raise TransferError(f"capability is bound to peer {e.peer_id[:16]}…, "
                                    f"not to the requesting peer {(peer_id or 'unauthenticated')[:16]}")
            if time.monotonic() > e.expires:
                del self._exposed[cap]
                raise TransferError("capability expired")
            if e.downloads <= 0:
                raise TransferError("capability used up")
            e.downloads -= 1
            if e.downloads == 0:
                del self._exposed[cap]
            if e.error is not None:
                raise TransferError(f"the source tensor has no value: {e.error}")
            assert e.backend is not None
            return e.value, e.backend

    def _purge(self) -> None:
        now = time.monotonic()
        for cap in [c for c, e in self._exposed.items() if e.expires < now]:
            del self._exposed[cap]
        for cap in [c for c, t in self._announced.items() if t < now]:
            del self._announced[cap]

    def exposed_count(self) -> int:
        with self._cond:
            self._purge()
            return len(self._exposed)

    # ---- same peer -------------------------------------------------------------------
    def put_local(self, token: bytes, entry: Exposed) -> None:
        with self._cond:
            if len(self._local) >= self.max_entries:
                raise TransferError("too many pending device-to-device moves on this peer")
            self._local[token] = entry
            self._cond.notify_all()

    def take_local(self, token: bytes, timeout: float) -> Exposed:
        deadline = time.monotonic() + timeout
        with self._cond:
            while token not in self._local:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferError(f"the source device did not hand the tensor over within {timeout:g} s")
                self._cond.wait(left)
            return self._local.pop(token)


def convert(value: Any, src: Backend, dst: Backend) -> Any:
    """Move an array between two devices of this peer; host copy only across backends."""
    if src is dst:
        return value
    if src.kind == dst.kind == "torch":
        return value.to(dst.device)
    if src.kind == dst.kind and src.kind in ("numpy",):
        return value
    return dst.from_host(src.to_host(value))


# ---- the transfer stream: source side (async, on the server loop) ---------------------

async def serve_transfer(hub: TransferHub, conn: FrameConnection, request: dict[str, Any], chunk: int,
                         probe: Any = None) -> None:
    """Answer one download request on ``conn`` (the first frame was ``request``)."""
    probe = probe or OFF
    who = conn.peer_id or conn.remote
    cap = request.get("capability")
    if not isinstance(cap, bytes) or len(cap) != 32:
        probe.transfer(None, who, "serve", "failed", error="malformed capability")
        await conn.send(codec.packb({"type": "denied", "reason": "malformed capability"}))
        return
    t0 = time.monotonic()
    try:
        value, backend = await asyncio.to_thread(hub.claim, cap, conn.peer_id, float(request.get("wait", 300.0)))
        host = await asyncio.to_thread(backend.to_host, value)
    except TransferError as e:
        log.info("transfer to %s denied: %s", who, e.message)
        probe.transfer(None, who, "serve", "failed", error=e.message)
        await conn.send(codec.packb({"type": "denied", "reason": e.message}))
        return
    flat = memoryview(host.reshape(-1).view(np.uint8))
    data = m.DATA_FEATURE in codec.agreed_features(request.get("features"))
    probe.transfer(None, who, "serve", "started", len(flat))
    try:
        await conn.send(codec.packb({"type": "ok", "dtype": host.dtype.name, "shape": list(host.shape),
                                     "total": len(flat), "features": [m.DATA_FEATURE] if data else []}))
        if data:  # data frames: the target can read each chunk straight into place
            for parts in codec.chunk_frames(flat, chunk):
                await conn.send(parts)
        else:  # a target that speaks no data frames: raw chunks
            for off in range(0, len(flat), chunk):
                await conn.send(flat[off:off + chunk])
    except (ConnectionError, OSError) as e:
        probe.transfer(None, who, "serve", "failed", len(flat), time.monotonic() - t0, f"the stream broke: {e}")
        raise
    probe.transfer(None, who, "serve", "completed", len(flat), time.monotonic() - t0)


# ---- target side ----------------------------------------------------------------------

async def download(address: str, cap: bytes, *, timeout: float, max_frame: int) -> np.ndarray:
    """Dial ``address`` on a transfer stream and download the tensor exposed under ``cap``."""
    from ..transport import dial
    try:
        conn = await dial(address, timeout=timeout, max_frame=max_frame, kind="transfer")
    except Exception as e:
        raise TransferError(f"cannot reach the source peer {address}: {getattr(e, 'message', e)}") from None
    try:
        await conn.send(codec.packb({"type": "transfer", "protocol": m.PROTOCOL_VERSION, "capability": cap,
                                     "wait": timeout, "features": list(m.FEATURES)}))
        hdr = codec.unpackb(await _recv(conn, timeout + UNANNOUNCED_WAIT + 5.0))
        if not isinstance(hdr, dict) or hdr.get("type") != "ok":
            reason = hdr.get("reason", "no reason given") if isinstance(hdr, dict) else "malformed answer"
            raise TransferError(f"the source peer denied the transfer: {reason}")
        total = int(hdr["total"])
        buf = np.empty(total, np.uint8)
        view = memoryview(buf)
        if m.DATA_FEATURE in codec.agreed_features(hdr.get("features")):
            await _receive_data(conn, view, timeout)
        else:
            got = 0
            while got < total:
                part = await _recv(conn, timeout)
                if got + len(part) > total:
                    raise TransferError("the source peer sent more bytes than it announced")
                view[got:got + len(part)] = part
                got += len(part)
        return buf.view(np.dtype(hdr["dtype"])).reshape(hdr["shape"])
    finally:
        try:
            await asyncio.wait_for(conn.close(), 2.0)
        except Exception:
            pass


async def _receive_data(conn: FrameConnection, view: memoryview, timeout: float) -> None:
    """Data frames ``[offset, nil, total]`` into ``view``, in order; straight into place where the
    transport has a data sink."""
    total, got = len(view), 0
    placed: dict[int, int] = {}

    def sink(head: memoryview, n: int) -> memoryview | None:
        try:
            off, _, tot = codec.decode_data_head(head)
        except (ProtocolError, ValueError):
            return None
        if type(off) is not int or tot != total or not 0 <= off <= total - n:
            return None
        placed[off] = n
        return view[off:off + n]

    set_sink = getattr(conn, "set_data_sink", None)
    if set_sink is not None:
        set_sink(sink)
    try:
        while got < total:
            frame = await _recv(conn, timeout)
            try:
                (off, _, _), payload = codec.decode_data(frame)
            except (ProtocolError, ValueError):
                raise TransferError("the source peer sent a malformed chunk") from None
            n = placed.pop(off, None) if not len(payload) else None
            if n is None:
                n = len(payload)
                if type(off) is not int or not 0 <= off <= total - n:
                    raise TransferError("the source peer sent a chunk outside the tensor")
                view[off:off + n] = payload
            if off != got or not n:
                raise TransferError("the source peer sent chunks out of order")
            got += n
    finally:
        if set_sink is not None:
            set_sink(None)


async def _recv(conn: FrameConnection, timeout: float) -> bytes:
    try:
        frame = await asyncio.wait_for(conn.recv(), timeout)
    except asyncio.TimeoutError:
        raise TransferError(f"the source peer sent nothing for {timeout:g} s") from None
    except (ConnectionError, OSError) as e:
        raise TransferError(f"the transfer stream broke: {e}") from None
    if frame is None:
        raise TransferError("the source peer closed the transfer stream early")
    return frame


# ---- the worker-side handlers (one per session) -------------------------------------------

class TransferOps:
    """EXPOSE / MOVE / FETCH for one session's interpreter; runs on its worker thread.

    Layouts: ``[EXPOSE, id, capability, target_peer, downloads, ttl]``,
    ``[MOVE, id, token]``, ``[FETCH, id, source_address | None, capability_or_token, timeout]``.
    """

    def __init__(self, interp: Any, hub: TransferHub, loop: asyncio.AbstractEventLoop, max_frame: int) -> None:
        self.interp = interp
        self.hub = hub
        self.loop = loop
        self.max_frame = max_frame

    def _entry(self, tid: int, peer: str | None, downloads: int, ttl: float) -> Exposed:
        v = self.interp.tensors.get(tid)
        error = None
        if v is None:
            p = self.interp.poison.get(tid)
            error = p.error["message"] if p else f"tensor {tid} is unknown to the source session"
        return Exposed(v, self.interp.backend, peer, int(downloads), time.monotonic() + float(ttl), error)

    def expose(self, msg: list[Any], out: list[list[Any]]) -> None:
        _, tid, cap, peer, downloads, ttl = msg
        self.hub.expose(bytes(cap), self._entry(tid, peer, downloads, ttl))

    def move(self, msg: list[Any], out: list[list[Any]]) -> None:
        _, tid, token = msg
        self.hub.put_local(bytes(token), self._entry(tid, None, 1, 300.0))

    def fetch(self, msg: list[Any], out: list[list[Any]]) -> None:
        _, tid, source, cap, timeout = msg
        interp = self.interp
        probe, scope, peer = interp.probe, "device" if source is None else "fetch", None if source is None else str(source)
        t0 = time.monotonic()
        probe.transfer(interp.label, peer, scope, "started")
        try:
            if source is None:
                e = self.hub.take_local(bytes(cap), float(timeout))
                if e.error is not None:
                    raise TransferError(f"the source tensor has no value: {e.error}")
                value = convert(e.value, e.backend, interp.backend)  # type: ignore[arg-type]
            else:
                fut = asyncio.run_coroutine_threadsafe(
                    download(source, bytes(cap), timeout=float(timeout), max_frame=self.max_frame), self.loop)
                value = interp.backend.from_host(fut.result(2 * float(timeout) + UNANNOUNCED_WAIT + 10.0))
            interp.tensors[tid] = value
            interp.poison.pop(tid, None)
            probe.transfer(interp.label, peer, scope, "completed", int(getattr(value, "nbytes", 0)),
                           time.monotonic() - t0)
        except Exception as e:
            message = e.message if isinstance(e, TransferError) else f"{type(e).__name__}: {e}"
            probe.transfer(interp.label, peer, scope, "failed", 0, time.monotonic() - t0, message)
            from .interpreter import Poison
            interp.tensors.pop(tid, None)
            interp.poison[tid] = Poison({"kind": "TransferError", "op": "to_device",
                                         "message": f"moving a tensor to {interp.backend.spec} failed: {message}"})
