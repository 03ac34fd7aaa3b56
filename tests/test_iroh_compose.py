"""An application that owns an iroh endpoint mounts Ember beside its own protocol."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import iroh
import pytest
from iroh import iroh_ffi

from ember.transport import iroh as T
from ember.transport.iroh_endpoint import bind_endpoint

APP_ALPN = b"myapp/1"
LOOPBACK = ["127.0.0.1:0", "[::1]:0"]


class Shout(iroh.ProtocolHandler):
    """The application's own protocol: upper-cases one message per stream."""

    async def accept(self, conn: Any) -> None:
        bi = await conn.accept_bi()
        data = await bi.recv().read_to_end(1024)
        await bi.send().write_all(data.upper())
        await bi.send().finish()
        await conn.closed()

    async def shutdown(self) -> None:
        return None


class ShoutCreator(iroh.ProtocolCreator):
    def create(self, endpoint: Any) -> Shout:
        return Shout()


@pytest.fixture(autouse=True)
def _reset_global_loop() -> Any:
    yield
    iroh_ffi.uniffi_set_event_loop(None)  # type: ignore[arg-type]


@pytest.mark.timeout(60)
def test_mount_ember_beside_an_application_protocol() -> None:
    T.configure_client(offline=True, bind=LOOPBACK)
    sessions: list[Any] = []

    async def handler(conn: Any) -> None:
        sessions.append(conn.peer_id)
        while (f := await conn.recv()) is not None:
            await conn.send(b"ember:" + f)

    async def go() -> None:
        protocols = {APP_ALPN: ShoutCreator(), **T.mount(handler)}
        ep = await bind_endpoint(offline=True, bind=LOOPBACK, alpns=None, protocols=protocols)
        try:
            ticket = str(iroh.EndpointTicket.from_addr(ep.addr()))
            # Ember over the shared endpoint
            c = await T.dial(ticket)
            await c.send(b"hi")
            assert await c.recv() == b"ember:hi"
            c2 = await T.dial(ticket)
            await c2.send(b"two")
            assert await c2.recv() == b"ember:two"
            await c.close()
            await c2.close()
            assert sessions == [await T.client_peer_id()] * 2
            # the application's own protocol on the same endpoint
            other = await bind_endpoint(offline=True, bind=LOOPBACK)
            conn = await other.connect(ep.addr(), APP_ALPN)
            bi = await conn.open_bi()
            await bi.send().write_all(b"hello")
            await bi.send().finish()
            assert await bi.recv().read_to_end(1024) == b"HELLO"
            conn.close(0, b"")
            await other.close()
        finally:
            await asyncio.wait_for(ep.close(), 5)
            await T.close_client()
    asyncio.run(asyncio.wait_for(go(), 50))


@pytest.mark.timeout(60)
def test_mount_does_not_break_other_loops() -> None:
    """uniffi's global event loop must not capture calls made on other loops."""
    T.configure_client(offline=True, bind=LOOPBACK)
    ready = threading.Event()
    done = threading.Event()
    holder: dict[str, Any] = {}

    def app_thread() -> None:
        async def main() -> None:
            async def handler(conn: Any) -> None:
                while (f := await conn.recv()) is not None:
                    await conn.send(f)
            ep = await bind_endpoint(offline=True, bind=LOOPBACK, alpns=None,
                                     protocols=T.mount(handler))
            holder["ticket"] = str(iroh.EndpointTicket.from_addr(ep.addr()))
            ready.set()
            while not done.is_set():
                await asyncio.sleep(0.02)
            await asyncio.wait_for(ep.close(), 5)
        asyncio.run(main())

    th = threading.Thread(target=app_thread, daemon=True)
    th.start()
    assert ready.wait(20)

    async def client() -> None:  # a different loop on a different thread
        try:
            c = await T.dial(holder["ticket"])
            await c.send(b"across loops")
            assert await c.recv() == b"across loops"
            await c.close()
        finally:
            await T.close_client()
    try:
        asyncio.run(asyncio.wait_for(client(), 30))
    finally:
        done.set()
        th.join(20)
