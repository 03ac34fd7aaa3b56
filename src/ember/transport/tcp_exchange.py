"""The calm-link exchange of a client's TCP connection: one round trip on the caller's thread.

A ``TcpConnection``'s frames are read by a task on the I/O loop. For a blocking round trip
(``client/exchange.py``) the hops user thread -> loop -> user thread cost several times the
wire's own round trip on loopback, so while the link is *calm* the caller writes its request
frame on the socket itself and reads the answer itself:

* the loop's reader is **parked** (``park``, on the loop, when nothing awaits an answer): the
  read task sits at a frame boundary with nothing staged and no reader registered on the
  socket, so the loop is not woken by the answer and never races the caller for its bytes;
* a caller takes the **gate** (a lock, never waited for) only while the reader is parked, idle
  and nothing is queued; it reads frames into the connection's own staging buffer with a
  deadline on every wait, hands each frame to ``on_frame`` and stops once ``done()``;
* it hands the connection **back to the loop** (``unpark``) when the answer is slow
  (``PATIENCE``), when a frame is large (data frames of a bulk read, read by the loop into their
  buffers), or when the loop asked for its reader meanwhile (a request on the ordinary path, a
  heartbeat): whatever it staged stays staged, and the read task goes on from there.

While parked, the loop still hears the peer hang up: the socket sits in an epoll set of its own,
watched for ``EPOLLRDHUP``/``EPOLLHUP`` only (the loop watches that set's descriptor), so an
answer does not wake the loop but a peer that closes or dies does, and the session learns of it at
once (Linux; elsewhere at its next round trip or heartbeat).

Errors: a closed or broken socket raises ``ConnectionError`` (the session ends with
``SessionLost``); a write that cannot finish within its deadline breaks the connection.
"""

from __future__ import annotations

import asyncio
import select
import socket
import struct
import threading
import time
from typing import Any, Callable

try:
    import fcntl
    import termios
except ImportError:  # pragma: no cover - not POSIX: large frames are always the loop's to write
    fcntl = termios = None  # type: ignore[assignment]

from . import spin

#: How long a caller waits for its answer on its own before it hands the connection to the loop.
PATIENCE = 0.05
#: The longest a caller's write may take (a calm socket takes a small frame at once).
WRITE_TIMEOUT = 5.0
#: Up to this size a caller writes a frame without the loop (``CalmLink.writable``) when the socket is
#: writable (TCP reports room only when a third of its buffer is free): such a frame leaves in one ``send``.
SMALL_WRITE = 16 << 10
#: Up to this size (a step's batch with its inputs' uploads, say), only when the socket's send queue has
#: room for twice the frame now (``SIOCOUTQ`` against ``SO_SNDBUF``): it too leaves in one ``send``, at once.
LARGE_WRITE = 256 << 10


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class CalmLink:
    """Parks a client connection's reader when the link is calm and lends it to a caller's thread."""

    def __init__(self, conn: Any, sock: socket.socket, small: int) -> None:
        self.conn, self.sock, self.fd = conn, sock, sock.fileno()
        self.small = small  # frames from this size are the loop's (read into their own buffers)
        self.loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self.gate = threading.Lock()
        self.parked = False
        self.unpark_wanted = False
        self.idle_now = False   # the read task waits in ``idle`` (a frame boundary, nothing staged)
        self._fut: asyncio.Future | None = None
        self._reading = False   # a reader is registered for ``_fut``
        self.exchanges = self.handbacks = 0
        self.backoff = spin.Backoff()  # (does polling hot for an answer pay on this link? transport/spin.py)
        self._polls: dict[int, Any] = {}
        #: Set by the connection's user: does anything await an answer the loop must read? (``settle``)
        self.awaited: Callable[[], bool] | None = None
        self._hup: Any = None  # an epoll set holding the socket for hang-ups only (see the docstring)
        self._hup_watched = False
        try:
            ep = select.epoll()
            ep.register(self.fd, select.EPOLLRDHUP | select.EPOLLHUP | select.EPOLLERR)
            self._hup = ep
        except (AttributeError, OSError):  # not Linux
            pass

    # ---- the loop's side ------------------------------------------------------------------
    def on_loop(self) -> bool:
        """Is this the loop's thread?"""
        return threading.get_ident() == self._loop_thread

    async def idle(self) -> None:
        """On the read task, at a frame boundary with nothing staged: return once the socket is
        readable and the reader is not parked."""
        self.idle_now = True
        try:
            while True:
                fut = self._fut = self.loop.create_future()
                if not self.parked:
                    self.loop.add_reader(self.fd, _wake, fut)
                    self._reading = True
                try:
                    await fut
                finally:
                    if self._reading:
                        self.loop.remove_reader(self.fd)
                        self._reading = False
                    self._fut = None
                if not self.parked:
                    return
        finally:
            self.idle_now = False

    def park(self) -> None:
        """On the loop: nothing awaits an answer; stop reading until a caller or ``unpark``."""
        if self.parked or not self.gate.acquire(False):
            return  # (a held gate means parked already)
        try:
            if self.unpark_wanted:
                return
            self.parked = True
        finally:
            self.gate.release()
        # the registrations change outside the gate (system calls, the GIL let go: a caller must not
        # find the gate held then); a reader left for a moment only wakes the read task, which reads
        # nothing while parked
        if self._reading:
            self.loop.remove_reader(self.fd)
            self._reading = False
        if self._hup is not None and not self._hup_watched:
            self.loop.add_reader(self._hup.fileno(), self._hung_up)
            self._hup_watched = True

    def settle(self) -> None:
        """On the loop, after a caller asked for the reader (a hand-back, or the loop wanted it while
        the caller held the gate): read again, unless nothing is awaited any more (the caller read the
        heartbeat's answer itself, say): then the link stays parked."""
        awaited = self.awaited
        if awaited is not None and self.parked and not self.conn._closed and not awaited():
            if self.gate.acquire(False):
                self.unpark_wanted = False
                self.gate.release()
                return
        self.unpark()

    def _hung_up(self) -> None:
        """On the loop, while parked: the peer closed or broke the connection; read what is left."""
        self._unwatch_hup()
        self.unpark()

    def _unwatch_hup(self) -> None:
        if self._hup_watched:
            self._hup_watched = False
            self.loop.remove_reader(self._hup.fileno())

    def close(self) -> None:
        """On the loop, when the connection closes: read to the end, let go of the hang-up watch."""
        self.unpark()
        self._unwatch_hup()
        if self._hup is not None:
            self._hup.close()
            self._hup = None

    def unpark(self) -> None:
        """On the loop: read again (an answer is awaited the ordinary way, or the link closes).
        While a caller holds the gate, it hands back when done."""
        self.unpark_wanted = True
        if not self.gate.acquire(False):
            return
        try:
            self.unpark_wanted = False
            if not self.parked:
                return
            self.parked = False
            self._unwatch_hup()
            fut = self._fut
            if fut is not None and not fut.done() and not self._reading:
                c = self.conn
                if c._start != c._end:  # a caller left bytes staged: go on from there
                    fut.set_result(None)
                else:
                    self.loop.add_reader(self.fd, _wake, fut)
                    self._reading = True
        finally:
            self.gate.release()

    # ---- the caller's side (any thread but the loop's) ---------------------------------------
    def begin(self) -> bool:
        """Take the connection for one exchange: True when calm (then ``write`` and ``finish``)."""
        if not self.parked or self.unpark_wanted or not self.gate.acquire(False):
            return False
        c = self.conn
        if self.parked and self.idle_now and not self.unpark_wanted and c._start == c._end \
                and c._q.empty() and not c._closed and not c._broken and not c._lock.locked():
            return True
        self.gate.release()
        if self.unpark_wanted:  # the loop asked for its reader while we held the gate, and could not take it
            self._settle_soon()
        return False

    def write(self, frame: bytes) -> None:
        """Write one frame (length prefix + ``frame``) on the socket; raises ``ConnectionError``."""
        c = self.conn
        data = memoryview(len(frame).to_bytes(4, "big") + frame)
        if len(frame) > c.max_frame:
            from ..errors import LimitExceeded
            raise LimitExceeded(f"frame of {len(frame)} bytes exceeds the limit of {c.max_frame} bytes")
        deadline = time.monotonic() + WRITE_TIMEOUT
        try:
            while data:
                try:
                    sent = self.sock.send(data)
                except (BlockingIOError, InterruptedError):
                    sent = 0
                data = data[sent:]
                if data and not self._poll(select.POLLOUT, deadline):
                    raise OSError(f"could not write to {c.remote} within {WRITE_TIMEOUT:g} s")
        except OSError as e:
            c._broken = f"connection to {c.remote} broke: {e}"
            raise ConnectionError(c._broken) from None

    def finish(self, on_frame: Callable[[bytes], None], done: Callable[[], bool], timeout: float,
               handing_back: Callable[[], None] | None = None, soon: bool = True) -> bool:
        """Read frames for ``on_frame`` until ``done()`` (True), or hand the connection back to the
        loop (False: the caller waits the ordinary way; ``handing_back()`` is called first, while the
        gate is held). ``soon``: the answer may come within ``spin.SPIN`` (the peer has little to do
        before it): poll for it without sleeping first. Always gives the gate back. Raises
        ``ConnectionError`` when the link breaks or ends, and what ``on_frame`` raises."""
        c = self.conn
        deadline = time.monotonic() + min(timeout, PATIENCE)
        hot = soon and spin.SPIN > 0
        back = True
        try:
            while not done():
                n = c._end - c._start
                if n >= 4:
                    size = int.from_bytes(c._view[c._start:c._start + 4], "big")
                    if size >= self.small or size > c.max_frame:
                        return False  # the loop's: a large frame, or one it refuses
                    if n >= 4 + size:
                        c._start += 4
                        frame = bytes(c._take(size))
                        on_frame(frame)
                        continue
                    need = 4 + size
                else:
                    need = 4
                if self.unpark_wanted or not (hot and spin.poll_hot(self._poller(select.POLLIN), deadline,
                                                                    self.backoff)
                                              or self._poll(select.POLLIN, deadline)):
                    return False  # wanted elsewhere, or slow: the loop waits for it
                hot = False  # (polled without sleeping once per exchange at most: transport/spin.py)
                c._compact(need)
                try:
                    r = self.sock.recv_into(c._view[c._end:])
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError as e:
                    raise ConnectionError(f"connection to {c.remote} lost: {e}") from None
                if not r:
                    raise ConnectionError(f"{c.remote} closed the connection")
                c._end += r
            back = False
            return True
        finally:
            self.exchanges += 1
            if back:
                self.handbacks += 1
                self.unpark_wanted = True
                if handing_back is not None:
                    handing_back()
            self.gate.release()
            if self.unpark_wanted:
                self._settle_soon()

    def release(self) -> None:
        """Give the gate back without reading (the write failed, or there was nothing to send)."""
        self.unpark_wanted = True
        self.gate.release()
        self._settle_soon()

    def _settle_soon(self) -> None:
        """After giving the gate back with ``unpark_wanted`` set: the loop decides (``settle``), since an
        ``unpark`` that found the gate held left it to the holder."""
        try:
            self.loop.call_soon_threadsafe(self.settle)
        except RuntimeError:  # the loop is gone
            pass

    def writable(self, nbytes: int) -> bool:
        """Can a caller write a frame of ``nbytes`` now, with no answer to read (``write`` without ``begin``),
        and without waiting? Only a frame the socket takes whole in one ``send`` (``SMALL_WRITE`` with the
        socket writable, ``LARGE_WRITE`` with room for it twice in the send queue), while the connection is
        open and no send of the loop's is under way (a peer that stopped reading — back-pressure while its
        worker catches up — must make the loop's sender wait, never the recording thread). The caller
        must also hold the lock its user queues frames under, with the user's sender idle
        (``ClientSession._send_now_locked``), so that nothing else writes until it is done. Reading is the
        loop's (or an exchange's) as before."""
        c = self.conn
        if nbytes > LARGE_WRITE or c._closed or c._broken or c._lock.locked():
            return False
        if nbytes <= SMALL_WRITE:
            return bool(self._poller(select.POLLOUT).poll(0))
        try:  # larger: only into a send queue that takes it whole (the peer's window does not matter then)
            queued = struct.unpack("i", fcntl.ioctl(self.fd, termios.TIOCOUTQ, b"\0\0\0\0"))[0]
            return queued + 2 * nbytes <= self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        except (OSError, AttributeError):  # (not Linux: the loop's sender writes it)
            return False

    def _poll(self, event: int, deadline: float) -> bool:
        """Wait until the socket is readable (``POLLIN``) or writable, at most until ``deadline``."""
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        return bool(self._poller(event).poll(left * 1000))

    def _poller(self, event: int) -> Any:
        """The socket's poll object for ``event``, made once and reused: only one thread polls at a time (the
        gate's holder; for ``POLLOUT``, a writer holding its user's lock)."""
        p = self._polls.get(event)
        if p is None:
            p = self._polls[event] = select.poll()
            p.register(self.fd, event)
        return p
