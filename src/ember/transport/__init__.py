"""Transports move frames; they know no tensors. ``dial`` picks one by address form."""

from __future__ import annotations

import re
import ssl

from ..errors import ConnectError
from .base import FrameConnection, Listener, SessionHandler

_PEER_ID = re.compile(r"^[0-9a-f]{64}$")


def uses_tls(address: str) -> bool:
    """Does ``address`` name a TLS transport (``wss://``, ``tcps://``)?"""
    return address.startswith(("wss://", "tcps://"))


def is_iroh_address(address: str) -> bool:
    return address.startswith("endpoint") or bool(_PEER_ID.match(address))


async def dial(address: str, *, timeout: float, max_frame: int, kind: str = "session",
               tls: ssl.SSLContext | None = None) -> FrameConnection:
    """Open a stream of ``kind`` (session / transfer) to ``address`` (``ws://`` or ``tcp://`` URL,
    iroh ticket or peer id).

    Over WebSocket and TCP a stream's kind is told by its first frame; over iroh by the stream header.
    """
    if address.startswith(("ws://", "wss://")):
        from . import websocket
        return await websocket.dial(address, timeout=timeout, max_frame=max_frame, ssl=tls)
    if address.startswith(("tcp://", "tcps://")):
        from . import tcp
        return await tcp.dial(address, timeout=timeout, max_frame=max_frame + 65536, ssl=tls)
    if is_iroh_address(address):
        from . import iroh
        return await iroh.dial(address, timeout=timeout, kind=kind, max_frame=max_frame + 65536)
    raise ConnectError(f"cannot tell what kind of address {address!r} is",
                       hint='use "local", "ws://HOST:PORT", "tcp://HOST:PORT", or the endpoint… ticket that `ember serve` prints')


__all__ = ["FrameConnection", "Listener", "SessionHandler", "dial", "is_iroh_address", "uses_tls"]
