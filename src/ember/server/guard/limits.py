"""Per-client limits: what one client may ask of a peer, and who a client is.

Every limit has a default, a ``Server(...)`` keyword and an ``ember serve`` flag,
and every refusal carries its reason to the client (a ``Reject`` at the
handshake becomes ``ConnectError``; a refused op, upload or batch becomes
``LimitExceeded``):

====================  ===================  ==========================================
limit                 default              refusal
====================  ===================  ==========================================
sessions (total)      256                  Reject ``full``
sessions per client   32                   Reject ``limit`` (other clients still served)
handshake time        10 s                 connection closed (nothing was said)
concurrent uploads    8 per session        the upload's tensor is poisoned
tensors per session   262144               the op's outputs are poisoned
messages per batch    16384                the session ends with LimitExceeded
graph stall           10 s                 the session ends (a REPLAY waited for a
                                             GRAPH the client never sent)
client timeouts       300 s                FETCH / download waits are clamped
silence               300 s                the session ends (its client sent nothing
                                             while its worker was idle: a vanished host)
====================  ===================  ==========================================

A client is its authenticated iroh peer id, else the remote IP address
(WebSocket), else the transport's name (the in-memory link).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any


@dataclass
class ClientLimits:
    """The per-client limits of one peer (see the table above)."""

    max_sessions: int = 256
    max_sessions_per_client: int = 32     # 0: no per-client limit
    max_uploads: int = 8
    max_tensors: int = 1 << 18
    max_messages: int = 16384
    handshake_timeout: float = 10.0
    stall_timeout: float = 10.0
    max_wait: float = 300.0
    idle_timeout: float = 300.0           # 0: a silent client keeps its session for ever
    max_inflight: int = 64 << 20          # bytes of decoded batches queued for a session's worker
    stage_window: int = 8 << 20           # bytes of encoded answers queued for the network per session

    def wire(self) -> dict[str, Any]:
        """What Welcome announces (the client refuses locally what would be refused anyway)."""
        return {"max_messages": self.max_messages, "max_uploads": self.max_uploads,
                "max_tensors": self.max_tensors, "max_wait": self.max_wait,
                "idle_timeout": self.idle_timeout}  # clients say something (a Ping) well within it


def client_identity(peer_id: str | None, remote: str) -> str:
    """Who a connection belongs to: the iroh peer id, else the remote IP, else the transport name."""
    if peer_id:
        return peer_id
    host, sep, port = remote.rpartition(":")
    if sep and port.isdigit():
        return host.strip("[]")
    return remote


#: Connections waiting for their first frame (before any login), in all and per client address.
MAX_PENDING = 1024
MAX_PENDING_PER_CLIENT = 64


class Admission:
    """Counts sessions per client and refusals per limit (all on the server's event loop)."""

    def __init__(self, limits: ClientLimits) -> None:
        self.limits = limits
        self.per_client: Counter[str] = Counter()
        self.refusals: Counter[str] = Counter()
        self.pending: Counter[str] = Counter()  # connections that sent no first frame yet, per client
        self.pending_total = 0

    def refuse(self, identity: str, total: int) -> tuple[str, str] | None:
        """(code, reason) when a new session of ``identity`` must be refused, else None."""
        lim = self.limits
        if total >= lim.max_sessions:
            self.refusals["max_sessions"] += 1
            return "full", (f"this peer is full ({lim.max_sessions} sessions, --max-sessions); try again later")
        n = self.per_client[identity]
        if lim.max_sessions_per_client and n >= lim.max_sessions_per_client:
            self.refusals["max_sessions_per_client"] += 1
            return "limit", (f"client {identity[:16]} already has {n} sessions on this peer, the most one client "
                             f"may have (--max-sessions-per-client {lim.max_sessions_per_client}); "
                             "close one (dev.close()) or reuse a device")
        return None

    def begin_pending(self, identity: str) -> bool:
        """May one more connection of ``identity`` wait for its first frame? (False: close it, unread.)"""
        if self.pending_total >= MAX_PENDING or self.pending[identity] >= MAX_PENDING_PER_CLIENT:
            self.refusals["pending"] += 1
            return False
        self.pending[identity] += 1
        self.pending_total += 1
        return True

    def end_pending(self, identity: str) -> None:
        self.pending_total -= 1
        self.pending[identity] -= 1
        if self.pending[identity] <= 0:
            del self.pending[identity]

    def opened(self, identity: str) -> None:
        self.per_client[identity] += 1

    def closed(self, identity: str) -> None:
        self.per_client[identity] -= 1
        if self.per_client[identity] <= 0:
            del self.per_client[identity]

    def stats(self) -> dict[str, Any]:
        return {"clients": dict(self.per_client), "refusals": dict(self.refusals)}


__all__ = ["ClientLimits", "Admission", "client_identity"]
