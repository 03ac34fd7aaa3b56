"""WebSocket transport (the ``websockets`` library): one binary message per frame."""

from __future__ import annotations

import asyncio
import ipaddress
import ssl as _ssl
from typing import Any

import websockets
from websockets.asyncio.client import connect as ws_connect
from websockets.asyncio.server import ServerConnection, serve

from ..errors import ConnectError
from .base import PRE_AUTH_FRAME, Frame, SessionHandler, bind_error, frame_parts


def is_loopback(host: str) -> bool:
    """Is ``host`` (an IP literal or ``localhost``) reachable from this host only?"""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


#: Seconds a closing WebSocket waits for the other side's close frame.
CLOSE_TIMEOUT = 2.0

#: Frames a server connection buffers before it stops reading the socket (TCP back-pressure).
SERVER_QUEUE = 4


def _ws_options(max_frame: int) -> dict[str, Any]:
    # Compression off (tensor bytes don't compress, and it costs CPU); Ember runs
    # its own heartbeat, so the library's pings are off too. A close waits at most
    # CLOSE_TIMEOUT for the other side's answer (the library's 10 s held a server's
    # stop that long per silent peer).
    return {"max_size": max_frame + 4096, "compression": None, "ping_interval": None,
            "max_queue": 64, "write_limit": 1 << 20, "close_timeout": CLOSE_TIMEOUT}


class WebSocketConnection:
    """A FrameConnection over one WebSocket."""

    peer_id: str | None = None

    def __init__(self, ws: Any, remote: str) -> None:
        self._ws = ws
        self.remote = remote
        self.full_size: int | None = None

    async def send(self, frame: Frame) -> None:
        try:
            if isinstance(frame, (bytes, bytearray, memoryview)):
                await self._ws.send(frame)
            else:  # a gathered frame: one fragmented message, no join on this side
                await self._ws.send(frame_parts(frame))
        except websockets.ConnectionClosed as e:
            raise ConnectionError(f"WebSocket to {self.remote} closed: {e}") from None

    async def recv(self) -> bytes | None:
        try:
            msg = await self._ws.recv()
        except websockets.ConnectionClosedOK:
            return None
        except websockets.ConnectionClosed as e:
            raise ConnectionError(f"WebSocket to {self.remote} broke: {e}") from None
        return msg.encode() if isinstance(msg, str) else msg

    def trust(self) -> None:
        """The peer accepted this connection's first frame: full-size frames from now on (a server's
        connection reads frames no larger than ``PRE_AUTH_FRAME`` until then)."""
        if self.full_size is not None:
            self._ws.protocol.max_message_size = self.full_size

    async def close(self) -> None:
        await self._ws.close()


class WebSocketListener:
    """Serves sessions on ``ws://host:port`` (``wss://`` when given an SSL context)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, max_frame: int,
                 ssl: _ssl.SSLContext | None = None) -> None:
        self.host, self.port, self.max_frame, self.ssl = host, port, max_frame, ssl
        self.addresses: list[str] = []
        self._server: Any = None

    async def start(self, handler: SessionHandler) -> None:
        async def on_connect(ws: ServerConnection) -> None:
            host, port = ws.remote_address[:2]
            conn = WebSocketConnection(ws, f"{host}:{port}")
            conn.full_size, ws.protocol.max_message_size = ws.protocol.max_message_size, PRE_AUTH_FRAME
            await handler(conn)

        try:
            # a peer reads a session's frames only as fast as its worker runs them (server/session.py):
            # the library's own buffer holds at most a few frames meanwhile, not 64 of up to max_frame
            self._server = await serve(on_connect, self.host, self.port, ssl=self.ssl,
                                       **{**_ws_options(self.max_frame), "max_queue": SERVER_QUEUE})
        except OSError as e:
            raise bind_error(e, f"{self.host}:{self.port}", "WebSocket", "--websocket") from None
        scheme = "wss" if self.ssl else "ws"
        for sock in self._server.sockets:
            host, port = sock.getsockname()[:2]
            self.addresses.append(f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}")

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            try:
                await asyncio.wait_for(self._server.wait_closed(), 5.0)
            except asyncio.TimeoutError:
                pass


async def dial(url: str, *, timeout: float, max_frame: int, ssl: _ssl.SSLContext | None = None) -> WebSocketConnection:
    """Open a WebSocket to ``url``; ConnectError names the address and suggests ``ember serve``."""
    try:
        ws = await asyncio.wait_for(ws_connect(url, ssl=ssl, open_timeout=timeout, **_ws_options(max_frame)),
                                    timeout)
    except asyncio.TimeoutError:
        raise ConnectError(f"no answer from {url} within {timeout:g} s",
                           hint="is the peer up and reachable? start one with `ember serve --websocket HOST:PORT`") from None
    except (OSError, websockets.InvalidURI, websockets.InvalidHandshake) as e:
        raise ConnectError(f"cannot connect to {url}: {e}",
                           hint="nothing is listening there? start a peer with `ember serve --websocket HOST:PORT`") from None
    return WebSocketConnection(ws, url)
