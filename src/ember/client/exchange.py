"""One round trip on the caller's own thread, when the link is calm (a mixin of ``ClientSession``).

A blocking request (a read, a sync, a shape) normally crosses three threads on the client: the
user's thread queues the frame, the I/O loop sends it and later reads the answer, and wakes the
user's thread again. Each hop costs a thread switch and a fight for the GIL, several times the
wire's own round trip on loopback. When nothing else is in flight, the caller does the round
trip itself:

* **embedded peer** (``transport.memory``): the frame is handed to the peer's ``Session.direct``,
  which runs it on this very thread and returns the answers (no loop, no worker: the peer runs
  it only while its session is idle, else the frame takes the ordinary way);
* **TCP** (``transport.tcp_exchange``): while the loop's reader of the connection is parked
  (nothing is awaited on it), this thread writes the frame on the socket and reads the answer
  itself; frames that are not its answer (another thread's, a keepalive) are handled as the
  receiver would. A slow answer, a large frame or anything else the loop should see hands the
  connection back to the loop, and the caller waits as usual.

Either way the request has a ``Waiter`` registered before anything is sent, so a hand-back, a
loss or a timeout ends exactly as on the ordinary path: the caller's wait is the ordinary wait.
The frame is only taken this way while the sender is idle and holds nothing: so it leaves after
everything recorded before it, as it would have.
"""

from __future__ import annotations

from typing import Any



#: A request after at most this much work (messages and replayed ops) sent since the last answer may be
#: answered within ``transport.spin.SPIN``: its caller polls for the answer without sleeping first. After more
#: (a loss read every few training steps: milliseconds of queued work) it sleeps at once.
SOON_WORK = 64


class Exchanging:
    """The caller-thread round trip of ``ClientSession`` (see the module's docstring)."""

    def _init_exchange(self, conn: Any) -> None:
        s: Any = self
        #: memory link: ``direct(frame) -> answers | None``
        self._direct = getattr(conn, "direct", None)
        #: TCP: the connection's ``CalmLink`` (``transport.tcp_exchange``); not with lanes (their reads stripe)
        self._calm = getattr(conn, "calm", None) if not s.lanes_wanted else None
        self._exchanges = (self._direct is not None or self._calm is not None) and not s.lanes_wanted
        if self._calm is not None:
            self._calm.awaited = self._awaited
        s.stats["exchanges"] = 0  # round trips answered on the caller's thread
        #: requests a caller's thread is reading the answer of: the loop need not read for them
        self._exchanging: set[int] = set()
        #: the work sent (``stats``' messages + replayed ops) up to the last request answered on a caller's
        #: thread: the peer had run all of it then
        self._work_answered = 0

    def _exchange(self, msg: list[Any], req: int, timeout: float) -> None:
        """Send the request ``msg`` (its waiter registered under ``req``) after everything pending,
        and answer it on this thread when the link allows; else queue it the ordinary way. The
        caller then waits on its waiter as usual (set already when answered here)."""
        s: Any = self
        calm = self._calm
        with s._lock:
            s._request_locked(msg)
            idle = not s._frames and s._parked and s.lost is None
            if calm is not None:
                idle = idle and calm.begin()  # the gate: the loop's reader is parked
            frame = s._flush_locked(False, take=idle)
            if frame is None:
                if idle and calm is not None:
                    calm.release()
                return  # queued the ordinary way
            if calm is None:
                # under the lock: nothing recorded after it can reach the peer before it runs
                try:
                    answers = self._direct(frame)
                except Exception:  # noqa: BLE001 - never lose the frame: the ordinary way reports any fault
                    answers = None
                if answers is None:
                    self._to_sender_locked(frame)
                    return
            else:
                st = s.stats
                work = st["ops"] + st["replayed_ops"] - s._after_read  # messages and replayed ops sent before it
                self._exchanging.add(req)
                try:
                    calm.write(frame)  # in order: the sender is idle and we hold its lock
                except BaseException as e:  # noqa: BLE001 - broken: the session ends, typed
                    self._exchanging.discard(req)
                    calm.release()
                    s._frame_failed(e)
                    return
        try:
            if calm is None:
                s.stats["exchanges"] += 1
                for f in answers:
                    s._on_frame(f)
            else:
                waiters, mine = s._waiters, self._exchanging
                try:
                    if calm.finish(s._on_frame, lambda: req not in waiters, timeout, lambda: mine.discard(req),
                                   soon=work - self._work_answered <= SOON_WORK):
                        s.stats["exchanges"] += 1
                        self._work_answered = work  # (the peer has run everything before this request)
                finally:
                    mine.discard(req)
        except BaseException as e:  # noqa: BLE001 - as the receiver: the session ends with its reason
            s._frame_failed(e)

    def _send_now_locked(self) -> None:
        """Under the session's lock, on a TCP link: write the pending batch on the socket from this thread,
        now, when the link is calm (its sender idle, no send under way), else queue it for the sender at
        once. Called when a whole step was decided (a ``REPLAY``): the peer runs it while the caller
        records the next one, not when the idle timer next ticks and its thread gets the GIL (up to ~5 ms
        later). Other links leave it to the idle timer (see the comment below)."""
        s: Any = self
        calm = self._calm
        if calm is None or not s._pending or s.lost is not None:
            return  # (other links: the idle timer sends it; queueing it at once for the loop's thread costs
            #         the recording thread a wake-up and a GIL hand-off per step: slower on the embedded peer)
        if s._frames or not s._parked:
            s._flush_locked(False, drops_too=False)  # the sender's, now: not at the idle timer's next tick
            return
        frame = s._flush_locked(False, drops_too=False, take=True)
        if frame is None:
            return  # (several frames: queued for the sender)
        if not calm.writable(len(frame)):  # large, or no room: the sender waits for the socket, not we
            self._to_sender_locked(frame)
            return
        try:
            calm.write(frame)  # in order: the sender is idle and we hold its lock
        except BaseException as e:  # noqa: BLE001 - broken: the session ends, typed
            s._frame_failed(e)
            return
        if calm.parked and self._awaited():  # (as the sender does before a frame: an answer must be read)
            s.loop.call_soon_threadsafe(self._reader_wanted)

    def _to_sender_locked(self, frame: bytes) -> None:
        """Under the session's lock: a frame taken from ``_flush_locked(take=True)`` goes the ordinary way
        after all (to the loop's sender, in order)."""
        s: Any = self
        s._frames.append(frame)
        s.loop.call_soon_threadsafe(s._kick)

    def _awaited(self) -> bool:
        """Does any request wait for an answer the loop must read (not an upload's waiter, keyed ``-id``:
        it gets none; not one a caller's thread is reading: ``_exchanging``), or a ping's?"""
        s: Any = self
        mine = self._exchanging
        return s._pinged > s._last_recv or any(k > 0 and k not in mine for k in list(s._waiters))

    def _reader_wanted(self) -> None:
        """On the loop, before the sender sends: an answer will be awaited the ordinary way (or a
        heartbeat's), so the loop's reader must read."""
        if self._calm is not None and self._awaited():
            self._calm.unpark()

    def _reader_idle_here(self) -> None:
        """On the loop (and only there), before a waiter is woken: park now if that was the last answer
        awaited. Parking after the wake races the woken caller's next round trip, which would find the
        reader still up and take the ordinary way, again and again."""
        calm = self._calm
        if calm is not None and calm.on_loop() and not self._awaited():
            calm.park()

    def _reader_idle(self) -> None:
        """On the loop, after the receiver handled a frame or the sender an upload: park the reader
        when nothing is awaited."""
        if self._calm is not None and not self._awaited():
            self._calm.park()
