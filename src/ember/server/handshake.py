"""A stream's first frame, judged: a Hello (Welcome or Reject, :func:`handshake`), a lane's
attach to its session (:func:`serve_lane`), or a transfer request (:func:`first_map` tells them apart).
The session pump (``server/session.py``) calls these before a session exists."""

from __future__ import annotations

import logging
from typing import Any

from ..errors import ProtocolError
from ..protocol import codec
from ..protocol import messages as m
from ..transport.base import FrameConnection
from .host import SessionHost
from .lanes import serve_transfer_lane

log = logging.getLogger("ember.server")

__all__ = ["handshake", "refuse", "first_map", "serve_lane"]


async def handshake(server: SessionHost, conn: FrameConnection, first: bytes,
                     identity: str) -> dict[str, Any] | None:
    """Judge Hello; answer Reject and return None when refused.

    A Hello marked ``admin`` (``ember top`` / ``ember status``) is judged by the server's admin
    check (admin token or allowlisted iroh peer id) instead of its authorizer.
    """
    try:
        hello = codec.decode_hello(first)
    except ProtocolError as e:
        return await refuse(server, conn, m.REJECT_PROTOCOL, e.message)
    if hello["protocol"] != m.PROTOCOL_VERSION:
        reason = (f"protocol version mismatch: the client speaks version {hello['protocol']}, "
                  f"this peer speaks version {m.PROTOCOL_VERSION}")
        return await refuse(server, conn, m.REJECT_VERSION, reason, server_protocol=m.PROTOCOL_VERSION)
    n = len(server.backends)
    if not 0 <= hello["device"] < n:
        return await refuse(server, conn, m.REJECT_DEVICE,
                             f"no device {hello['device']}: this peer hosts {n} device(s) (indices 0..{n - 1})",
                             device_count=n)
    if hello.get("admin"):
        reason = server.authorize_admin(conn.peer_id, hello["credential"])
    else:
        reason = server.authorize(conn.peer_id, hello["device"], hello["credential"])
    if reason is not None:
        server.admission.refusals["unauthorized"] += 1
        return await refuse(server, conn, m.REJECT_UNAUTHORIZED, reason)
    if hello["session_id"] in server.sessions:
        return await refuse(server, conn, m.REJECT_PROTOCOL,
                             "this session id is already in use on this peer (ids must be random)")
    refusal = None if hello.get("admin") else server.admission.refuse(identity, len(server.sessions))
    if refusal is not None:  # (an operator may look at a full peer)
        return await refuse(server, conn, *refusal)
    return hello


async def refuse(server: SessionHost, conn: FrameConnection, code: str, reason: str, **extra: Any) -> None:
    # the session log (server/telemetry/session_log.py) reports every refusal; a version mismatch also warns here
    log.log(logging.WARNING if code == m.REJECT_VERSION else logging.DEBUG, "refused %s (%s): %s",
            conn.peer_id or conn.remote, code, reason)
    server.telemetry.session_refused(conn.peer_id, conn.remote, code, reason)
    await conn.send(codec.encode_reject(code, reason, **extra))


def first_map(first: bytes) -> dict[str, Any] | None:
    """The first frame of a stream as a map with a ``type`` (a transfer request, a lane's attach), or
    None for anything else (a Hello is judged by the handshake, garbage too)."""
    try:
        d = codec.unpackb(first, max_frame=1 << 16)
    except ProtocolError:
        return None
    return d if isinstance(d, dict) and d.get("type") in ("transfer", "lane", "transfer_lane", "ping") else None


async def serve_lane(server: SessionHost, conn: FrameConnection, lane: tuple[str, bytes, Any]) -> None:
    """A stream that asks to be a lane: of a session (attached if its key and peer are right), or of
    a download (stripe ``index``)."""
    kind, first, second = lane
    if kind == "transfer_lane":
        await serve_transfer_lane(server.transfers.lanes, conn, first, second)
        return
    session = server.sessions.get(first)
    reason = "no session with lanes by that id on this peer" if session is None or session.lanes is None \
        else session.lanes.refusal(conn, second)
    if reason is not None:
        log.info("lane from %s refused: %s", conn.peer_id or conn.remote, reason)
        await conn.send(codec.packb({"type": "denied", "reason": reason}))
        return
    assert session is not None and session.lanes is not None
    await session.lanes.serve(conn)
