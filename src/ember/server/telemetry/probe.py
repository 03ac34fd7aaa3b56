"""The telemetry probe: what a compute peer is doing, as events (Burn Remote's ``TelemetryProbe``).

One ``Probe`` per server (``server.telemetry``). The session pump, the interpreter and the
transfer code call it at fixed points; Prometheus (``server/telemetry/metrics.py``), ``ember top`` /
``ember status`` (``server/telemetry/figures.py``, answered over STATS) and the session log
(``server/telemetry/session_log.py``) are subscribers of the same events.

Two tiers, so that nobody pays for what nobody watches:

* **session events**, rare (one per session, failure or move): ``SessionOpened``,
  ``SessionClosed``, ``SessionRefused``, ``Error``, ``Transfer``, ``GraphMissed``,
  ``GraphEvicted``. They are built only while someone subscribes. The probe also counts them
  itself (sessions opened, refused and closed by reason, errors by kind, transfers by outcome,
  the closed sessions' totals), so those counters never miss one.
* **op events**: ``Batch``, one per batch a session ran, in columns (per message its op name
  and the time it finished: two list appends; what non-op messages moved on the side), and
  ``Op``, one per message, unpacked from a ``Batch`` on the subscriber's side (a subscriber
  that wants ``Op`` objects pays for building them, not the session). They exist only while a
  subscriber asked for them: the interpreter asks ``probe.active`` once per batch for a
  ``Recorder`` and otherwise runs its plain loop (whose only trace is an ``is None`` test per
  message). Code that runs ops outside a batch reports them with ``probe.op(session, kind, name, ...)``.

Subscribing::

    with server.telemetry.subscribe() as sub:         # kinds=None: every event
        for ev in sub:                                 # or sub.get(timeout), sub.drain()
            ...

The queue is bounded (``capacity``, default 4096 events; a ``Batch`` counts as one): when it
is full, new events are dropped rather than waited for, and the subscriber's next read starts
with ``Missed(count)``. ``async for ev in sub`` works too (it polls every 20 ms).

Figures that are state rather than events (live sessions and their counters, memory held) are
read on demand: a session counts its frames and bytes with an integer addition per frame, its
interpreter counts messages per batch and graph replays per replay, and memory is summed only
when a snapshot is asked for (``server.figures.snapshot()``, ``server/telemetry/figures.py``). The event
classes live in ``server/telemetry/events.py`` (and are importable from here).
"""

from __future__ import annotations

import asyncio
import threading
from array import array
import time
from collections import Counter, deque
from typing import Any, Callable, Iterable, Iterator

from ...protocol import messages as m
from .events import (EVENTS, KINDS, OP_EVENTS, SESSION_EVENTS, Batch, Error, GraphEvicted, GraphMissed,  # noqa: F401
                     Missed, Op, SessionClosed, SessionOpened, SessionRefused, Transfer, kind_name, unpack)
DEFAULT_CAPACITY = 4096
_new = tuple.__new__


# ---- subscriptions ---------------------------------------------------------------------

class Subscription:
    """A bounded queue of events for one subscriber (see the module docstring)."""

    def __init__(self, probe: "Probe", kinds: Iterable[str] | None, capacity: int, shapes: bool) -> None:
        self.kinds = None if kinds is None else frozenset(kinds)
        if self.kinds is not None and not self.kinds <= EVENTS:
            raise ValueError(f"unknown event kind(s) {sorted(self.kinds - EVENTS)}; choose from {sorted(EVENTS)}")
        if capacity < 1:
            raise ValueError("a subscription needs a capacity of at least 1 event")
        self.probe = probe
        self.capacity = capacity
        self.shapes = shapes
        self.ops = self.kinds is None or bool(self.kinds & OP_EVENTS)
        self._batches = self.kinds is None or "Batch" in self.kinds
        self._unpack = self.kinds is None or "Op" in self.kinds
        self.missed = 0          # dropped over this subscription's life
        self._unreported = 0     # dropped since the last read
        self.closed = False
        self._q: deque[Any] = deque()
        self._ready: deque[Any] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._waiting = False

    def wants(self, name: str) -> bool:
        return self.kinds is None or name in self.kinds

    def put(self, ev: Any) -> None:
        """Producer side: queue ``ev`` or count it missed; never blocks."""
        if len(self._q) < self.capacity:
            self._q.append(ev)
            if self._waiting:
                self._wake.set()
        else:
            with self._lock:
                self.missed += 1
                self._unreported += 1

    # ---- consumer side ---------------------------------------------------------------
    def _next_ready(self) -> Any:
        if self._unreported:
            with self._lock:
                n, self._unreported = self._unreported, 0
            return Missed(time.time(), n)
        ready = self._ready
        while not ready:
            try:
                ev = self._q.popleft()
            except IndexError:
                return None
            if type(ev) is tuple:  # a Batch, as queued by Probe.batch
                ev = _new(Batch, ev)
                if self._unpack:
                    ready.extend(unpack(ev))
                if self._batches:
                    ready.append(ev)
            else:
                ready.append(ev)
        return ready.popleft()

    def get(self, timeout: float | None = None) -> Any:
        """The next event; None when ``timeout`` passed first or the subscription is closed."""
        ev = self._next_ready()
        if ev is not None or self.closed or timeout == 0:
            return ev
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._wake.clear()
            self._waiting = True
            try:
                ev = self._next_ready()
                if ev is not None or self.closed:
                    return ev
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._wake.wait(left)
            finally:
                self._waiting = False

    def drain(self) -> list[Any]:
        """Every event queued now, without waiting."""
        out = []
        while (ev := self._next_ready()) is not None:
            out.append(ev)
        return out

    def wait(self, timeout: float) -> None:
        """Sleep until an event may be queued or ``timeout`` passed (for consumers that drain)."""
        if self._q or self._unreported or self.closed:
            return
        self._wake.clear()
        self._waiting = True
        try:
            if not self._q:
                self._wake.wait(timeout)
        finally:
            self._waiting = False

    def __iter__(self) -> Iterator[Any]:
        ready = self._ready
        while True:
            while ready and not self._unreported:  # the unpacked ops of a Batch, without a call each
                yield ready.popleft()
            ev = self.get()
            if ev is None:
                return
            yield ev

    def __aiter__(self) -> "Subscription":
        return self

    async def __anext__(self) -> Any:
        while True:
            ev = self._next_ready()
            if ev is not None:
                return ev
            if self.closed:
                raise StopAsyncIteration
            await asyncio.sleep(0.02)

    def close(self) -> None:
        """Unsubscribe; a blocked ``get`` returns None."""
        if not self.closed:
            self.closed = True
            self.probe._unsubscribe(self)
            self._wake.set()

    def __enter__(self) -> "Subscription":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def consume(sub: Subscription, handle: Callable[[Any], None], name: str, poll: float = 0.05) -> threading.Thread:
    """Run ``handle(event)`` for every event of ``sub`` on a daemon thread until it is closed.

    A subscriber of op events drains every ``poll`` seconds (its producers never wake it, so a
    batch costs them no thread switch); one of session events only sleeps until woken.
    """
    timeout = poll if sub.ops else 1.0

    seen: set[tuple[str, str]] = set()  # failures logged once each, with a traceback; then counted in a line

    def run() -> None:
        while not sub.closed:
            for ev in sub.drain():
                try:
                    handle(ev)
                except Exception as e:  # a subscriber's bug must not end its thread, nor flood the log
                    import logging
                    lg, key = logging.getLogger("ember.server.telemetry"), (type(e).__name__, str(e)[:200])
                    if key not in seen and len(seen) < 64:
                        seen.add(key)
                        lg.exception("telemetry subscriber %s failed (logged once; repeats are not)", name)
            sub.wait(timeout)

    t = threading.Thread(target=run, name=f"ember-telemetry-{name}", daemon=True)
    t.start()
    return t


def finish(sub: Subscription | None, handle: Callable[[Any], None]) -> None:
    """Handle what ``sub`` still has queued, then close it (a ``consume`` subscriber's stop)."""
    if sub is not None:
        for ev in sub.drain():
            handle(ev)
        sub.close()


# ---- the probe ------------------------------------------------------------------------

def transport_of(conn: Any) -> str:
    name = type(conn).__name__
    return {"MemoryConnection": "memory", "WebSocketConnection": "websocket", "TcpConnection": "tcp",
            "IrohConnection": "iroh"}.get(name, name.lower())


def counters(session: Any) -> dict[str, int]:
    """What a session has done so far (plain counters, cheap to read)."""
    it = session.interp
    return {"messages": it.ops_run, "ops": it.ops_run + it.replayed_ops - it.graph_hits,
            "batches": session.batches, "bytes_in": session.bytes_in, "bytes_out": session.bytes_out,
            "graph_hits": it.graph_hits, "graph_misses": it.graph_misses,
            "graph_evictions": it.graphs.evictions, "graph_saved_bytes": it.graph_saved,
            "read_aheads": getattr(session, "read_aheads", 0), "reads_between": getattr(session, "reads_between", 0)}


class Probe:
    """The fixed points servers call, and the subscribers they deliver to."""

    def __init__(self) -> None:
        self.subscribers: tuple[Subscription, ...] = ()
        self.active = False      # a subscriber wants op events: the interpreter observes its batches
        self.shapes = False      # ... with output shapes and dtypes
        self.stopping = False    # the server is shutting down (sessions end with reason server_stopping)
        self.sessions: set[Any] = set()   # live sessions (read on demand for snapshots)
        self.lock = threading.Lock()
        self.opened = 0
        self.refused: Counter[str] = Counter()
        self.closed: Counter[str] = Counter()
        self.closed_totals: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.transfers: Counter[str] = Counter()  # "scope/phase" -> count
        self._dropped_closed = 0

    # ---- subscribers -----------------------------------------------------------------
    def subscribe(self, kinds: Iterable[str] | None = None, *, capacity: int = DEFAULT_CAPACITY,
                  shapes: bool = False) -> Subscription:
        """A new subscription to ``kinds`` (event class names; None: all), ``capacity`` events deep.

        ``shapes=True`` adds each op's outputs ``(id, shape, dtype)`` to its record (costs more).
        """
        sub = Subscription(self, kinds, capacity, shapes)
        with self.lock:
            self.subscribers = self.subscribers + (sub,)
            self._update()
        return sub

    def _unsubscribe(self, sub: Subscription) -> None:
        with self.lock:
            self.subscribers = tuple(s for s in self.subscribers if s is not sub)
            self._dropped_closed += sub.missed
            self._update()

    def _update(self) -> None:
        self.active = any(s.ops for s in self.subscribers)
        self.shapes = any(s.ops and s.shapes for s in self.subscribers)

    @property
    def dropped(self) -> int:
        """Events dropped so far because a subscriber's queue was full (all subscribers, ever)."""
        return self._dropped_closed + sum(s.missed for s in self.subscribers)

    def emit(self, ev: Any) -> None:
        name = type(ev).__name__
        for s in self.subscribers:
            if s.kinds is None or name in s.kinds:
                s.put(ev)

    # ---- session events ----------------------------------------------------------------
    def session_opened(self, s: Any) -> None:
        with self.lock:
            self.sessions.add(s)
            self.opened += 1
        if self.subscribers:
            self.emit(SessionOpened(time.time(), s.label, s.peer_id, s.conn.remote, s.transport, s.device_index,
                                    s.admin))

    def session_closed(self, s: Any, reason: str, why: str) -> None:
        figures = counters(s)
        with self.lock:
            self.sessions.discard(s)
            self.closed[reason] += 1
            self.closed_totals.update(figures)
            self.closed_totals[f"{s.transport}/bytes_in"] += s.bytes_in
            self.closed_totals[f"{s.transport}/bytes_out"] += s.bytes_out
        if self.subscribers:
            self.emit(SessionClosed(time.time(), s.label, s.peer_id, s.conn.remote, s.transport, s.device_index,
                                    s.admin, time.monotonic() - s.opened, reason, why, figures))

    def session_refused(self, peer: str | None, remote: str, code: str, reason: str) -> None:
        with self.lock:
            self.refused[code] += 1
        if self.subscribers:
            self.emit(SessionRefused(time.time(), peer, remote, code, reason))

    def error(self, session: str, kind: str, cause: str, op: Any, message: str, poisoned: bool) -> None:
        op = op[:100] if isinstance(op, str) else None if op is None else repr(op)[:100]  # client-chosen
        message = message if len(message) <= 1000 else message[:1000] + "…"
        with self.lock:
            self.errors[kind] += 1
        if self.subscribers:
            self.emit(Error(time.time(), session, kind, cause, op, message, poisoned))

    def transfer(self, session: str | None, peer: str | None, scope: str, phase: str, nbytes: int = 0,
                 seconds: float = 0.0, error: str | None = None) -> None:
        peer = peer[:200] if peer else peer  # a client-given address may be long
        error = error[:1000] if error else error
        with self.lock:
            self.transfers[f"{scope}/{phase}"] += 1
        if self.subscribers:
            self.emit(Transfer(time.time(), session, peer, scope, phase, nbytes, seconds, error))

    def graph_missed(self, session: str, gid: Any) -> None:
        if self.subscribers:
            self.emit(GraphMissed(time.time(), session, gid))

    def graph_evicted(self, session: str, count: int) -> None:
        if self.subscribers:
            self.emit(GraphEvicted(time.time(), session, count))

    # ---- op events ---------------------------------------------------------------------
    def op(self, session: str, kind: str | int, name: Any, seconds: float = 0.0, *, wait_s: float = 0.0,
           nbytes: int = 0, ops: int = 1, saved_bytes: int = 0,
           outputs: list[tuple[int, tuple[int, ...], str]] | None = None) -> None:
        """Report one op run outside a batch (generic: any ``kind`` name, e.g. ``"aten"``)."""
        if not self.active:
            return
        ev = Op(time.time(), session, kind_name(kind), name, wait_s, seconds, nbytes, ops, saved_bytes, outputs)
        for s in self.subscribers:
            if s._unpack:
                s.put(ev)

    def record(self) -> "Recorder":
        """A batch's recorder (the interpreter fills it while ``active``; see ``Interpreter.run_batch``)."""
        return Recorder(self.shapes)

    def batch(self, session: str, rec: "Recorder", received: float, inline: bool, memory: int = 0,
              device_memory: int = 0) -> None:
        """A batch ran: deliver it to the subscribers of op events."""
        end = rec.times[-1] if rec.times else rec.start
        # queued as a plain tuple, which the garbage collector stops tracking (a Batch is built on reading)
        ev = (time.time(), session, rec.start - received if received else 0.0, end - rec.start, inline,
              rec.start, tuple(rec.names), rec.times.tobytes(), tuple(rec.extras), rec.outputs, memory,
              device_memory)
        for s in self.subscribers:
            if s.ops:
                s.put(ev)


OFF = Probe()
"""A probe nobody subscribes to (interpreters created without a server use it)."""


# ---- recording one batch (while a subscriber wants op events) -------------------------------

class Recorder:
    """Filled by the interpreter as a batch runs: per message a name and an end time, extras for
    messages that are not ops (what they moved and ran), outputs when shapes were asked for."""

    __slots__ = ("start", "names", "times", "extras", "outputs")
    clock = staticmethod(time.perf_counter)

    def __init__(self, shapes: bool) -> None:
        self.names: list[Any] = []
        self.times = array("d")
        self.extras: list[tuple[Any, ...]] = []
        self.outputs: dict[int, list[tuple[int, tuple[int, ...], str]]] | None = {} if shapes else None
        self.start = time.perf_counter()

    def other(self, kind: int, msg: list[Any], interp: Any) -> None:
        """A message that is not an OP finished."""
        self.times.append(time.perf_counter())
        self.extras.append((len(self.names), *_extra(kind, msg, interp)))
        self.names.append(None)

    def add_outputs(self, tensors: dict[int, Any], msg: list[Any]) -> None:
        """The OP just recorded: its outputs' ids, shapes and dtypes."""
        out = []
        try:
            for o in msg[4]:
                v = tensors.get(o)
                if v is not None:
                    out.append((o, tuple(v.shape), str(v.dtype).rsplit(".", 1)[-1]))
        except Exception:
            pass
        assert self.outputs is not None
        self.outputs[len(self.names) - 1] = out


def _extra(kind: int, msg: list[Any], interp: Any) -> tuple[Any, ...]:
    """``(kind, name, nbytes, ops, saved_bytes)`` of a non-OP message (malformed ones: only the kind)."""
    try:
        if kind == m.UPLOAD:  # the bytes, or a Placed(n) the transport read straight into place
            data = msg[5]
            return (kind, None, data.n if hasattr(data, "n") else len(data), 0, 0)
        if kind == m.READ:
            return (kind, None, int(getattr(interp.tensors.get(msg[2]), "nbytes", 0)), 0, 0)
        if kind == m.GRAPH or kind == m.REPLAY:
            g = interp.graphs.peek(msg[1])
            if g is None:
                return (kind, msg[1], 0, 0, 0)
            if kind == m.GRAPH:
                return (kind, msg[1], g.wire_bytes, 0, 0)
            return (kind, msg[1], g.replay_bytes, g.n_ops, g.saved)
        if len(msg) > 1 and type(msg[1]) is str:  # custom, aten, and any op-like kind added later
            return (kind, msg[1], 0, 1, 0)
    except Exception:
        pass
    return (kind, None, 0, 0, 0)
