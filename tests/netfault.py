"""A loopback proxy that can silently drop traffic (TCP for WebSocket, UDP for iroh).

Tests route a client through :class:`DroppingProxy` and flip ``dropping`` to
simulate a link that loses every packet without closing anything (a pulled
cable, a dead Wi-Fi, a firewall that starts dropping): bytes and datagrams are
read and discarded in both directions, connections stay open. Loopback only.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any


class DroppingProxy:
    """``DroppingProxy("tcp" | "udp", target_port)``; ``.port`` is where clients connect."""

    def __init__(self, kind: str, target_port: int, host: str = "127.0.0.1") -> None:
        assert kind in ("tcp", "udp")
        self.kind, self.target = kind, (host, target_port)
        self.host = host
        self.dropping = False
        self.dropped = 0  # bytes discarded
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._closers: list[Any] = []
        self._thread = threading.Thread(target=self._run, name=f"proxy-{kind}", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("proxy did not start")

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._start())
        self._ready.set()
        self._loop.run_forever()

    async def _start(self) -> None:
        if self.kind == "tcp":
            srv = await asyncio.start_server(self._tcp_client, self.host, 0)
            self.port = srv.sockets[0].getsockname()[1]
            self._closers.append(srv)
        else:
            loop = asyncio.get_running_loop()
            transport, _ = await loop.create_datagram_endpoint(lambda: _Front(self), local_addr=(self.host, 0))
            self.port = transport.get_extra_info("sockname")[1]
            self._closers.append(transport)

    # ---- TCP ------------------------------------------------------------------------------
    async def _tcp_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        self._closers += [writer, up_w]
        await asyncio.gather(self._pipe(reader, up_w), self._pipe(up_r, writer), return_exceptions=True)
        for w in (writer, up_w):
            w.close()

    async def _pipe(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            data = await r.read(65536)
            if not data:
                return
            if self.dropping:
                self.dropped += len(data)
                continue
            w.write(data)
            await w.drain()

    def close(self) -> None:
        def stop() -> None:
            for c in self._closers:
                try:
                    c.close()
                except Exception:
                    pass
            self._loop.stop()
        self._loop.call_soon_threadsafe(stop)
        self._thread.join(5)


class _Front(asyncio.DatagramProtocol):
    """The client-facing UDP socket: one upstream socket per client address."""

    def __init__(self, proxy: DroppingProxy) -> None:
        self.proxy = proxy
        self.transport: Any = None
        self.upstream: dict[Any, Any] = {}

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr: Any) -> None:
        p = self.proxy
        if p.dropping:
            p.dropped += len(data)
            return
        up = self.upstream.get(addr)
        if up is None:
            asyncio.ensure_future(self._open(addr, data))
            return
        up.sendto(data)

    async def _open(self, addr: Any, first: bytes) -> None:
        loop = asyncio.get_running_loop()
        front = self

        class Back(asyncio.DatagramProtocol):
            def datagram_received(self, data: bytes, _src: Any) -> None:
                if front.proxy.dropping:
                    front.proxy.dropped += len(data)
                    return
                front.transport.sendto(data, addr)

        if addr in self.upstream:
            self.upstream[addr].sendto(first)
            return
        transport, _ = await loop.create_datagram_endpoint(Back, remote_addr=self.proxy.target)
        self.upstream[addr] = transport
        self.proxy._closers.append(transport)
        transport.sendto(first)
