"""In-memory link: two asyncio queues, used by the embedded ``local`` peer.

Besides the frames, the link offers its client a shortcut: ``direct(frame)`` hands a request
frame to the server end's ``direct_handler`` (``Session.direct``), which runs it on the calling
thread and returns the answers when the session is idle, or None (then the frame goes the
ordinary way). ``sent`` counts the frames this end put on the link, so the server can tell that
every earlier frame has been handled first.
"""

from __future__ import annotations

import asyncio
from typing import Callable

from .base import Frame, frame_bytes


class MemoryConnection:
    """One end of an in-process frame link (same event loop on both ends)."""

    peer_id: str | None = None

    def __init__(self, inbox: asyncio.Queue, outbox: asyncio.Queue, remote: str) -> None:
        self._inbox = inbox
        self._outbox = outbox
        self._closed = False
        self.remote = remote
        self.sent = 0  # frames put on the link (read by the other end's direct handler)
        self.peer: MemoryConnection | None = None  # the other end
        #: On a server end: ``handler(frame, sent) -> answers | None`` (see the module's docstring).
        self.direct_handler: Callable[[bytes, int], list[bytes] | None] | None = None

    async def send(self, frame: Frame) -> None:
        self.send_nowait(frame)

    def send_nowait(self, frame: Frame) -> None:
        """Send at once (the link never blocks): the client's loop sends a read here, a task switch sooner."""
        if self._closed:
            raise ConnectionError("memory link closed")
        self.sent += 1  # (counted first: a frame on the link is never "handled" before it is counted)
        self._outbox.put_nowait(frame_bytes(frame))  # a copy: the sender may change its buffers

    def direct(self, frame: bytes) -> list[bytes] | None:
        """Run ``frame`` at the other end on this thread and return its answers, or None (not now)."""
        peer = self.peer
        handler = peer.direct_handler if peer is not None else None
        if handler is None or self._closed or peer._closed:
            return None
        return handler(frame, self.sent)

    async def recv(self) -> bytes | None:
        if self._closed:
            return None
        frame = await self._inbox.get()
        if frame is None:
            self._closed = True
        return frame

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._outbox.put_nowait(None)


def memory_pair(name: str = "local") -> tuple[MemoryConnection, MemoryConnection]:
    """Return (client end, server end) of a new link."""
    a: asyncio.Queue = asyncio.Queue()
    b: asyncio.Queue = asyncio.Queue()
    client, server = MemoryConnection(a, b, name), MemoryConnection(b, a, "local-client")
    client.peer, server.peer = server, client
    return client, server
