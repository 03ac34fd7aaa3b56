"""The transport seam: a transport only moves frames and names the peer.

A *frame* is an opaque byte string. Every transport gives the session pump the
same three verbs (Burn Remote's ``drive_session`` seam): send a frame, receive a
frame, and who is the peer. Adding a transport never touches session logic.
"""

from __future__ import annotations

from typing import Awaitable, Callable, Protocol, runtime_checkable


@runtime_checkable
class FrameConnection(Protocol):
    """One bidirectional, ordered, reliable stream of frames."""

    #: Authenticated identity of the remote peer (iroh: 64 hex chars), or None
    #: where the transport authenticates nobody (memory, WebSocket).
    peer_id: str | None
    #: Human-readable remote address, for messages.
    remote: str

    async def send(self, frame: bytes | bytearray | memoryview) -> None:
        """Send one frame. Raises ``ConnectionError`` once the link is gone."""

    async def recv(self) -> bytes | None:
        """Next frame; ``None`` when the peer closed the stream cleanly.

        Raises ``ConnectionError`` when the link broke.
        """

    async def close(self) -> None:
        """Close this stream. Idempotent."""


#: What a listener calls for each accepted session stream.
SessionHandler = Callable[[FrameConnection], Awaitable[None]]


class Listener(Protocol):
    """A bound server-side transport."""

    #: Addresses a client can pass to ``ember.connect`` (filled once started).
    addresses: list[str]

    async def start(self, handler: SessionHandler) -> None:
        """Bind and begin accepting; raise ``ember.errors.BindError`` on failure."""

    async def stop(self) -> None:
        """Stop accepting and close open connections."""
