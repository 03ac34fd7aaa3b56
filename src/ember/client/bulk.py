"""Bulk data for a ClientSession: large uploads and reads in data frames, waits with progress.

A large upload is one ``Upload`` job for the session's sender: data frames whose payloads
are views of the caller's array (``protocol.codec.upload_frames``). The caller's thread
waits until the last frame has left (backpressure instead of a queue of copies), so the
client holds the array once, however large. A large read arrives in data frames; where
the transport has a data sink (``transport.base``), each payload is read straight into
the array being assembled, else it is copied there from the frame.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from ..errors import EmberError, LimitExceeded, ProtocolError
from ..protocol import codec
from ..protocol import messages as m
from ..transport.base import receive_buffer
from .lanes import StripedUpload


class ReadTimeout(EmberError, TimeoutError):
    """A read or sync did not complete within its deadline."""


class Waiter:
    """One outstanding request: completed on the I/O loop, awaited on a user thread.

    A pre-acquired lock is the cheapest one-shot signal between two threads
    (one futex, no Condition), which matters on the op + read round trip.
    """

    __slots__ = ("_lock", "value", "error", "buf", "done")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self.value: Any = None
        self.error: BaseException | None = None
        self.buf: Any = None  # a large read's bytes, assembled as they arrive
        self.done = 0         # bytes of it (or of an upload) so far, for progress

    def set(self) -> None:
        try:
            self._lock.release()
        except RuntimeError:  # already set (a loss racing an answer)
            pass

    def wait(self, timeout: float) -> bool:
        return self._lock.acquire(timeout=timeout)


class Upload:
    """A large upload for the sender: data frames over views of the caller's array, sent in order;
    the caller waits (``waiter``) until the last one has left, so its array is never copied."""

    __slots__ = ("frames", "waiter")

    def __init__(self, frames: Any, waiter: Waiter) -> None:
        self.frames, self.waiter = frames, waiter


_DTYPE_NAMES: dict[np.dtype, str] = {}


class BulkData:
    """The bulk-data half of ``ClientSession``, which supplies the attributes declared here and
    ``record``, ``_flush_locked`` and ``_lost_error``."""

    data: bool
    chunk: int
    max_tensor: Any       # the peer's limits from Welcome (None: not announced)
    session_memory: Any
    read_timeout: float
    address: str
    lost: EmberError | None
    stats: dict[str, int]
    conn: Any
    loop: Any
    ids: Any
    _waiters: dict[int, Waiter]
    _frames: Any
    _lock: threading.Lock
    _last_recv: float
    _wake: Any
    _placed: dict[tuple[int, int], int]  # (request, offset) -> bytes the sink placed, not yet counted
    _striping: Any  # (client/lanes.py)

    def _check_upload(self, arr: np.ndarray) -> None:
        """Refuse here what the peer announced it would refuse (nothing is sent)."""
        for limit, name in ((self.max_tensor, "max_tensor"), (self.session_memory, "session memory budget")):
            if isinstance(limit, int) and arr.nbytes > limit:
                raise LimitExceeded(
                    f"uploading {arr.shape} {arr.dtype} ({arr.nbytes} bytes) to {self.address}: over the peer's "
                    f"{name} of {limit} bytes (announced when the session opened); nothing was sent",
                    hint="send it in pieces, or ask the peer's operator to raise the limit")

    def upload(self, arr: np.ndarray, progress: Any = None) -> int:
        """Send host data; returns the new tensor id.

        Small arrays ride in the next batch. Larger ones go in data frames over views of the
        array: this thread waits until the last byte has left (backpressure; the array is never
        copied, so it must not change meanwhile), ``progress`` (``client.progress``) showing it.
        A peer that speaks no data frames gets MessagePack chunks, as before."""
        arr = np.asarray(arr, order="C")
        self._check_upload(arr)
        tid = next(self.ids)
        flat = memoryview(arr.reshape(-1).view(np.uint8))
        dt = _DTYPE_NAMES.get(arr.dtype)
        if dt is None:  # (numpy makes a dtype's name in Python, ~2 us: kept per dtype)
            dt = _DTYPE_NAMES[arr.dtype] = arr.dtype.name
        total, shape = len(flat), list(arr.shape)
        if total <= m.INLINE_DATA:
            self.record([m.UPLOAD, tid, dt, shape, 0, bytes(flat), total])
            return tid
        if self.lost is not None:
            raise self._lost_error()
        if not self.data:
            with self._lock:
                self._flush_locked()
                for off in range(0, total, self.chunk):
                    frame = codec.packb([[m.UPLOAD, tid, dt, shape, off, flat[off:off + self.chunk], total]])
                    self.stats["bytes_sent"] += len(frame)
                    self._frames.append(frame)
            self.loop.call_soon_threadsafe(self._wake.set)
            return tid
        w = Waiter()
        key = -tid  # a waiter (so a lost session wakes it) no answer will ever name
        self._waiters[key] = w
        job: Any = StripedUpload(tid, dt, shape, flat, w) if self._striping(total) else \
            Upload(codec.upload_frames(tid, dt, shape, flat, self.chunk), w)
        with self._lock:
            self._flush_locked()
            self._frames.append(job)
            self.stats["bytes_sent"] += total
        self.loop.call_soon_threadsafe(self._wake.set)
        try:
            self._wait(w, total, progress, f"upload {size_text(total)}", self.read_timeout)
        finally:
            self._waiters.pop(key, None)
        return tid

    def _wait(self, w: Waiter, total: int, progress: Any, what: str, timeout: float) -> None:
        """Wait for ``w``; ``timeout`` bounds a stretch without progress. ``progress`` shows the bytes."""
        bar = progress.bar(total, what) if progress is not None else None
        try:
            last, t_last = -1, time.monotonic()
            while not w.wait(0.1 if bar is not None else min(timeout, 1.0)):
                done = w.done
                if bar is not None:
                    bar.update_to(done)
                now = time.monotonic()
                if done != last:
                    last, t_last = done, now
                elif now - t_last > timeout:
                    raise ReadTimeout(f"{what}: no progress with {self.address} for {timeout:g} s",
                                      hint="a long computation? pass a larger read_timeout to ember.connect")
                if self.lost is not None and w.error is None:
                    raise self._lost_error()
            if bar is not None and w.error is None:
                bar.update_to(total)
        finally:
            if bar is not None:
                bar.close()
        if w.error is not None:
            raise w.error

    async def _send_upload(self, job: Upload) -> None:
        """Send an upload's data frames; its caller waits until the last one has left."""
        await self._send_frames(self.conn, job.frames, job.waiter)
        job.waiter.set()

    async def _send_frames(self, conn: Any, frames: Any, w: Waiter) -> None:
        """Upload data frames on ``conn`` (the session stream or a lane), counted into ``w``."""
        for parts in frames:
            await conn.send(parts)
            w.done += len(parts[1])
            self._last_recv = time.monotonic()  # a sent chunk is a sign of life (see ClientSession._sender)

    # ---- receiving -----------------------------------------------------------------------
    def _sink(self, head: memoryview, n: int) -> Any:
        """The transport's data sink: a read's chunk goes straight into the array it answers."""
        try:
            req, status, p = codec.decode_data_head(head)
            off, total = p[-3], p[-1]
        except (ProtocolError, ValueError, TypeError, IndexError):
            return None
        if type(req) is not int or type(off) is not int or type(total) is not int or not 0 <= off <= total - n:
            return None
        w = self._waiters.get(req)
        if w is None:
            return None
        if w.buf is None:
            try:
                w.buf = receive_buffer(total)
            except MemoryError:
                return None  # the chunk comes in its frame: ``_data_frame`` fails the read with the reason
        elif len(w.buf) != total:
            return None
        self._placed[(req, off)] = n  # counted once the bytes are in (``_data_frame``)
        return memoryview(w.buf)[off:off + n]

    def _data_frame(self, frame: Any) -> None:
        """A chunk of a large read in a data frame (its payload placed by ``_sink``, or in the frame),
        from the session stream or a lane. The read is complete once its OK has come (on the
        session stream, after the lanes' chunks were sent) and all its bytes are in."""
        (req, status, p), payload = codec.decode_data(frame)
        w = self._waiters.get(req)
        if w is None:
            return
        if status not in (m.CHUNK, m.OK):
            del self._waiters[req]
            w.error = ProtocolError(f"unexpected status {status} in a data frame")
            w.set()
            return
        off, total = p[-3], p[-1]
        if type(off) is not int or type(total) is not int or total < 0:
            raise ProtocolError(f"malformed data frame head from {self.address}: {str(p)[:80]}")
        if w.buf is None:
            try:
                w.buf = receive_buffer(total)
            except MemoryError as e:  # larger than this machine can hold: the read fails, the session lives
                del self._waiters[req]
                w.error = e
                w.set()
                return
        if len(payload):
            if len(w.buf) != total or not 0 <= off <= total - len(payload):
                raise ProtocolError(f"a chunk from {self.address} lies outside the array it answers")
            w.buf[off:off + len(payload)] = np.frombuffer(payload, np.uint8)
            w.done += len(payload)
        else:  # the transport placed the payload: count its bytes as received here
            placed = self._placed.pop((req, off), 0)
            w.done += placed
            self.stats["bytes_received"] += placed
        if status == m.OK:
            w.value = p
        if w.value is None or w.done < total:
            return  # (chunks on the lanes may still be arriving)
        del self._waiters[req]
        p = w.value
        p[-2] = w.buf
        w.set()


def size_text(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


