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
The target's download itself is :mod:`.download`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..errors import EmberError, LimitExceeded, ProtocolError, TransferError
from ..protocol import codec
from ..protocol import lanes as pl
from ..protocol import messages as m
from ..transport.base import FrameConnection
from .execute.backends import Backend
from .download import UNANNOUNCED_WAIT, download
from .execute.replay import Poison
from .lanes import TransferLanes
from .telemetry.probe import OFF

log = logging.getLogger("ember.server.transfer")

#: Longest TTL an exposure (or an unclaimed same-peer move) may ask for.
MAX_TTL = 3600.0
#: Exposures plus pending moves one session may have at once.
MAX_PER_SESSION = 256
#: Most downloads one capability may grant.
MAX_DOWNLOADS = 1 << 16


@dataclass
class Exposed:
    value: Any                     # the array, or None when ``error`` says why not
    backend: Backend | None
    peer_id: str | None            # the only peer allowed to download (None: anyone holding the capability)
    downloads: int
    expires: float
    error: str | None = None
    owner: Any = None              # the exposing session (its entries are revoked when it ends)
    release: Callable[[], None] | None = None  # gives the session's memory back when the entry goes


def release_entry(e: Exposed) -> None:
    """Give an entry's memory back to its session (once)."""
    if e.release is not None:
        release, e.release = e.release, None
        try:
            release()
        except Exception:  # noqa: BLE001 - accounting must never break a transfer
            log.exception("releasing a transfer entry failed")


class TransferHub:
    """A server's exposed tensors and pending same-peer moves; bounded, thread-safe.

    An entry keeps its tensor's buffer charged to the exposing session until it is used up,
    expires, or the session ends (:meth:`revoke`), whichever comes first.
    """

    def __init__(self, max_entries: int = 4096, per_session: int = MAX_PER_SESSION) -> None:
        self.max_entries = max_entries
        self.per_session = per_session
        self._cond = threading.Condition()
        self._exposed: dict[bytes, Exposed] = {}
        self.lanes = TransferLanes()  # downloads striped over several streams (the network loop's)
        self._announced: dict[bytes, float] = {}
        self._local: dict[bytes, Exposed] = {}
        self._owned: dict[Any, int] = {}
        self._clients: dict[str, int] = {}  # entries per client (all its sessions): a quarter of the table at most
        self.per_client = max(per_session, max_entries // 4)
        self._refused: dict[bytes, tuple[float, str]] = {}  # capability -> (until, why EXPOSE was refused)

    # ---- bookkeeping (under the lock) --------------------------------------------------
    def _add(self, table: dict[bytes, Exposed], key: bytes, entry: Exposed, what: str) -> None:
        self._purge()
        n = self._owned.get(entry.owner, 0)
        if entry.owner is not None and n >= self.per_session:
            raise TransferError(f"this session already has {n} tensors exposed or moving; "
                                "they are freed when used up, expired or when the session ends")
        client = getattr(entry.owner, "client", None)
        c = self._clients.get(client, 0)
        if client is not None and c >= self.per_client:
            raise TransferError(f"this client's sessions already have {c} tensors exposed or moving, the most one "
                                "client may have on this peer; they are freed when used up, expired or when the "
                                "sessions end")
        if len(self._exposed) + len(self._local) >= self.max_entries:
            raise TransferError(f"this peer already holds {self.max_entries} {what}; "
                                "capabilities are freed when used up or expired")
        old = table.pop(key, None)
        if old is not None:
            self._drop(old)
        table[key] = entry
        self._owned[entry.owner] = n + 1
        if client is not None:
            self._clients[client] = c + 1
        self._cond.notify_all()

    def _drop(self, e: Exposed) -> None:
        n = self._owned.get(e.owner, 0) - 1
        if n > 0:
            self._owned[e.owner] = n
        else:
            self._owned.pop(e.owner, None)
        client = getattr(e.owner, "client", None)
        if client is not None:
            c = self._clients.get(client, 0) - 1
            if c > 0:
                self._clients[client] = c
            else:
                self._clients.pop(client, None)
        release_entry(e)

    def _purge(self) -> None:
        now = time.monotonic()
        for table in (self._exposed, self._local):
            for key in [k for k, e in table.items() if e.expires < now]:
                self._drop(table.pop(key))
        for cap in [c for c, t in self._announced.items() if t < now]:
            del self._announced[cap]
        for cap in [c for c, (t, _) in self._refused.items() if t < now]:
            del self._refused[cap]

    def revoke(self, owner: Any) -> None:
        """The session ``owner`` ended: withdraw its exposures and pending moves."""
        with self._cond:
            for table in (self._exposed, self._local):
                for key in [k for k, e in table.items() if e.owner is owner]:
                    self._drop(table.pop(key))

    # ---- peer to peer --------------------------------------------------------------
    def announce(self, cap: bytes, ttl: float) -> None:
        """The session pump saw EXPOSE arrive: downloads may wait for the worker to reach it."""
        if not isinstance(cap, bytes) or len(cap) != 32 or not isinstance(ttl, (int, float)) or not ttl > 0:
            return
        with self._cond:
            if len(self._announced) < self.max_entries:
                self._announced[cap] = time.monotonic() + min(float(ttl), MAX_TTL)

    def refuse(self, cap: Any, reason: str) -> None:
        """EXPOSE of ``cap`` failed: a download asking for it is told why (instead of waiting)."""
        if not isinstance(cap, bytes) or len(cap) > 64:
            return
        with self._cond:
            self._announced.pop(cap, None)
            if len(self._refused) < self.max_entries:
                self._refused[cap] = (time.monotonic() + UNANNOUNCED_WAIT * 12, reason)

    def expose(self, cap: bytes, entry: Exposed) -> None:
        with self._cond:
            self._add(self._exposed, cap, entry, "exposed tensors")
            self._announced.pop(cap, None)

    def _claim_now(self, cap: bytes, peer_id: str | None) -> tuple[Any, Backend]:
        e = self._exposed[cap]
        if e.peer_id is not None and peer_id != e.peer_id:
            raise TransferError(f"capability is bound to peer {e.peer_id[:16]}…, "
                                f"not to the requesting peer {(peer_id or 'unauthenticated')[:16]}")
        if time.monotonic() > e.expires:
            self._drop(self._exposed.pop(cap))
            raise TransferError("capability expired")
        e.downloads -= 1
        if e.downloads <= 0:
            self._drop(self._exposed.pop(cap))
        if e.error is not None:
            raise TransferError(f"the source tensor has no value: {e.error}")
        assert e.backend is not None
        return e.value, e.backend

    async def claim(self, cap: bytes, peer_id: str | None, timeout: float) -> tuple[Any, Backend]:
        """Take one download of ``cap`` for ``peer_id`` or raise TransferError with the reason.

        Waits on the event loop by polling (a thread per waiting download would let a few
        bogus requests exhaust the default executor)."""
        start = time.monotonic()
        deadline = start + timeout
        delay = 0.001
        while True:
            with self._cond:
                if cap in self._exposed:
                    return self._claim_now(cap, peer_id)
                if cap in self._refused:
                    raise TransferError(f"the source peer refused to expose the tensor: {self._refused[cap][1]}")
                wait = self._wait_left(cap, start, deadline)
            if wait <= 0:
                raise TransferError("unknown capability (never exposed here, or already gone)")
            await asyncio.sleep(min(delay, wait))
            delay = min(delay * 2, 0.05)

    def _wait_left(self, cap: bytes, start: float, deadline: float) -> float:
        limit = self._announced.get(cap, 0.0)
        wait_until = min(deadline, limit) if limit else min(deadline, start + UNANNOUNCED_WAIT)
        return wait_until - time.monotonic()

    def exposed_count(self) -> int:
        with self._cond:
            self._purge()
            return len(self._exposed)

    def held_by(self, owner: Any) -> int:
        """Exposures plus pending moves of one session."""
        with self._cond:
            return self._owned.get(owner, 0)

    # ---- same peer -------------------------------------------------------------------
    def put_local(self, token: bytes, entry: Exposed) -> None:
        with self._cond:
            self._add(self._local, token, entry, "pending device-to-device moves")

    def take_local(self, token: bytes, timeout: float) -> Exposed:
        """The moved entry; its holder's memory is released (the caller now holds the value)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while token not in self._local:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferError(f"the source device did not hand the tensor over within {timeout:g} s")
                self._cond.wait(left)
            e = self._local.pop(token)
            self._drop(e)
            return e


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
    cap, wait = request.get("capability"), request.get("wait", 300.0)

    async def deny(reason: str, error: str | None = None) -> None:
        probe.transfer(None, who, "serve", "failed", error=error or reason)
        await conn.send(codec.packb({"type": "denied", "reason": reason}))
    if not isinstance(cap, bytes) or len(cap) != 32:
        return await deny("malformed capability")
    if not isinstance(wait, (int, float)) or isinstance(wait, bool) or not 0 <= wait <= MAX_TTL:
        return await deny(f"malformed wait {str(wait)[:40]}", "malformed wait")
    t0 = time.monotonic()
    try:
        value, backend = await hub.claim(cap, conn.peer_id, float(wait))
        host = await asyncio.to_thread(backend.to_host, value)
    except TransferError as e:
        log.info("transfer to %s denied: %s", who, e.message)
        return await deny(e.message)
    flat = memoryview(host.reshape(-1).view(np.uint8))
    features = codec.agreed_features(request.get("features"))
    data = m.DATA_FEATURE in features
    wanted = request.get("lanes")
    striped = None
    if data and m.LANES_FEATURE in features and type(wanted) is int and 1 < wanted <= pl.MAX_LANES \
            and len(flat) >= pl.STRIPE_MIN:  # several streams side by side, stripe i on lane i
        striped = hub.lanes.offer(flat, conn.peer_id, wanted, chunk)
    probe.transfer(None, who, "serve", "started", len(flat))
    try:
        hdr = {"type": "ok", "dtype": host.dtype.name, "shape": list(host.shape), "total": len(flat),
               "features": [m.DATA_FEATURE] + ([m.LANES_FEATURE] if striped else []) if data else []}
        if striped is not None:
            hdr.update(lanes=len(striped[1].bounds), lane_key=striped[0], chunk=chunk)
        await conn.send(codec.packb(hdr))
        if striped is not None:  # stripe 0 here, the others on the lanes the target opens
            key, offer = striped
            try:
                for parts in codec.chunk_frames(flat, chunk, *offer.bounds[0]):
                    await conn.send(parts)
                await asyncio.wait_for(offer.done.wait(), max(1.0, offer.expires - time.monotonic()))
            except asyncio.TimeoutError:
                raise ConnectionError("the downloader did not open its transfer lanes") from None
            finally:
                hub.lanes.withdraw(key)
        elif data:  # data frames: the target can read each chunk straight into place
            for parts in codec.chunk_frames(flat, chunk):
                await conn.send(parts)
        else:  # a target that speaks no data frames: raw chunks
            for off in range(0, len(flat), chunk):
                await conn.send(flat[off:off + chunk])
    except (ConnectionError, OSError) as e:
        probe.transfer(None, who, "serve", "failed", len(flat), time.monotonic() - t0, f"the stream broke: {e}")
        raise
    probe.transfer(None, who, "serve", "completed", len(flat), time.monotonic() - t0)


# ---- the worker-side handlers (one per session) -------------------------------------------

class TransferOps:
    """EXPOSE / MOVE / FETCH for one session's interpreter; runs on its worker thread.

    Layouts: ``[EXPOSE, id, capability, target_peer, downloads, ttl]``,
    ``[MOVE, id, token]``, ``[FETCH, id, source_address | None, capability_or_token, timeout]``.
    Client timeouts are clamped to ``max_wait`` seconds; entries are owned by this session
    (``hub.revoke(ops)`` when it ends) and keep their tensor charged to it while they live.
    """

    def __init__(self, interp: Any, hub: TransferHub, loop: asyncio.AbstractEventLoop, max_frame: int,
                 max_wait: float = 300.0) -> None:
        self.interp = interp
        self.hub = hub
        self.loop = loop
        self.max_frame = max_frame
        self.max_wait = max_wait
        self.client: str | None = None  # the session's client identity (entries are capped per client)

    def _entry(self, tid: Any, peer: Any, downloads: Any, ttl: Any) -> Exposed:
        if peer is not None and not isinstance(peer, str):
            raise ProtocolError(f"malformed transfer message: target peer {str(peer)[:40]} is not a string")
        if type(downloads) is not int or not 1 <= downloads <= MAX_DOWNLOADS:
            raise ProtocolError(f"malformed transfer message: downloads {str(downloads)[:40]} "
                                f"is not an int in 1..{MAX_DOWNLOADS}")
        if not isinstance(ttl, (int, float)) or isinstance(ttl, bool) or not 0 <= ttl <= MAX_TTL:
            raise ProtocolError(f"malformed transfer message: ttl {str(ttl)[:40]} is not a number of seconds "
                                f"in [0, {MAX_TTL:g}]")
        interp = self.interp
        v = interp.tensors.get(tid) if type(tid) is int else None
        error, release = None, None
        if v is None:
            p = interp.poison.get(tid) if type(tid) is int else None
            if p is None:  # an id it does not hold: nothing to expose, no entry to take a slot
                raise TransferError(f"tensor {str(tid)[:40]} is unknown to this session: nothing to expose")
            error = p.error["message"]
        else:  # the entry keeps the buffer alive: it stays charged to this session meanwhile
            key, n = interp._fp(v)
            interp.mem.hold(key, n, "an exposed tensor")
            release = lambda mem=interp.mem, key=key: mem.unhold_later(key)  # noqa: E731 - any thread
        return Exposed(v, interp.backend, peer, downloads, time.monotonic() + float(ttl), error,
                       owner=self, release=release)

    def expose(self, msg: list[Any], out: list[list[Any]]) -> None:
        _, tid, cap, peer, downloads, ttl = msg
        try:
            entry = self._entry(tid, peer, downloads, ttl)
        except Exception as e:
            self.hub.refuse(cap, getattr(e, "message", str(e)))
            raise
        try:
            self.hub.expose(_secret(cap, "capability"), entry)
        except BaseException as e:
            release_entry(entry)
            self.hub.refuse(cap, getattr(e, "message", str(e)))
            raise

    def move(self, msg: list[Any], out: list[list[Any]]) -> None:
        _, tid, token = msg
        entry = self._entry(tid, None, 1, min(300.0, MAX_TTL))
        try:
            self.hub.put_local(_secret(token, "token"), entry)
        except BaseException:
            release_entry(entry)
            raise

    def fetch(self, msg: list[Any], out: list[list[Any]]) -> None:
        _, tid, source, cap, timeout = msg
        interp = self.interp
        probe, scope, peer = interp.probe, "device" if source is None else "fetch", None if source is None else str(source)
        t0 = time.monotonic()
        probe.transfer(interp.label, peer, scope, "started")
        if type(tid) is not int:
            raise ProtocolError(f"malformed Fetch: tensor id {str(tid)[:40]} is not an int")
        reserved = [0]

        def reserve(total: int) -> None:  # on the loop, before the download allocates its buffer
            interp.mem.charge(total, lambda: f"downloading tensor {tid} ({total} bytes) from {str(source)[:60]}")
            reserved[0] = total

        try:
            if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout >= 0:
                raise TransferError(f"malformed Fetch timeout {str(timeout)[:40]}")
            wait = min(float(timeout), self.max_wait)
            key = _secret(cap, "capability")
            if source is None:
                e = self.hub.take_local(key, wait)
                if e.error is not None:
                    raise TransferError(f"the source tensor has no value: {e.error}")
                value = convert(e.value, e.backend, interp.backend)  # type: ignore[arg-type]
            elif not isinstance(source, str):
                raise TransferError(f"malformed Fetch source {str(source)[:40]}")
            else:
                fut = asyncio.run_coroutine_threadsafe(
                    download(source, key, timeout=wait, max_frame=self.max_frame, reserve=reserve,
                             dtypes=interp.backend.dtypes), self.loop)
                value = interp.backend.from_host(fut.result(2 * wait + UNANNOUNCED_WAIT + 10.0))
            interp.put(tid, value, "to_device", reserved[0])
            reserved[0] = 0
            interp.poison.pop(tid, None)
            probe.transfer(interp.label, peer, scope, "completed", int(getattr(value, "nbytes", 0)),
                           time.monotonic() - t0)
        except Exception as e:
            interp.mem.release(reserved[0])
            probe.transfer(interp.label, peer, scope, "failed", 0, time.monotonic() - t0,
                           e.message if isinstance(e, EmberError) else f"{type(e).__name__}: {e}")
            if isinstance(e, LimitExceeded):
                poison = Poison({"kind": "LimitExceeded", "op": "to_device", "message": e.message})
            else:
                message = e.message if isinstance(e, EmberError) else f"{type(e).__name__}: {e}"
                src = f" from {source[:72]}" if isinstance(source, str) else ""
                poison = Poison({"kind": "TransferError", "op": "to_device",
                                 "message": f"moving a tensor{src} to this peer ({interp.backend.spec}) failed: "
                                            f"{message} (did the source peer end?)"})
            interp._set_poison([tid], poison)


def _secret(v: Any, what: str) -> bytes:
    """A capability or move token: 16 to 64 random bytes (the client sends 32)."""
    if not isinstance(v, bytes) or not 16 <= len(v) <= 64:
        raise ProtocolError(f"malformed transfer message: the {what} must be 16 to 64 bytes")
    return v
