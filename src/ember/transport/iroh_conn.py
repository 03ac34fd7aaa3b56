"""Framing over one iroh (QUIC) bidirectional stream.

Every frame is a 4-byte big-endian length followed by the payload; the first
frame of a stream is the header ``{"kind": ..., "version": 1}`` (MessagePack).
:class:`IrohConnection` implements :class:`~ember.transport.base.FrameConnection`:

* ``recv`` is cancel-safe: a reader task owns the stream and hands whole
  frames over a small queue (iroh's ``read_exact`` is not cancel-safe, and a
  cancelled FFI read loses its data), so ``asyncio.wait_for(conn.recv(), t)``
  never corrupts the stream;
* ``send`` is serialised by a lock; a send cancelled midway resets the stream
  (the peer sees a clean error, never a torn frame);
* a length prefix above ``max_frame`` fails the stream with
  :class:`FrameTooLarge` (a ``ConnectionError``) and stops it;
* ``send`` takes gathered frames (written part by part, no join) and
  ``set_data_sink`` places data-frame payloads straight into the caller's
  buffer (read in ``_BULK_READ`` pieces; see ``transport.base``);
* every step of ``close`` is bounded.
"""

from __future__ import annotations

import asyncio
import re
from contextlib import suppress
from typing import Any

import msgpack

from ember.errors import LimitExceeded

from ..protocol import codec
from ..protocol import messages as pm
from . import iroh_fastcopy
from .base import DataSink, Frame, frame_parts
from .iroh_endpoint import iroh_message

__all__ = ["STREAM_VERSION", "DEFAULT_MAX_FRAME", "HEADER_LIMIT", "KINDS", "FrameTooLarge",
           "IrohConnection", "describe_stream_error"]

STREAM_VERSION = 1
#: Largest frame accepted by default: 64 MiB of tensor chunk plus headroom.
DEFAULT_MAX_FRAME = 64 * 2**20 + 2**20
HEADER_LIMIT = 4096
KINDS = ("session", "transfer")
_READ_CHUNK = 64 * 1024
_BULK_READ = 1 << 20  # reads of a data-frame payload (64 KiB-1 MiB reads beat one huge read)
_WRITE_CHUNK = 4 * 2**20
_INLINE = 64 * 1024
_CLOSE_STEP = 1.0

# Application error codes used to reset / stop streams.
CODE_DONE, CODE_BAD_HEADER, CODE_BAD_VERSION, CODE_NO_HANDLER = 0, 1, 2, 3
CODE_TOO_LARGE, CODE_SHUTDOWN, CODE_ABORT = 4, 5, 6
_CODE_TEXT = {
    CODE_BAD_HEADER: "the peer rejected the stream header (not an Ember stream?)",
    CODE_BAD_VERSION: "the peer does not support this stream version",
    CODE_NO_HANDLER: "the peer does not serve this kind of stream",
    CODE_TOO_LARGE: "the peer refused a frame larger than its limit",
    CODE_SHUTDOWN: "the peer is shutting down",
    CODE_ABORT: "the peer aborted the stream",
}

class FrameTooLarge(ConnectionError):
    """A frame's length prefix exceeds the receiver's limit."""


_EOF = object()


def describe_stream_error(e: BaseException) -> str:
    """A readable reason for a stream/connection failure."""
    msg = iroh_message(e)
    m = re.fullmatch(r"(Reset|Stopped)\((\d+)\)", msg.strip())
    if m:
        text = _CODE_TEXT.get(int(m.group(2)), f"code {m.group(2)}")
        return f"stream {'reset' if m.group(1) == 'Reset' else 'stopped'} by peer: {text}"
    if "ConnectionLost" in msg or "ApplicationClosed" in msg or "TimedOut" in msg:
        r = re.search(r'reason: b"(.*?)"', msg)
        if "TimedOut" in msg:
            return "connection lost: the peer stopped answering (idle timeout)"
        return f"connection closed by peer{': ' + r.group(1) if r and r.group(1) else ''}"
    return msg


class IrohConnection:
    """One framed, bidirectional stream on a QUIC connection."""

    def __init__(self, stream: Any, conn: Any, *, peer_id: str, kind: str = "session",
                 max_frame: int = DEFAULT_MAX_FRAME, first_frame_limit: int | None = None,
                 queue_size: int = 8) -> None:
        self.peer_id: str | None = peer_id
        self.remote = f"iroh:{peer_id}"
        self.kind = kind
        self.max_frame = max_frame
        self._conn = conn
        self._send = stream.send()
        self._recv = stream.recv()
        self._first_limit = first_frame_limit
        self._q: asyncio.Queue = asyncio.Queue(maxsize=queue_size)
        self._reader: asyncio.Task | None = None
        self._send_lock = asyncio.Lock()
        self._closed = False
        self._broken: str | None = None
        self._violation: int | None = None  # reset code owed to the peer
        self._sink: DataSink | None = None

    def set_data_sink(self, sink: DataSink | None) -> None:
        """Read data-frame payloads into the buffers ``sink`` returns (see ``transport.base``)."""
        self._sink = sink

    @property
    def connection_id(self) -> int:
        """Stable id of the underlying QUIC connection (shared by sessions)."""
        return int(self._conn.stable_id())

    def _start(self) -> None:
        if self._reader is None and not self._closed:
            self._reader = asyncio.get_running_loop().create_task(self._read_loop())

    # -- receiving ---------------------------------------------------------
    async def _read_loop(self) -> None:
        buf = bytearray()
        limit = self._first_limit or self.max_frame
        try:
            while True:
                while len(buf) < 4:
                    chunk = await self._recv.read(_READ_CHUNK)
                    if not chunk:
                        if buf:
                            raise ConnectionError("stream ended in the middle of a frame")
                        await self._q.put(_EOF)
                        return
                    buf += chunk
                n = int.from_bytes(buf[:4], "big")
                if n > limit:
                    with suppress(Exception):
                        await asyncio.wait_for(self._recv.stop(CODE_TOO_LARGE), _CLOSE_STEP)
                    self._violation = CODE_TOO_LARGE
                    raise FrameTooLarge(f"incoming frame of {n} bytes exceeds the limit of {limit} bytes")
                limit = self.max_frame
                if self._sink is not None and n >= pm.INLINE_DATA:
                    if len(buf) < 5:
                        buf += await self._recv.read_exact(5 - len(buf))
                    if buf[4] == pm.DATA_MARK:
                        await self._q.put(await self._read_data(buf, n))
                        continue
                await self._q.put(await self._read_rest(buf, n))
        except asyncio.CancelledError:
            raise
        except ConnectionError as e:
            await self._q.put(e)
        except Exception as e:  # noqa: BLE001 - IrohError and friends
            await self._q.put(ConnectionError(describe_stream_error(e)))

    async def _read_rest(self, buf: bytearray, n: int) -> bytes:
        """The frame of ``n`` bytes whose start (after its length) is in ``buf``."""
        if len(buf) >= 4 + n:
            frame = bytes(buf[4:4 + n])
            del buf[:4 + n]
            return frame
        head = bytes(buf[4:])
        buf.clear()
        rest = await self._recv.read_exact(n - len(head))
        return head + rest if head else rest

    async def _read_data(self, buf: bytearray, n: int) -> bytes:
        """A data frame of ``n`` bytes whose start is in ``buf``: its payload goes where the sink says."""
        assert self._sink is not None
        while len(buf) < 4 + pm.DATA_PREFIX:
            buf += await self._recv.read_exact(4 + pm.DATA_PREFIX - len(buf))
        hn = pm.DATA_PREFIX + codec.data_head_size(buf[4:4 + pm.DATA_PREFIX])
        if hn > n:
            raise ConnectionError(f"data frame head of {hn} bytes in a frame of {n} bytes")
        if len(buf) < 4 + hn:
            buf += await self._recv.read_exact(4 + hn - len(buf))
        prefix = bytes(buf[4:4 + hn])
        left = n - hn
        dest = self._sink(memoryview(prefix)[pm.DATA_PREFIX:], left)
        if dest is None or dest.nbytes != left:
            return await self._read_rest(buf, n)
        got = min(left, len(buf) - 4 - hn)
        dest[:got] = buf[4 + hn:4 + hn + got]
        del buf[:4 + hn + got]
        read = self._recv.read
        while got < left:
            part = await read(min(left - got, _BULK_READ))
            if not part:
                raise ConnectionError("stream ended in the middle of a frame")
            k = len(part)
            dest[got:got + k] = part
            got += k
        return prefix

    async def recv(self) -> bytes | None:
        """Next frame, ``None`` at a clean end; ``ConnectionError`` if broken.

        Cancel-safe: a cancelled ``recv`` loses no data.
        """
        if self._closed:
            return None
        self._start()
        item = await self._q.get()
        if item is _EOF or isinstance(item, BaseException):
            self._q.put_nowait(item)  # every later recv sees the same end
            if item is _EOF:
                return None
            raise type(item)(str(item))
        return item

    # -- sending -----------------------------------------------------------
    async def send(self, frame: Frame) -> None:
        """Send one frame (or the parts of one). ``LimitExceeded`` above ``max_frame``."""
        if self._closed:
            raise ConnectionError("stream closed")
        if self._broken:
            raise ConnectionError(self._broken)
        parts: Any = [frame] if isinstance(frame, bytes) else frame_parts(frame)
        n = sum(len(p) for p in parts)
        if n > self.max_frame:
            raise LimitExceeded(f"frame of {n} bytes exceeds the limit of {self.max_frame} bytes")
        prefix = n.to_bytes(4, "big")
        async with self._send_lock:
            try:
                if n <= _INLINE:
                    await self._send.write_all(prefix + b"".join(parts))
                else:
                    fast = iroh_fastcopy.fast_copy_installed()
                    first = True
                    for p in parts:
                        if first and len(p) <= _INLINE:  # the prefix rides with a small first part
                            await self._send.write_all(prefix + bytes(p))
                            first = False
                            continue
                        if first:
                            await self._send.write_all(prefix)
                            first = False
                        for off in range(0, len(p), _WRITE_CHUNK):
                            piece = p[off:off + _WRITE_CHUNK]
                            await self._send.write_all(piece if fast else bytes(piece))
            except asyncio.CancelledError:
                self._broken = "a send was cancelled midway; the stream is no longer usable"
                with suppress(Exception):
                    await asyncio.wait_for(self._send.reset(CODE_ABORT), _CLOSE_STEP)
                raise
            except Exception as e:  # noqa: BLE001
                self._broken = describe_stream_error(e)
                raise ConnectionError(self._broken) from None

    async def _send_header(self, kind: str) -> None:
        await self.send(msgpack.packb({"kind": kind, "version": STREAM_VERSION}))

    # -- closing -----------------------------------------------------------
    async def close(self) -> None:
        """Finish our side and stop reading; bounded, idempotent."""
        if self._closed:
            return
        if self._violation is not None:  # the peer broke the protocol: say so
            await self.abort(self._violation)
            return
        self._closed = True
        try:
            await asyncio.wait_for(self._send_lock.acquire(), _CLOSE_STEP)
            try:
                await asyncio.wait_for(self._send.finish(), _CLOSE_STEP)
            finally:
                self._send_lock.release()
        except asyncio.CancelledError:
            raise
        except BaseException:  # noqa: BLE001 - lock busy or finish failed: reset
            with suppress(Exception):
                await asyncio.wait_for(self._send.reset(CODE_ABORT), _CLOSE_STEP)
        await self._stop_reading(CODE_DONE)

    async def abort(self, code: int = CODE_ABORT) -> None:
        """Reset both directions with ``code`` (protocol violations)."""
        if self._closed:
            return
        self._closed = True
        with suppress(Exception):
            await asyncio.wait_for(self._send.reset(code), _CLOSE_STEP)
        await self._stop_reading(code)

    async def _stop_reading(self, code: int) -> None:
        if self._reader is not None and not self._reader.done():
            self._reader.cancel()
            with suppress(BaseException):
                await asyncio.wait_for(self._reader, _CLOSE_STEP)
        with suppress(Exception):
            await asyncio.wait_for(self._recv.stop(code), _CLOSE_STEP)
        with suppress(asyncio.QueueFull):
            self._q.put_nowait(_EOF)  # wake a recv blocked on an empty queue

    def __repr__(self) -> str:
        return f"<IrohConnection {self.kind} peer={self.peer_id} closed={self._closed}>"


# ---------------------------------------------------------------------------
