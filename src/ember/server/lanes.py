"""Lanes on the server: a session's extra streams (feature ``"lanes"``, see ``protocol.lanes``)
and the extra streams of a download between peers.

A lane attaches to its session with the session's lane key (sent in Welcome) and, where the
transport authenticates peers (iroh), only from the session's own peer. A session lane carries
data frames only, both ways:

* **upload chunks**, read straight into the tensor's buffer (an :class:`Assembly`, charged to
  the session's budget when the first of its chunks arrives, whichever that is), each chunk
  exactly once (``Coverage``); the session stream's ``[UPLOAD, id, dtype, shape, 0, nil, total]``
  runs on the worker once every byte is in place (:meth:`SessionLanes.finish` waits for it,
  bounded by ``stall_timeout`` without progress), so the tensor exists before anything after it;
* **a read answer's chunks**, one stripe per lane side by side (:meth:`SessionLanes.send_read`),
  then the answer's OK on the session stream.

A lane frame is never larger than one chunk and its head (the lane's frame limit), so a hostile
lane costs at most that much memory; a chunk that is misaligned, outside its tensor, a duplicate,
of another shape than the first said, or a frame that is no upload chunk ends the session with
``ProtocolError``. A lane that breaks (or closes mid-upload) while its session lives ends it.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..errors import LimitExceeded, ProtocolError, SessionLost, TransferError
from ..protocol import codec
from ..protocol import messages as m
from ..protocol.codec import safe_repr
from ..protocol.lanes import MAX_LANES, STRIPE_MIN, Coverage, read_done, read_stripe, stripe_bounds
from ..transport.loop import all_or_nothing
from .execute.sizes import upload_fault

log = logging.getLogger("ember.server.lanes")

#: Uploads refused while their chunks were still arriving, remembered until their UPLOAD runs.
MAX_REFUSED = 64


class Assembly:
    """A striped upload being put together: its buffer and which chunks have arrived."""

    __slots__ = ("buf", "dtype", "shape", "total", "coverage", "arrived")

    def __init__(self, dtype: str, shape: list[int], total: int, chunk: int) -> None:
        self.buf = np.empty(total, np.uint8)
        self.dtype, self.shape, self.total = dtype, shape, total
        self.coverage = Coverage(total, chunk)
        self.arrived = 0


class StripedRead:
    """A read answer for the sender to stripe over the session's lanes (see ``Session.respond``)."""

    __slots__ = ("req", "dtype", "shape", "flat")

    def __init__(self, req: int, dtype: str, shape: list[int], flat: memoryview) -> None:
        self.req, self.dtype, self.shape, self.flat = req, dtype, shape, flat


class SessionLanes:
    """One session's lanes. The sink, :meth:`serve` and :meth:`send_read` run on the network loop;
    :meth:`finish` and :meth:`clear` on the session's worker."""

    def __init__(self, session: Any, fail: Callable[[Exception], None]) -> None:
        self.session = session
        self.fail = fail  # ends the session (on the loop) with this error
        self.key = os.urandom(32)
        self.chunk = int(session.server.limits["chunk"])
        self.conns: list[Any] = []
        self.assemblies: dict[int, Assembly] = {}
        self.refused: dict[int, Exception] = {}  # refused uploads whose UPLOAD has not run yet: why
        self.dropping: dict[int, int] = {}  # refused uploads: bytes of their chunks still to come
        self._placed: dict[tuple[int, int], int] = {}
        self._cond = threading.Condition()
        self.progress = time.monotonic()  # when a lane last delivered a chunk

    def welcome(self) -> dict[str, Any]:
        """What Welcome's ``lanes`` says: the attach key, how many lanes, from what size, the chunk."""
        return {"key": self.key, "max": MAX_LANES, "min_bytes": STRIPE_MIN, "chunk": self.chunk}

    def refusal(self, conn: Any, key: bytes) -> str | None:
        """Why ``conn`` may not attach as a lane (None: it may)."""
        if not hmac.compare_digest(key, self.key):
            return "wrong lane key for this session"
        if conn.peer_id != self.session.peer_id:
            return "a lane must come from the session's own peer"
        if len(self.conns) >= MAX_LANES:
            return f"this session already has {MAX_LANES} lanes"
        if not self.session.alive:
            return "the session has ended"
        return None

    # ---- receiving (the network loop) ---------------------------------------------------
    async def serve(self, conn: Any) -> None:
        """An attached lane: place the chunks it brings until it or the session ends."""
        s = self.session
        if hasattr(conn, "max_frame"):  # nothing on a lane is larger than a chunk and its head
            conn.max_frame = min(conn.max_frame, self.chunk + m.MAX_DATA_HEAD + m.DATA_PREFIX + 64)
        set_sink = getattr(conn, "set_data_sink", None)
        if set_sink is not None:
            set_sink(self.sink)
        self.conns.append(conn)
        try:
            await conn.send(codec.packb({"type": "lane"}))
            while s.alive:
                frame = await conn.recv()
                if frame is None:
                    if self.assemblies and s.alive:
                        self.fail(ProtocolError("a lane closed in the middle of an upload"))
                    return
                self._frame(frame)
        except ProtocolError as e:
            log.info("session %s: %s", s.label[:8], e.message)
            self.fail(e)
        except (ConnectionError, OSError) as e:
            if s.alive:
                self.fail(SessionLost(f"a lane of this session broke: {e}"))
        finally:
            if conn in self.conns:
                self.conns.remove(conn)

    def sink(self, head: memoryview, n: int) -> memoryview | None:
        """The lane's data sink: where an upload chunk goes (None: it arrives whole, and is refused)."""
        try:
            h = codec.decode_data_head(head)
        except ProtocolError:
            return None
        view = self._place(h, n)
        if view is not None:
            self._placed[(h[1], h[4])] = n
        return view

    def _place(self, h: list[Any], n: int) -> memoryview | None:
        """Where the ``n`` bytes of the upload chunk with head ``h`` go (None: refused, or of a
        refused upload); marks the chunk as arrived."""
        if not codec.is_upload_head(h) or type(h[1]) is not int:
            return None
        _, tid, dtype, shape, off, _, total = h
        a = self.assemblies.get(tid)
        if a is None:
            if tid in self.refused or tid in self.dropping:
                return None
            a = self._begin(tid, dtype, shape, total)
            if a is None:
                return None
        elif a.dtype != dtype or a.shape != shape or a.total != total:
            return None
        if not a.coverage.expect(off, n):
            return None
        return memoryview(a.buf)[off:off + n]

    def _begin(self, tid: int, dtype: Any, shape: Any, total: Any) -> Assembly | None:
        """The first chunk of an upload: its buffer, charged; or the refusal, kept for its UPLOAD."""
        interp = self.session.interp
        bad: Exception | None = upload_fault(interp.backend, dtype, shape, 0, b"", total,
                                             interp.limits["max_tensor"], 0)
        if bad is None:
            bad = interp.upload_slot_fault(len(self.assemblies))
        if bad is None:
            try:
                interp.mem.shared_reserve(total, f"upload of tensor {tid} ({tuple(shape)} {dtype})")
            except LimitExceeded as e:
                bad = e
        if bad is not None:
            if len(self.refused.keys() | self.dropping.keys()) >= MAX_REFUSED:
                self.fail(ProtocolError(f"more than {MAX_REFUSED} refused uploads whose Upload or chunks never came"))
            self.refused[tid] = bad
            if type(total) is int and total > 0:  # the rest of its chunks are dropped as they come
                self.dropping[tid] = total
            self._wake()
            return None
        a = self.assemblies[tid] = Assembly(dtype, shape, total, self.chunk)
        return a

    def _frame(self, frame: Any) -> None:
        """A frame from a lane: an upload chunk the sink placed (or one of a refused upload: dropped)."""
        s = self.session
        if not codec.is_data(frame):
            raise ProtocolError("a lane carries upload chunks (data frames) only")
        head, payload = codec.decode_data(frame)
        if not codec.is_upload_head(head):
            raise ProtocolError(f"a lane carries upload chunks only, got {safe_repr(head)}")
        tid, off = head[1], head[4]
        if len(payload):  # a transport without a data sink (WebSocket): the chunk came whole
            view = self._place(head, len(payload))
            n = None if view is None else len(payload)
            if view is not None:
                view[:] = payload
            s.bytes_in += len(frame)
        else:
            n = self._placed.pop((tid, off), None) if type(tid) is int and type(off) is int else None
            s.bytes_in += len(frame) + (n or 0)
        if n is None:
            if type(tid) is int and tid in self.dropping:
                left = self.dropping[tid] - max(1, len(payload))  # a chunk of an upload refused with a
                if left > 0:                                     # reason (its UPLOAD poisons the id)
                    self.dropping[tid] = left
                else:
                    del self.dropping[tid]
                return
            if type(tid) is int and tid in self.refused:
                return
            raise ProtocolError(f"a lane chunk of upload {safe_repr(tid)} at offset {safe_repr(off)} "
                                "is misaligned, outside the tensor or a duplicate")
        self.progress = time.monotonic()
        a = self.assemblies.get(tid)
        if a is not None:
            a.arrived += n
            if a.arrived == a.total:
                self._wake()

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    # ---- the UPLOAD on the session stream (the worker) --------------------------------------
    def finish(self, msg: list[Any], out: list[list[Any]]) -> None:
        """``[UPLOAD, id, dtype, shape, 0, nil, total]``: wait until every chunk arrived on the
        lanes, then store the tensor (or poison its id with the reason it was refused)."""
        interp = self.session.interp
        _, tid, dtype, shape, offset, _, total = msg
        if type(tid) is not int:
            raise ProtocolError(f"Upload of tensor id {safe_repr(tid)}: ids are ints")
        bad = upload_fault(interp.backend, dtype, shape, offset, b"", total, interp.limits["max_tensor"], 0)
        if bad is None and offset != 0:
            bad = ProtocolError(f"an Upload whose bytes come on lanes starts at offset 0, not {safe_repr(offset)}")
        a = None
        if bad is None:
            a, bad = self._wait(tid, dtype, shape, total)
        if bad is not None:
            self._drop(tid)
            interp._fail("upload", [], 0, [tid], bad)
            return
        if a is None:
            return  # the session is ending
        interp.mem.shared_release(a.total)  # the buffer becomes the tensor, charged as one
        interp.store_upload(tid, a.buf, dtype, shape)

    def _wait(self, tid: int, dtype: str, shape: list[int], total: int) -> tuple[Assembly | None, Exception | None]:
        s, stall = self.session, self.session.limits.stall_timeout
        if total == 0:
            return Assembly(dtype, shape, 0, self.chunk), None
        if threading.get_ident() == s._loop_thread:  # never blocks the loop (cheap() keeps it off)
            a = self.assemblies.get(tid)
            if a is None or a.arrived != a.total:
                return None, ProtocolError("an Upload whose bytes come on lanes cannot run inline")
        start = time.monotonic()
        with self._cond:
            while True:
                r = self.refused.pop(tid, None)
                if r is not None:
                    return None, r
                a = self.assemblies.get(tid)
                if a is not None:
                    if a.dtype != dtype or a.shape != shape or a.total != total:
                        return None, ProtocolError(f"upload {tid}: its chunks on the lanes declared "
                                                   f"{tuple(a.shape)} {a.dtype}, its Upload {tuple(shape)} {dtype}")
                    if a.arrived == a.total:
                        del self.assemblies[tid]
                        return a, None
                if not s.alive:
                    return None, None
                if time.monotonic() - max(start, self.progress) > stall:
                    err = ProtocolError(f"upload {tid}: no chunk arrived on the lanes for {stall:g} s")
                    s.interp._fatal(err)
                    return None, err
                self._cond.wait(0.25)

    def _drop(self, tid: int) -> None:
        a = self.assemblies.pop(tid, None)
        self.refused.pop(tid, None)  # (its chunks still to come are dropped: ``dropping`` keeps them)
        if a is not None:
            self.session.interp.mem.shared_release(a.total)

    def clear(self) -> None:
        """The session's end (its worker): return what the assemblies hold."""
        for tid in list(self.assemblies):
            self._drop(tid)
        self.refused.clear()
        self.dropping.clear()

    def stop(self) -> None:
        """The session is ending: wake a worker waiting for chunks."""
        self._wake()

    async def close(self) -> None:
        for conn in list(self.conns):
            try:
                await asyncio.wait_for(conn.close(), 2.0)
            except Exception:  # noqa: BLE001
                pass
        self.conns.clear()

    # ---- sending a read answer (the network loop) -------------------------------------------
    def stripes_for(self, total: int) -> bool:
        """Should a read answer of ``total`` bytes go out over the lanes?"""
        return total >= STRIPE_MIN and bool(self.conns)

    async def send_read(self, job: StripedRead) -> None:
        """A read answer's chunks, one stripe per lane side by side, then its OK on the session stream."""
        s, flat, chunk = self.session, job.flat, self.chunk
        total = len(flat)
        conns = list(self.conns)
        if not conns:  # the lanes went away meanwhile: the session stream carries it all
            await s.send_frames(s.conn, codec.read_frames(job.req, job.dtype, job.shape, flat, chunk))
            return
        await all_or_nothing(s.send_frames(c, read_stripe(job.req, flat, lo, hi, chunk))
                             for c, (lo, hi) in zip(conns, stripe_bounds(total, chunk, len(conns))))
        done = read_done(job.req, job.dtype, job.shape, total)
        s.bytes_out += len(done)
        await s.conn.send(done)


# ---- downloads between peers: the source's side -------------------------------------------------

@dataclass(eq=False)
class Offer:
    """A download striped over ``len(bounds)`` streams: stripes 1.. wait for their lanes."""

    flat: memoryview
    peer_id: str | None
    bounds: list[tuple[int, int]]
    chunk: int
    expires: float
    taken: set[int] = field(default_factory=set)
    left: int = 0
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def finished_one(self) -> None:
        self.left -= 1
        if self.left <= 0:
            self.done.set()


class TransferLanes:
    """A source's striped downloads waiting for their extra transfer streams (on the network loop)."""

    MAX_OFFERS = 64
    TTL = 30.0

    def __init__(self) -> None:
        self.offers: dict[bytes, Offer] = {}
        self.striped = 0  # downloads offered over several streams
        self.served = 0  # extra transfer streams that got their stripe

    def offer(self, flat: memoryview, peer_id: str | None, lanes: int, chunk: int) -> tuple[bytes, Offer] | None:
        """Stripe a download over ``lanes`` streams (None: one stream will do, or too many wait)."""
        now = time.monotonic()
        for k in [k for k, o in self.offers.items() if o.expires < now]:
            self.offers.pop(k).done.set()
        bounds = stripe_bounds(len(flat), chunk, lanes)
        if len(bounds) < 2 or len(self.offers) >= self.MAX_OFFERS:
            return None
        key = os.urandom(32)
        o = self.offers[key] = Offer(flat, peer_id, bounds, chunk, now + self.TTL, left=len(bounds) - 1)
        self.striped += 1
        return key, o

    def take(self, key: bytes, index: int, peer_id: str | None) -> Offer:
        o = self.offers.get(key)
        if o is None or time.monotonic() > o.expires:
            raise TransferError("unknown or expired transfer lane key")
        if o.peer_id != peer_id:
            raise TransferError("a transfer lane must come from the downloading peer")
        if index >= len(o.bounds) or index in o.taken:
            raise TransferError(f"no stripe {index} to take in this download")
        o.taken.add(index)
        return o

    def withdraw(self, key: bytes) -> None:
        self.offers.pop(key, None)


async def serve_transfer_lane(lanes: TransferLanes, conn: Any, key: bytes, index: int) -> None:
    """An extra transfer stream: send stripe ``index`` of the download ``key`` names."""
    try:
        o = lanes.take(key, index, conn.peer_id)
    except TransferError as e:
        await conn.send(codec.packb({"type": "denied", "reason": e.message}))
        return
    try:
        await conn.send(codec.packb({"type": "ok"}))
        lo, hi = o.bounds[index]
        for parts in codec.chunk_frames(o.flat, o.chunk, lo, hi):
            await conn.send(parts)
        lanes.served += 1
    finally:
        o.finished_one()


__all__ = ["SessionLanes", "StripedRead", "Assembly", "TransferLanes", "Offer", "serve_transfer_lane", "MAX_REFUSED"]
