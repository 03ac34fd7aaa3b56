"""In-memory link: two asyncio queues, used by the embedded ``local`` peer."""

from __future__ import annotations

import asyncio

from .base import Frame, frame_bytes


class MemoryConnection:
    """One end of an in-process frame link (same event loop on both ends)."""

    peer_id: str | None = None

    def __init__(self, inbox: asyncio.Queue, outbox: asyncio.Queue, remote: str) -> None:
        self._inbox = inbox
        self._outbox = outbox
        self._closed = False
        self.remote = remote

    async def send(self, frame: Frame) -> None:
        self.send_nowait(frame)

    def send_nowait(self, frame: Frame) -> None:
        """Send at once (the link never blocks): the client's loop sends a read here, a task switch sooner."""
        if self._closed:
            raise ConnectionError("memory link closed")
        self._outbox.put_nowait(frame_bytes(frame))  # a copy: the sender may change its buffers

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
    return MemoryConnection(a, b, name), MemoryConnection(b, a, "local-client")
