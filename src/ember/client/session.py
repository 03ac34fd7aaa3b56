"""ClientSession: batching, client-allocated ids, reads, drops, heartbeat.

Recording an op appends one short list to ``_pending`` under a lock; nothing
is sent until a value is needed (read, sync), the batch passes ``max_batch``
messages, or the idle timer fires (``idle_flush`` seconds after the first op of
a batch) so work starts while user code keeps going. Frames are encoded on the
recording thread and queued in order for the I/O loop's sender.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import weakref
from collections import deque
from typing import Any

import numpy as np

from .. import __version__
from ..errors import (AuthorizationError, ConnectError, EmberError, ProtocolError, SessionLost,
                      from_wire)
from ..protocol import codec
from ..protocol import messages as m
from ..transport.base import FrameConnection

_sessions: "weakref.WeakSet[ClientSession]" = weakref.WeakSet()


class ReadTimeout(EmberError, TimeoutError):
    """A read or sync did not complete within its deadline."""


class _Waiter:
    """One outstanding request: completed on the I/O loop, awaited on a user thread."""

    __slots__ = ("event", "value", "error", "buf")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None
        self.buf: bytearray | None = None


class ClientSession:
    """One session with one device of one peer."""

    def __init__(self, conn: FrameConnection, welcome: dict[str, Any], loop: asyncio.AbstractEventLoop, *,
                 address: str, device: int, read_timeout: float = 300.0, idle_flush: float = 0.002,
                 max_batch: int = 4096, heartbeat_interval: float = 1.0, heartbeat_timeout: float = 5.0) -> None:
        self.conn = conn
        self.welcome = welcome
        self.loop = loop
        self.address = address
        self.device = device
        self.read_timeout = read_timeout
        self.idle_flush = idle_flush
        self.max_batch = max_batch
        self.hb_interval, self.hb_timeout = heartbeat_interval, heartbeat_timeout
        limits = welcome.get("limits", {})
        self.max_frame = int(limits.get("max_frame", m.DEFAULT_MAX_FRAME))
        self.chunk = int(limits.get("chunk", m.DEFAULT_CHUNK))
        self.ids = itertools.count(1)
        self._reqs = itertools.count(1)
        self._lock = threading.Lock()
        self._pending: list[list[Any]] = []
        self._drops: deque[int] = deque()
        self._frames: deque[bytes] = deque()
        self._waiters: dict[int, _Waiter] = {}
        self._timer_armed = False
        self.lost: EmberError | None = None
        self.stats = {"ops": 0, "batches": 0, "bytes_sent": 0, "bytes_received": 0, "reads": 0}
        self._wake = asyncio.Event()
        self._last_recv = time.monotonic()
        self._tasks = [loop.create_task(self._receiver()), loop.create_task(self._sender()),
                       loop.create_task(self._heartbeat())]
        _sessions.add(self)

    # ---- recording (user threads) -----------------------------------------------------
    def record(self, msg: list[Any]) -> None:
        """Queue one message; flush when the batch is full, arm the idle timer when it starts."""
        if self.lost is not None:
            raise self._lost_error()
        with self._lock:
            p = self._pending
            p.append(msg)
            n = len(p)
            if n >= self.max_batch:
                self._flush_locked()
            elif n == 1 and not self._timer_armed:
                self._timer_armed = True
                self.loop.call_soon_threadsafe(self._arm_timer)

    def release(self, tid: int) -> None:
        """The user dropped an array: free it on the peer with the next batch (called from __del__)."""
        self._drops.append(tid)

    def flush(self) -> None:
        with self._lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        p = self._pending
        drops = self._drops
        if drops:
            ids = []
            while drops:
                ids.append(drops.popleft())
            p.append([m.DROP, ids])
        if not p:
            return
        frame = codec.packb(p)
        self.stats["ops"] += len(p)
        self.stats["batches"] += 1
        self.stats["bytes_sent"] += len(frame)
        self._pending = []
        self._frames.append(frame)
        self.loop.call_soon_threadsafe(self._wake.set)

    def send_alone(self, msg: list[Any]) -> None:
        """Send ``msg`` as a batch of its own, after everything recorded so far."""
        if self.lost is not None:
            raise self._lost_error()
        with self._lock:
            self._flush_locked()
            self._pending.append(msg)
            self._flush_locked()

    # ---- data in / out -----------------------------------------------------------------
    def upload(self, arr: np.ndarray) -> int:
        """Send host data; returns the new tensor id. Large arrays go in chunks."""
        arr = np.asarray(arr, order="C")
        tid = next(self.ids)
        flat = memoryview(arr.reshape(-1).view(np.uint8))
        total, dt, shape = len(flat), arr.dtype.name, list(arr.shape)
        if total <= 65536:
            self.record([m.UPLOAD, tid, dt, shape, 0, bytes(flat), total])
            return tid
        if self.lost is not None:
            raise self._lost_error()
        with self._lock:
            self._flush_locked()
            for off in range(0, total, self.chunk) if total else [0]:
                frame = codec.packb([[m.UPLOAD, tid, dt, shape, off, flat[off:off + self.chunk], total]])
                self.stats["bytes_sent"] += len(frame)
                self._frames.append(frame)
        self.loop.call_soon_threadsafe(self._wake.set)
        return tid

    def request(self, kind: int, *fields: Any, timeout: float | None = None) -> Any:
        """Send a request (READ, SYNC, SHAPE, ...) and wait for its answer."""
        if self.lost is not None:
            raise self._lost_error()
        req = next(self._reqs)
        w = _Waiter()
        self._waiters[req] = w
        with self._lock:
            self._pending.append([kind, req, *fields])
            self._flush_locked()
        t = self.read_timeout if timeout is None else timeout
        if not w.event.wait(t):
            self._waiters.pop(req, None)
            if self.lost is not None:
                raise self._lost_error()
            raise ReadTimeout(f"no answer from {self.address} within {t:g} s",
                              hint="a long computation? pass a larger read_timeout to ember.connect")
        if w.error is not None:
            raise w.error
        return w.value

    def read(self, tid: int, timeout: float | None = None) -> np.ndarray:
        dt, shape, off, data, total = self.request(m.READ, tid, timeout=timeout)
        self.stats["reads"] += 1
        return np.frombuffer(data, dtype=np.dtype(dt)).reshape(shape)

    def sync(self, timeout: float | None = None) -> None:
        self.request(m.SYNC, timeout=timeout)

    def close(self) -> None:
        if self.lost is not None:
            return
        try:
            with self._lock:
                self._pending.append([m.CLOSE])
                self._flush_locked()
        except RuntimeError:  # loop already gone (interpreter exit)
            pass
        self._fail_all(SessionLost("session closed by this client"))

    # ---- I/O loop side -----------------------------------------------------------------
    def _arm_timer(self) -> None:
        self.loop.call_later(self.idle_flush, self._idle_flush)

    def _idle_flush(self) -> None:
        with self._lock:
            self._timer_armed = False
            if self._pending or self._drops:
                self._flush_locked()

    async def _sender(self) -> None:
        frames, wake, conn = self._frames, self._wake, self.conn
        try:
            while self.lost is None or frames:
                await wake.wait()
                wake.clear()
                while frames:
                    await conn.send(frames.popleft())
                if self.lost is not None:
                    break
        except (ConnectionError, OSError) as e:
            self._fail_all(SessionLost(f"connection to {self.address} broke while sending: {e}"))
        except asyncio.CancelledError:
            pass
        finally:
            if self.lost is not None:
                try:
                    await asyncio.wait_for(conn.close(), 2.0)
                except Exception:
                    pass
                for t in self._tasks[0], self._tasks[2]:  # receiver, heartbeat
                    t.cancel()

    async def _receiver(self) -> None:
        conn, waiters = self.conn, self._waiters
        try:
            while True:
                frame = await conn.recv()
                if frame is None:
                    raise SessionLost(f"peer {self.address} closed the session")
                self._last_recv = time.monotonic()
                self.stats["bytes_received"] += len(frame)
                for req, status, payload in codec.decode_responses(frame, self.max_frame + 4096):
                    if req == 0 and status == m.ERROR:
                        raise from_wire(payload)
                    w = waiters.get(req)
                    if w is None:
                        continue  # a heartbeat answer, or a request that timed out
                    if status == m.CHUNK:
                        off, data, total = payload
                        if w.buf is None:
                            w.buf = bytearray(total)
                        w.buf[off:off + len(data)] = data
                        continue
                    del waiters[req]
                    if status == m.OK:
                        if w.buf is not None:
                            off, data = payload[2], payload[3]
                            w.buf[off:off + len(data)] = data
                            payload[3] = w.buf
                        w.value = payload
                    else:
                        w.error = from_wire(payload)
                    w.event.set()
        except asyncio.CancelledError:
            pass
        except EmberError as e:
            self._fail_all(e if isinstance(e, (SessionLost, ProtocolError)) else SessionLost(e.message))
        except (ConnectionError, OSError) as e:
            self._fail_all(SessionLost(f"connection to {self.address} lost: {e}"))

    async def _heartbeat(self) -> None:
        try:
            while self.lost is None:
                await asyncio.sleep(self.hb_interval)
                if not self._waiters:
                    self._last_recv = time.monotonic()
                    continue
                silent = time.monotonic() - self._last_recv
                if silent > self.hb_timeout:
                    self._fail_all(SessionLost(
                        f"peer {self.address} did not answer for {silent:.1f} s; it is gone or unreachable",
                        hint="check the peer process; new work on this device reconnects"))
                    return
                with self._lock:
                    self._frames.append(codec.packb([[m.PING, 0]]))
                self._wake.set()
        except asyncio.CancelledError:
            pass

    def _fail_all(self, err: EmberError) -> None:
        if self.lost is None:
            self.lost = err
        for req in list(self._waiters):
            w = self._waiters.pop(req, None)
            if w is not None:
                w.error = err
                w.event.set()
        try:
            self.loop.call_soon_threadsafe(self._wake.set)
        except RuntimeError:
            pass

    def _lost_error(self) -> EmberError:
        e = self.lost
        assert e is not None
        if isinstance(e, SessionLost):
            return SessionLost(f"this array's session with {self.address} has ended: {e.message}",
                               hint="arrays do not survive their session; new work on the device reconnects")
        return e


# ---- opening a session ------------------------------------------------------------------

async def open_session(conn: FrameConnection, *, address: str, device: int, credential: bytes,
                       timeout: float, session_id: bytes) -> dict[str, Any]:
    """Handshake on an open connection: send Hello, judge the reply, return the Welcome."""
    await conn.send(codec.encode_hello(session_id=session_id, device=device, credential=credential,
                                       client_version=__version__))
    try:
        frame = await asyncio.wait_for(conn.recv(), timeout)
    except asyncio.TimeoutError:
        await conn.close()
        raise ConnectError(f"{address} accepted the connection but did not answer Hello within {timeout:g} s",
                           hint="is it an Ember peer? `ember doctor` checks a peer") from None
    if frame is None:
        raise ConnectError(f"{address} closed the connection during the handshake")
    reply = codec.decode_reply(frame)
    if reply["type"] == "welcome":
        if reply.get("protocol") != m.PROTOCOL_VERSION:
            raise ProtocolError(f"protocol version mismatch: this client speaks version {m.PROTOCOL_VERSION}, "
                                f"the peer speaks version {reply.get('protocol')}")
        return reply
    await conn.close()
    code, reason = reply.get("code"), str(reply.get("reason", ""))
    if code == m.REJECT_UNAUTHORIZED:
        raise AuthorizationError(reason, hint="pass the peer's credential: ember.connect(address, credential=b'...')")
    if code in (m.REJECT_VERSION, m.REJECT_PROTOCOL):
        raise ProtocolError(reason, hint="install the same ember version on both sides")
    if code == m.REJECT_DEVICE:
        raise ConnectError(reason, hint="ember.devices(address) lists the peer's devices")
    raise ConnectError(f"{address} refused the session: {reason}")


def close_all() -> None:
    for s in list(_sessions):
        try:
            s.close()
        except Exception:
            pass
