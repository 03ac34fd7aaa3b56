"""The session pump: one coroutine drives every session, whatever the transport.

``drive_session(server, conn)`` runs the handshake, then moves decoded batches
from the connection to the session's worker thread and the worker's responses
back. The network loop never waits on compute; pings are answered by the loop
itself so a long op never looks like a dead peer.

Tiny batches run inline. When the worker is idle and a batch is provably cheap
(``Interpreter.cheap``: NumPy or torch CPU device, at most 16 messages, elementwise ops on
at most 4096 elements, small reads and uploads, syncs, drops), the loop runs it
itself instead of handing it to the worker and back: that saves two thread
hops (about half of a small op+read round trip) and costs the loop a bounded
few microseconds, about what decoding the frame costs. Anything that could
take long (a matmul, a large array, a GPU device whose reads wait for the
device) still goes to the worker, so the loop stays responsive.

Back-pressure, both ways, so a client cannot make the peer buffer without
bound: the pump stops reading a session's stream while more than
``max_inflight`` bytes of its decoded batches wait for the worker (it sends a
keepalive ``[0, OK, None]`` every second meanwhile, so the client knows the peer
is alive), and the worker waits while more than ``stage_window`` bytes of its
answers wait for the network. Both are counted in the session's memory
(:mod:`ember.server.guard.memory`).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import Any, Callable

import numpy as np

from ..errors import AuthorizationError, EmberError, LimitExceeded, ProtocolError, to_wire
from ..protocol import codec
from ..protocol import lanes as pl
from ..protocol import messages as m
from ..transport.base import FrameConnection
from .execute.interpreter import Interpreter, Placed
from .guard.limits import client_identity
from .guard.memory import give_back_freed
from .handshake import first_map, handshake, serve_lane
from .host import SessionHost
from .lanes import SessionLanes, StripedRead
from .telemetry.probe import transport_of
from .transfer import TransferOps, serve_transfer

log = logging.getLogger("ember.server")

KEEPALIVE = codec.packb([[0, m.OK, None]])
#: Decoded batches cost about this many times their frame (uploads: their frame).
DECODED_FACTOR = 8


class Session:
    """A client's session on one device: its interpreter, worker thread and outbox."""

    def __init__(self, server: SessionHost, conn: FrameConnection, hello: dict[str, Any],
                 loop: asyncio.AbstractEventLoop, identity: str = "") -> None:
        self.server = server
        self.conn = conn
        self.session_id: bytes = hello["session_id"]
        self.device_index: int = hello["device"]
        self.peer_id = conn.peer_id
        self.identity = identity
        self.loop = loop
        self.limits = server.client_limits
        self.outbox: asyncio.Queue[Any] = asyncio.Queue()  # frames, (data-frame stream, bytes), None
        self.inbox: queue.SimpleQueue[tuple[list[list[Any]], float, int] | None] = queue.SimpleQueue()
        self.alive = True
        self.on_gone: Callable[[], None] | None = None  # on the loop, once the worker has stopped
        self.sending = False  # a frame is being sent (by the sender task, or inline by the pump)
        self.queued = 0  # batches handed to the worker (written by the loop)
        self.done = 0    # batches the worker finished (written by the worker)
        self.queued_bytes = 0  # their estimated decoded size (written by the loop)
        self.done_bytes = 0    # (written by the worker)
        # answers waiting for the network: bytes in (from the worker, from the loop) and out, each
        # written by one thread only, so counting costs no lock; the worker waits on _cond past the window
        self._in_worker = self._in_loop = self._out = 0
        self._waiting = False
        self._cond = threading.Condition()
        self.sender: asyncio.Future[None] | None = None
        self.inline = bool(getattr(server, "inline_small", True))
        self._loop_thread = threading.get_ident()
        # telemetry: who, and plain counters (one addition per frame); see server/telemetry/probe.py
        self.label, self.admin, self.transport = self.session_id.hex(), bool(hello.get("admin")), transport_of(conn)
        self.opened = time.monotonic()
        self.bytes_in = self.bytes_out = self.batches = 0
        backend = server.backends[self.device_index]
        self.mem = server.budgets[self.device_index].session(server.session_memory, self.session_id.hex()[:8])
        self.interp = Interpreter(backend, server.tables[self.device_index], server.custom_ops,
                                  self.respond, server.welcome_limits(self.device_index), memory=self.mem)
        self.interp.on_stall = self._on_stall
        self.interp.on_fatal = self._on_fatal
        self.transfer_ops = TransferOps(self.interp, server.transfers, loop, server.limits["max_frame"],
                                        max_wait=self.limits.max_wait)
        self.transfer_ops.client = identity
        self.interp.enable_transfers(self.transfer_ops)
        self.features = codec.agreed_features(hello.get("features"))
        if m.COMPILE_FEATURE in self.features:  # compiled graphs: only on a peer started with the option
            if server.compiler is None or backend.kind != "torch":
                self.features.remove(m.COMPILE_FEATURE)
            else:
                self.interp.compiler = server.compiler
        self.data = m.DATA_FEATURE in self.features
        if not self.data and m.LANES_FEATURE in self.features:  # lanes carry data frames
            self.features.remove(m.LANES_FEATURE)
        self.interp.data_frames = self.data
        self.lanes = SessionLanes(self, self._lane_failed) if m.LANES_FEATURE in self.features else None
        self._placed: dict[tuple[int, int], int] = {}  # (upload id, offset) -> bytes the sink put in place
        set_sink = getattr(conn, "set_data_sink", None)
        if self.data and set_sink is not None:
            set_sink(self.sink)
        self.interp.probe, self.interp.label = server.telemetry, self.label
        handlers = list(self.interp.handlers)
        handlers[m.STATS] = self.stats  # (the pump answers a lone STATS itself)
        if self.lanes is not None:
            handlers[m.UPLOAD] = self._upload
            self.interp.on_clear = self.lanes.clear
        self.interp.handlers = tuple(handlers)
        self.worker = threading.Thread(target=self._work, name=f"ember-session-{self.session_id.hex()[:8]}",
                                       daemon=True)
        server.live.add(self)
        self.worker.start()

    def respond(self, responses: list[list[Any]], data: memoryview | None = None, held: int = 0) -> None:
        """Called on the worker (or the loop, inline): encode once, hand the frame to the network loop.

        With ``data``, ``responses`` is one read answer whose bytes go out as data frames, chunked
        by the sender on the loop (views of the array: nothing is copied here; ``held`` is what the
        views keep alive beyond the session's tensors, a host copy). On the worker, waits while
        more than ``stage_window`` bytes of answers wait to be sent."""
        if data is None:
            frame: Any = codec.packb(responses)
            n = len(frame)
        else:
            req, _, (dt, shape, _, _, _) = responses[0]
            n = held
            if self.lanes is not None and self.lanes.stripes_for(len(data)):  # several streams side by side
                frame = (StripedRead(req, dt, shape, data), n)
            else:
                frame = (codec.read_frames(req, dt, shape, data, self.server.limits["chunk"]), n)
        if threading.get_ident() == self._loop_thread:
            self.post(frame, n)
            return
        self._in_worker += n
        try:
            self.loop.call_soon_threadsafe(self.outbox.put_nowait, frame)
        except RuntimeError:  # loop closed: the server is shutting down
            self.alive = False
            return
        window = self.limits.stage_window
        if self.staged > window:
            with self._cond:
                self._waiting = True
                while self.staged > window and self.alive:
                    self._cond.wait(1.0)
                self._waiting = False

    @property
    def staged(self) -> int:
        """Bytes of answers waiting for the network (bounded by ``stage_window``, in the session's figures)."""
        return self._in_worker + self._in_loop - self._out

    def post(self, frame: Any, n: int | None = None) -> None:
        """On the loop: queue a frame (or a ``(data-frame stream, bytes)`` pair) for the sender,
        counted until it has left."""
        self._in_loop += len(frame) if n is None else n
        self.outbox.put_nowait(frame)

    def sent(self, n: int) -> None:
        """On the loop: a frame of ``n`` bytes has left."""
        self._out += n
        if self._waiting:
            with self._cond:
                self._cond.notify_all()

    def _work(self) -> None:
        with np.errstate(all="ignore"):  # IEEE semantics: nan/inf results, no warnings
            self._work_loop()
        self.interp.clear()
        self.server.transfers.revoke(self.transfer_ops)
        self.mem.close()
        self.server.live.discard(self)
        if self.mem.peak >= 1 << 20 or not self.server.live:
            give_back_freed(force=not self.server.live)
        gone = self.on_gone
        if gone is not None:  # the session counted against its client until now
            try:
                self.loop.call_soon_threadsafe(gone)
            except RuntimeError:  # the loop is closed: the server is gone too
                pass

    def _upload(self, msg: list[Any], out: list[list[Any]]) -> None:
        """UPLOAD with lanes agreed: nil bytes mean they come on the lanes (``server.lanes``)."""
        if len(msg) == 7 and msg[5] is None:
            assert self.lanes is not None
            self.lanes.finish(msg, out)
        else:
            self.interp.upload(msg, out)

    def _lane_failed(self, err: EmberError) -> None:
        """On the loop: a lane broke, or brought what it must not; the session ends."""
        if self.alive:
            asyncio.ensure_future(end_session(self, err))

    def stats(self, msg: list[Any], out: list[list[Any]]) -> None:
        """STATS (in a batch, in order; alone, the pump answers it at once): figures, see server/telemetry/figures.py."""
        resp = self.server.figures.answer(self, msg)
        if resp is not None:
            out.append(resp)

    def _work_loop(self) -> None:
        inbox, mem = self.inbox, self.mem
        while True:
            item = inbox.get()
            if item is None or not self.alive:
                break
            batch, received, cost = item
            try:
                self._run(batch, received, False)
            finally:
                mem.shared_release(cost)
                self.done_bytes += cost
                self.done += 1

    async def send_frames(self, conn: FrameConnection, frames: Any) -> None:
        """Send data frames ``(prefix, payload)`` on ``conn`` (the session stream or a lane), counted."""
        for parts in frames:
            self.bytes_out += len(parts[0]) + len(parts[1])
            await conn.send(parts)

    def _run(self, batch: list[list[Any]], received: float, inline: bool) -> None:
        """Run one batch (on the worker, or inline on the loop); a session-level error it raised ends
        the session."""
        try:
            self.interp.run_batch(batch, received, inline)
        except Exception:  # never let one batch kill the worker (or the loop)
            log.exception("session %s: batch failed", self.session_id.hex()[:8])
        fatal, self.interp.fatal = self.interp.fatal, None
        if fatal is not None:
            self._on_fatal(*fatal)

    def submit(self, batch: list[list[Any]], frame_bytes: int = 0) -> bool:
        """On the loop: run a tiny, cheap batch inline when the worker is idle (True), else queue it."""
        received = time.perf_counter() if self.interp.probe.active else 0.0
        if self.inline and self.queued == self.done and self.interp.cheap(batch):
            with np.errstate(all="ignore"):
                self._run(batch, received, True)
            return True
        cost = frame_bytes if batch[0][0] == m.UPLOAD else frame_bytes * DECODED_FACTOR
        self.mem.shared_charge(cost)
        self.queued_bytes += cost
        self.queued += 1
        self.inbox.put((batch, received, cost))
        return False

    def inflight(self) -> int:
        """Estimated bytes of decoded batches waiting for the worker (read on the loop)."""
        return self.queued_bytes - self.done_bytes

    def stop(self) -> None:
        self.alive = False
        self.interp.cancelled = True
        self.inbox.put(None)
        if self.lanes is not None:
            self.lanes.stop()
        with self._cond:
            self._cond.notify_all()

    # ---- a REPLAY waiting for a GRAPH the client never sends --------------------------------
    def _on_stall(self) -> None:
        """On the worker (or the loop): the interpreter began holding messages for a graph."""
        token = self.interp._stalled
        try:
            self.loop.call_soon_threadsafe(self.loop.call_later, self.limits.stall_timeout, self._check_stall, token)
        except RuntimeError:
            pass

    def _on_fatal(self, err: ProtocolError, answered: bool = False) -> None:
        """After a batch (worker or loop): a session-level error in it (a malformed GRAPH, a stall
        overflow) ends the session, once that batch's answers are queued."""
        def end() -> None:
            asyncio.ensure_future(end_session(self, err, notify=not answered))
        if threading.get_ident() == self._loop_thread:
            end()
            return
        try:
            self.loop.call_soon_threadsafe(end)
        except RuntimeError:
            pass

    def _check_stall(self, token: Any) -> None:
        if self.alive and token is not None and self.interp._stalled is token:
            err = ProtocolError(f"a Replay waited {self.limits.stall_timeout:g} s for graph "
                                f"{self.interp._stall_gid} (NEED_GRAPH) that the client never sent")
            log.info("session %s: %s", self.session_id.hex()[:8], err.message)
            asyncio.ensure_future(end_session(self, err))

    # ---- data frames (on the loop) ---------------------------------------------------
    def sink(self, head: memoryview, n: int) -> memoryview | None:
        """The transport's data sink: where an upload chunk's payload should be read into."""
        try:
            h = codec.decode_data_head(head)
        except ProtocolError:
            return None
        if not codec.is_upload_head(h):
            return None
        dest = self.interp.upload_target(h[1], h[2], h[3], h[4], n, h[6])
        if dest is not None:
            self._placed[(h[1], h[4])] = n
        return dest

    def data_message(self, frame: Any) -> list[Any]:
        """The UPLOAD message a data frame carries (its bytes, or ``Placed`` when the sink put them)."""
        head, payload = codec.decode_data(frame)
        if not codec.is_upload_head(head):
            raise ProtocolError(f"a data frame from a client must carry one Upload, got {str(head)[:80]}")
        placed = self._placed.pop((head[1], head[4]), None) if not len(payload) else None
        head[5] = Placed(placed) if placed is not None else payload
        self.bytes_in += placed or 0  # (the transport read those bytes straight into place)
        return head


async def _send_loop(session: Session) -> None:
    outbox = session.outbox
    while True:
        frame = await outbox.get()
        if frame is None:
            return
        await _send_marked(session, frame)


async def _send_marked(session: Session, frame: Any) -> None:
    """Send one frame (or a read's data frames) with ``session.sending`` raised meanwhile (so
    frames keep their order)."""
    session.sending = True
    if isinstance(frame, bytes):
        n = len(frame)
    else:
        frame, n = frame
    try:
        if isinstance(frame, bytes):
            session.bytes_out += len(frame)
            await session.conn.send(frame)
        elif type(frame) is StripedRead:
            assert session.lanes is not None
            await session.lanes.send_read(frame)
        else:
            await session.send_frames(session.conn, frame)
    finally:
        session.sending = False
        session.sent(n)


async def end_session(session: Session, err: EmberError, notify: bool = True) -> None:
    """Tell the client why (a session-level error; ``notify=False``: it was told), then close its stream."""
    session.alive = False
    session.end = ["protocol_error", err.message]
    if notify:
        session.post(codec.packb([[0, m.ERROR, to_wire(err)]]))
    session.outbox.put_nowait(None)
    if session.sender is not None:
        try:
            await asyncio.wait_for(asyncio.shield(session.sender), 5.0)
        except Exception:  # noqa: BLE001
            pass
    await _close_quietly(session.conn)


async def _send_now(session: Session) -> None:
    """Send what an inline batch answered from the pump itself, a loop turn sooner than the sender
    task would (only while that task is idle, so frames keep their order)."""
    outbox = session.outbox
    while not session.sending and not outbox.empty():
        frame = outbox.get_nowait()
        if frame is None:
            outbox.put_nowait(None)
            return
        await _send_marked(session, frame)


async def drive_session(server: SessionHost, conn: FrameConnection) -> None:
    """Serve one stream: a session until it closes, breaks or sends garbage; or one download."""
    limits = server.client_limits
    identity = client_identity(conn.peer_id, conn.remote)
    if not server.admission.begin_pending(identity):
        await _close_quietly(conn)
        return
    try:
        try:
            first = await asyncio.wait_for(conn.recv(), limits.handshake_timeout)
        finally:
            server.admission.end_pending(identity)
        if first is None:
            return
        request = first_map(first)
        trust = getattr(conn, "trust", None)  # once the first frame is accepted: full-size frames
        if request is not None and request.get("type") == "transfer":
            if trust is not None:
                trust()
            await serve_transfer(server.transfers, conn, request, server.limits["chunk"], server.telemetry)
            await _close_quietly(conn)
            return
        lane = pl.decode_first(request)
        if lane is not None:
            if trust is not None:
                trust()
            await serve_lane(server, conn, lane)
            await _close_quietly(conn)
            return
        hello = await handshake(server, conn, first, identity)
    except asyncio.TimeoutError:
        log.info("%s sent nothing within %g s", conn.remote, limits.handshake_timeout)
        server.admission.refusals["handshake_timeout"] += 1
        server.telemetry.session_refused(conn.peer_id, conn.remote, "timeout", "no Hello within the handshake timeout")
        hello = None
    except (ConnectionError, EmberError, OSError) as e:
        log.info("handshake with %s failed: %s", conn.remote, e)
        hello = None
    if hello is None:
        await _close_quietly(conn)
        return
    trust = getattr(conn, "trust", None)
    if trust is not None:
        trust()
    loop = asyncio.get_running_loop()
    session = Session(server, conn, hello, loop, identity)
    server.sessions[session.session_id] = session
    server.admission.opened(identity)
    sender = session.sender = asyncio.ensure_future(_send_loop(session))
    reaper = asyncio.ensure_future(_end_when_silent(session, limits.idle_timeout)) if limits.idle_timeout > 0 else None
    server.telemetry.session_opened(session)
    session.end = ["disconnected", "the client closed the connection"]
    try:
        await conn.send(codec.encode_welcome(
            peer_id=server.peer_id, devices=server.device_info(), device=session.device_index,
            limits=server.welcome_limits(session.device_index), server_version=server.version,
            instance=server.instance, transfer_id=server.transfer_peer_id, features=session.features,
            **({"lanes": session.lanes.welcome()} if session.lanes is not None else {})))
        await _pump(server, session)
    except (ConnectionError, OSError, asyncio.IncompleteReadError) as e:
        log.info("session %s lost: %s", session.session_id.hex()[:8], e)
        if session.end[0] != "silent":  # (closing a silent client's connection breaks it)
            session.end = ["lost", f"connection lost: {e}"]
    finally:
        if reaper is not None:
            reaper.cancel()
        reason, why = session.end
        session.on_gone = lambda: server.admission.closed(identity)  # once its worker stops
        session.stop()
        server.sessions.pop(session.session_id, None)
        session.outbox.put_nowait(None)
        try:
            await asyncio.wait_for(sender, 5.0)
        except Exception:
            sender.cancel()
        await _close_quietly(conn)
        if session.lanes is not None:
            await session.lanes.close()
        if server.telemetry.stopping and reason != "client_closed":
            reason, why = "server_stopping", "the peer shut down"
        server.telemetry.session_closed(session, reason, why)


async def _pump(server: SessionHost, session: Session) -> None:
    """Frames in, batches to the worker, until the stream ends, breaks or sends garbage
    (``session.end`` says which, for the session log)."""
    conn, limits, sender = session.conn, session.limits, session.sender
    assert sender is not None
    max_frame = server.limits["max_frame"] + 4096
    window, outbox = limits.stage_window, session.outbox
    while not sender.done() and session.alive:
        if session.inflight() > limits.max_inflight:
            await _wait_for_worker(session)
            continue
        if outbox.qsize() > MAX_UNSENT or session.staged > window:  # a client that does not read its answers
            await _wait_for_sender(session, window)
            continue
        frame = await conn.recv()
        if frame is None or not session.alive:
            return
        session.bytes_in += len(frame)
        session.batches += 1
        try:
            if codec.is_data(frame) and session.data:
                batch = [session.data_message(frame)]
            else:
                batch = codec.decode_batch(frame, max_frame, limits.max_messages)
        except ProtocolError as e:  # garbage mid-session: say why, end this session only
            log.info("session %s: %s", session.session_id.hex()[:8], e.message)
            if isinstance(e, LimitExceeded):
                server.admission.refusals["max_messages"] += 1
            session.post(codec.packb([[0, m.ERROR, to_wire(e)]]))
            session.end = ["protocol_error", e.message]
            server.telemetry.error(session.label, type(e).__name__, type(e).__name__, None, e.message, False)
            return
        if not batch:
            continue
        first = batch[0]
        if len(batch) == 1 and first[0] == m.PING:
            session.post(codec.packb([[first[1] if len(first) > 1 else 0, m.OK, None]]))
            continue
        if len(batch) == 1 and first[0] == m.STATS:  # answered at once, even while the worker is busy
            resp = server.figures.answer(session, first)
            if resp is not None:
                session.post(codec.packb([resp]))
            continue
        if first[0] == m.EXPOSE:  # sent alone: downloads may wait for the worker to reach it
            for msg in batch:
                if msg[0] == m.EXPOSE and len(msg) == 6:
                    server.transfers.announce(msg[2], msg[5])
        if session.submit(batch, len(frame)) and not session.sending:
            await _send_now(session)
        if batch[-1][0] == m.CLOSE:
            session.end = ["client_closed", "closed by the client"]
            return
    if sender.done():
        session.end = ["lost", "the connection broke while sending"]


async def _end_when_silent(session: Session, timeout: float) -> None:
    """End a session whose client sent nothing for ``timeout`` s while its worker had nothing to do:
    a host or link that vanished sends no FIN, and its session would hold memory for ever. Clients
    ping well within ``idle_timeout`` (Welcome); anything they send counts (``bytes_in``, lanes too)."""
    seen, since = -1, time.monotonic()
    while session.alive:
        await asyncio.sleep(max(timeout / 4, 0.05))
        now = time.monotonic()
        if session.bytes_in != seen or session.inflight():
            seen, since = session.bytes_in, now
        elif now - since >= timeout:
            why = f"the client sent nothing for {now - since:.0f} s (--idle-timeout {timeout:g}): its host or link is gone"
            log.info("session %s: %s", session.session_id.hex()[:8], why)
            session.end = ["silent", why]
            try:
                await asyncio.wait_for(session.conn.close(), 5.0)  # the pump's read ends, and the session
            except Exception:  # noqa: BLE001 - a broken connection is what we are ending
                pass
            return


#: Answers queued for the network, at most, before the pump stops reading that session's requests.
MAX_UNSENT = 1024


async def _wait_for_sender(session: Session, window: int) -> None:
    """The client does not read its answers: read nothing more from it until they have left."""
    delay = 0.001
    while session.alive and session.sender is not None and not session.sender.done() and \
            (session.outbox.qsize() > MAX_UNSENT or session.staged > window):
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.05)


async def _wait_for_worker(session: Session) -> None:
    """Too much waits for the worker: read nothing more until it catches up; keep the client informed."""
    last = time.monotonic()
    delay = 0.001
    while session.alive and session.inflight() > session.limits.max_inflight:
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.05)
        if time.monotonic() - last >= 1.0:
            session.post(KEEPALIVE)
            last = time.monotonic()


async def _close_quietly(conn: FrameConnection) -> None:
    """Close, reading (and dropping) whatever the client still sends meanwhile: a WebSocket's close
    handshake needs the client's close frame, queued behind the frames nobody reads any more."""
    async def drain() -> None:
        try:
            while await conn.recv() is not None:
                pass
        except Exception:  # noqa: BLE001 - broken or closed: done
            pass
    reader = asyncio.ensure_future(drain())
    try:
        await asyncio.wait_for(conn.close(), 5.0)
    except Exception:
        pass
    finally:
        reader.cancel()


__all__ = ["drive_session", "Session", "SessionHost", "AuthorizationError"]
