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
import time
from typing import Any

from ..errors import AuthorizationError, EmberError, LimitExceeded, ProtocolError, to_wire
from ..protocol import codec
from ..protocol import lanes as pl
from ..protocol import messages as m
from ..transport.base import FrameConnection
from .guard.limits import client_identity
from .handshake import first_map, handshake, serve_lane
from .host import SessionHost
from .lanes import StripedRead
from .session_worker import KEEPALIVE, Session, close_quietly, end_session
from .transfer import serve_transfer

log = logging.getLogger("ember.server")


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
        await close_quietly(conn)
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
        if request is not None and request.get("type") == "ping":  # a downloader asks whether this peer is there
            await conn.send(codec.packb({"type": "pong"}))
            await close_quietly(conn)
            return
        if request is not None and request.get("type") == "transfer":
            if trust is not None:
                trust()
            await serve_transfer(server.transfers, conn, request, server.limits["chunk"], server.telemetry)
            await close_quietly(conn)
            return
        lane = pl.decode_first(request)
        if lane is not None:
            if trust is not None:
                trust()
            await serve_lane(server, conn, lane)
            await close_quietly(conn)
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
        await close_quietly(conn)
        return
    trust = getattr(conn, "trust", None)
    if trust is not None:
        trust()
    pull = getattr(conn, "pull", None)  # (TCP: the pump reads each frame itself, a loop turn sooner)
    if pull is not None:
        pull()
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
        await close_quietly(conn)
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
    keep_hot = getattr(session.loop, "keep_hot", None)  # a peer process's own loop (transport/spin.py)
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
            session.handled += 1
            continue
        first = batch[0]
        if len(batch) == 1 and first[0] == m.PING:
            session.post(codec.packb([[first[1] if len(first) > 1 else 0, m.OK, None]]))
            session.handled += 1
            continue
        if len(batch) == 1 and first[0] == m.STATS:  # answered at once, even while the worker is busy
            resp = server.figures.answer(session, first)
            if resp is not None:
                session.post(codec.packb([resp]))
            session.handled += 1
            continue
        if first[0] == m.EXPOSE:  # sent alone: downloads may wait for the worker to reach it
            for msg in batch:
                if msg[0] == m.EXPOSE and len(msg) == 6:
                    server.transfers.announce(msg[2], msg[5])
        inline = session.submit(batch, len(frame))
        session.handled += 1  # (run, or counted in session.queued: Session.direct may go once both settle)
        now, session.now = session.now, None
        if now:  # its one answer, sent from here: no wake-up of the sender task for it
            await _send_marked(session, now[0])
        if inline and not session.sending:
            await _send_now(session)
        if keep_hot is not None:
            if not inline:
                session.loop.cool()  # type: ignore[attr-defined]  # (the worker's Python needs the GIL)
            elif _workers_idle(server):
                keep_hot()  # the client's next small request is likely near: wait for it without sleeping
        if batch[-1][0] == m.CLOSE:
            session.end = ["client_closed", "closed by the client"]
            return
    if sender.done():
        session.end = ["lost", "the connection broke while sending"]


def _workers_idle(server: SessionHost) -> bool:
    """No session's worker has a batch (a loop polling without sleeping would take the GIL from its
    Python); only judged for a few sessions (else: not idle)."""
    live = server.live
    if len(live) > _HOT_SESSIONS:
        return False
    return all(s.queued == s.done for s in list(live))


#: Above this many sessions the loop never polls hot (it has work enough, and judging costs a pass).
_HOT_SESSIONS = 16


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



__all__ = ["drive_session", "end_session", "Session", "SessionHost", "AuthorizationError"]
