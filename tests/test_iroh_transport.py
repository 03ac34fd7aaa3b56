"""The iroh transport over real loopback endpoints (offline: no relays, no discovery)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import time
from typing import Any, AsyncIterator, Awaitable, Callable

import iroh
import msgpack
import pytest

from ember.errors import ConnectError, LimitExceeded
from ember.transport import iroh as T
from ember.transport.iroh_conn import describe_stream_error
from ember.transport.iroh_endpoint import bind_endpoint

LOOPBACK = ["127.0.0.1:0", "[::1]:0"]


@pytest.fixture(autouse=True)
def _offline_client() -> None:
    T.configure_client(offline=True, bind=LOOPBACK)


def run(coro: Awaitable[Any], timeout: float = 30.0) -> Any:
    async def main() -> Any:
        try:
            return await asyncio.wait_for(coro, timeout)
        finally:
            await T.close_client()
    return asyncio.run(main())


async def echo(conn: Any) -> None:
    while True:
        f = await conn.recv()
        if f is None:
            return
        await conn.send(f)


@contextlib.asynccontextmanager
async def serving(handler: Callable[[Any], Awaitable[None]] = echo, **kw: Any) -> AsyncIterator[T.IrohListener]:
    lst = T.IrohListener(offline=True, bind=LOOPBACK, **kw)
    await lst.start(handler)
    try:
        yield lst
    finally:
        await lst.stop()


@pytest.mark.timeout(60)
def test_echo_frames_of_many_sizes() -> None:
    sizes = [0, 1, 2, 3, 4, 5, 255, 4096, 65535, 65536, 65537, 1 << 20, (1 << 20) + 7, 3 * (1 << 20) + 1]

    async def go() -> None:
        async with serving() as lst:
            c = await T.dial(lst.ticket)
            for n in sizes:
                data = os.urandom(n)
                for frame in (data, bytearray(data), memoryview(data)):
                    await c.send(frame)
                    assert await c.recv() == data
            await c.close()
    run(go(), 50)


@pytest.mark.timeout(30)
def test_pipelined_frames_arrive_in_order() -> None:
    async def go() -> None:
        async with serving() as lst:
            c = await T.dial(lst.ticket)
            frames = [i.to_bytes(4, "big") * (i % 7) for i in range(300)]
            for f in frames:
                await c.send(f)
            got = [await c.recv() for _ in frames]
            assert got == frames
            await c.close()
    run(go())


@pytest.mark.timeout(30)
def test_listener_reports_what_serve_prints() -> None:
    async def go() -> None:
        async with serving() as lst:
            assert len(lst.peer_id) == 64 and int(lst.peer_id, 16) >= 0
            assert lst.ticket.startswith("endpoint") and lst.addresses == [lst.ticket]
            assert lst.relay_mode == "offline"
            assert lst.relay_url is None
            hosts = {a.rsplit(":", 1)[0] for a in lst.direct_addresses}
            assert hosts <= {"127.0.0.1", "[::1]"} and hosts
            sockets = lst.endpoint.bound_sockets()
            assert all(s.startswith(("127.0.0.1:", "[::1]:")) for s in sockets), sockets
    run(go())


@pytest.mark.timeout(30)
def test_two_sessions_share_one_connection_and_peer_ids_are_authenticated() -> None:
    seen: list[Any] = []

    async def handler(conn: Any) -> None:
        seen.append(conn)
        await echo(conn)

    async def go() -> None:
        async with serving(handler) as lst:
            a = await T.dial(lst.ticket)
            b = await T.dial(lst.ticket)
            assert a.connection_id == b.connection_id
            assert a.peer_id == b.peer_id == lst.peer_id
            await a.send(b"to a")
            await b.send(b"to b")
            assert await b.recv() == b"to b"
            assert await a.recv() == b"to a"
            me = await T.client_peer_id()
            assert [c.peer_id for c in seen] == [me, me]
            assert seen[0].kind == "session"
            await a.close()
            await b.send(b"still here")
            assert await b.recv() == b"still here"
            await b.close()
    run(go())


@pytest.mark.timeout(30)
def test_clean_close_both_ways() -> None:
    async def server_closes(conn: Any) -> None:
        await conn.send(b"bye")
        await conn.close()

    async def go() -> None:
        async with serving(server_closes) as lst:
            c = await T.dial(lst.ticket)
            assert await c.recv() == b"bye"
            assert await c.recv() is None
            assert await c.recv() is None
            await c.close()
            await c.close()  # idempotent
            with pytest.raises(ConnectionError):
                await c.send(b"x")
    run(go())


@pytest.mark.timeout(30)
def test_recv_is_cancel_safe() -> None:
    async def slow(conn: Any) -> None:
        await conn.recv()
        await asyncio.sleep(0.3)
        await conn.send(b"A" * 200_000)
        await conn.send(b"B")
        await conn.recv()

    async def go() -> None:
        async with serving(slow) as lst:
            c = await T.dial(lst.ticket)
            await c.send(b"go")
            timeouts = 0
            while True:
                try:
                    first = await asyncio.wait_for(c.recv(), 0.01)
                    break
                except asyncio.TimeoutError:
                    timeouts += 1
            assert timeouts > 3
            assert first == b"A" * 200_000
            assert await c.recv() == b"B"
            await c.close()
    run(go())


@pytest.mark.timeout(30)
def test_transfer_streams_go_to_the_transfer_hook() -> None:
    got: list[tuple[str, bytes]] = []

    async def on_transfer(conn: Any) -> None:
        data = await conn.recv()
        got.append((conn.kind, data))
        await conn.send(b"ok:" + data)

    async def go() -> None:
        async with serving(transfer_handler=on_transfer) as lst:
            t = await T.dial(lst.ticket, kind="transfer")
            await t.send(b"payload")
            assert await t.recv() == b"ok:payload"
            await t.close()
            s = await T.dial(lst.ticket)  # sessions still go to the session handler
            await s.send(b"echo")
            assert await s.recv() == b"echo"
            await s.close()
        async with serving() as lst:  # no transfer hook: the stream is refused clearly
            t = await T.dial(lst.ticket, kind="transfer")
            with pytest.raises(ConnectionError, match="does not serve"):
                await asyncio.wait_for(t.recv(), 5)
    run(go())
    assert got == [("transfer", b"payload")]


async def _raw_stream(ticket: str, alpn: bytes = T.ALPN) -> tuple[Any, Any, Any]:
    ep = await bind_endpoint(offline=True, bind=LOOPBACK)
    conn = await ep.connect(iroh.EndpointTicket.from_string(ticket).endpoint_addr(), alpn)
    bi = await conn.open_bi()
    return ep, conn, bi


@pytest.mark.timeout(40)
@pytest.mark.parametrize("garbage, reason", [
    (b"\xff\xff\xff\xff" + b"x" * 16, "rejected the stream header"),     # absurd length
    (b"\x00\x00\x00\x03abc", "rejected the stream header"),               # not msgpack map
    (len(msgpack.packb({"kind": "nope", "version": 1})).to_bytes(4, "big")
     + msgpack.packb({"kind": "nope", "version": 1}), "rejected the stream header"),
    (len(msgpack.packb({"kind": "session", "version": 9})).to_bytes(4, "big")
     + msgpack.packb({"kind": "session", "version": 9}), "stream version"),
])
def test_garbage_headers_do_not_hurt_the_listener(garbage: bytes, reason: str) -> None:
    handled: list[Any] = []

    async def handler(conn: Any) -> None:
        handled.append(conn)
        await echo(conn)

    async def go() -> None:
        async with serving(handler) as lst:
            ep, conn, bi = await _raw_stream(lst.ticket)
            await bi.send().write_all(garbage)
            with pytest.raises(iroh.IrohError) as ei:
                await asyncio.wait_for(bi.recv().read(10), 5)
            assert reason in describe_stream_error(ei.value)
            await ep.close()
            c = await T.dial(lst.ticket)  # the listener is fine
            await c.send(b"alive")
            assert await c.recv() == b"alive"
            await c.close()
    run(go())
    assert len(handled) == 1


@pytest.mark.timeout(30)
def test_silent_stream_times_out_at_the_header() -> None:
    async def go() -> None:
        async with serving(header_timeout=0.3) as lst:
            ep, conn, bi = await _raw_stream(lst.ticket)
            await bi.send().write_all(b"\x00\x00")  # half a length prefix, then nothing
            with pytest.raises(iroh.IrohError):
                await asyncio.wait_for(bi.recv().read(10), 5)
            await ep.close()
    run(go())


@pytest.mark.timeout(30)
def test_frame_limits() -> None:
    async def go() -> None:
        async with serving(max_frame=1024) as lst:
            c = await T.dial(lst.ticket, max_frame=1024)
            with pytest.raises(LimitExceeded):
                await c.send(b"x" * 1025)  # refused locally, the stream stays usable
            await c.send(b"y" * 1024)
            assert await c.recv() == b"y" * 1024
            await c.close()
            c = await T.dial(lst.ticket)  # this client allows more than the server
            await c.send(b"z" * 5000)
            with pytest.raises(ConnectionError):
                await asyncio.wait_for(c.recv(), 5)
    run(go())


@pytest.mark.timeout(30)
def test_dial_wrong_alpn_is_a_clear_error() -> None:
    async def go() -> None:
        other = await bind_endpoint(offline=True, bind=LOOPBACK, alpns=[b"not-ember/1"])
        ticket = str(iroh.EndpointTicket.from_addr(other.addr()))

        async def accept() -> None:
            while (inc := await other.accept_next()) is not None:
                with contextlib.suppress(Exception):
                    await (await inc.accept()).connect()
        task = asyncio.ensure_future(accept())
        t = time.monotonic()
        with pytest.raises(ConnectError, match="does not speak Ember") as ei:
            await T.dial(ticket, timeout=10)
        assert time.monotonic() - t < 5
        assert str(other.id()) in str(ei.value)
        task.cancel()
        await other.close()
    run(go())


@pytest.mark.timeout(30)
def test_dial_unknown_peer_id_at_a_live_address_fails_fast() -> None:
    async def go() -> None:
        async with serving() as lst:
            stranger = iroh.SecretKey.generate().public()
            addr = iroh.EndpointAddr(stranger, None, lst.direct_addresses)
            ticket = str(iroh.EndpointTicket.from_addr(addr))
            t = time.monotonic()
            with pytest.raises(ConnectError, match="wrong peer") as ei:
                await T.dial(ticket, timeout=10)
            assert time.monotonic() - t < 5
            assert str(stranger) in str(ei.value)
    run(go())


@pytest.mark.timeout(30)
def test_dial_timeout_names_peer_and_addresses() -> None:
    async def go() -> None:
        silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        silent.bind(("127.0.0.1", 0))
        try:
            peer = iroh.SecretKey.generate().public()
            where = f"127.0.0.1:{silent.getsockname()[1]}"
            ticket = str(iroh.EndpointTicket.from_addr(iroh.EndpointAddr(peer, None, [where])))
            t = time.monotonic()
            with pytest.raises(ConnectError, match="timed out") as ei:
                await T.dial(ticket, timeout=1.0)
            assert time.monotonic() - t < 3
            assert str(peer) in str(ei.value) and where in str(ei.value)
        finally:
            silent.close()
    run(go())


@pytest.mark.timeout(30)
def test_dial_refused_connection() -> None:
    async def go() -> None:
        ep = await bind_endpoint(offline=True, bind=LOOPBACK)

        async def refuse() -> None:
            while (inc := await ep.accept_next()) is not None:
                await inc.refuse()
        task = asyncio.ensure_future(refuse())
        ticket = str(iroh.EndpointTicket.from_addr(ep.addr()))
        with pytest.raises(ConnectError, match="refused"):
            await T.dial(ticket, timeout=5)
        task.cancel()
        await ep.close()
    run(go())


@pytest.mark.timeout(20)
def test_bare_peer_id_offline_needs_a_ticket_and_bad_addresses() -> None:
    async def go() -> None:
        pid = str(iroh.SecretKey.generate().public())
        with pytest.raises(ConnectError, match="ticket"):
            await T.dial(pid, offline=True)
        with pytest.raises(ConnectError, match="invalid iroh ticket"):
            await T.dial("endpointNOTATICKET")
        with pytest.raises(ConnectError, match="not an iroh address"):
            await T.dial("ws://127.0.0.1:1")
    run(go())
    assert T.is_iroh_address("a" * 64) and T.is_iroh_address("endpointabc")
    assert not T.is_iroh_address("ws://x:1") and not T.is_iroh_address("local")


async def _ended(conn: Any) -> None:
    """The stream ends (cleanly or not) within 5 s."""
    try:
        assert await asyncio.wait_for(conn.recv(), 5) is None
    except ConnectionError:
        pass


@pytest.mark.timeout(30)
def test_reconnects_after_the_shared_connection_closes() -> None:
    async def go() -> None:
        key = os.urandom(32)
        lst = T.IrohListener(offline=True, bind=LOOPBACK, key=key)
        await lst.start(echo)
        c = await T.dial(lst.ticket)
        first = c.connection_id
        await lst.stop()
        await _ended(c)
        lst2 = T.IrohListener(offline=True, bind=LOOPBACK, key=key)  # same identity, new ports
        await lst2.start(echo)
        assert lst2.peer_id == lst.peer_id
        c2 = await T.dial(lst2.ticket)
        assert c2.connection_id != first
        await c2.send(b"again")
        assert await c2.recv() == b"again"
        await c2.close()
        await lst2.stop()
    run(go())


@pytest.mark.timeout(30)
def test_stop_ends_open_sessions_promptly() -> None:
    async def go() -> None:
        lst = T.IrohListener(offline=True, bind=LOOPBACK)
        await lst.start(echo)
        c = await T.dial(lst.ticket)
        await c.send(b"x")
        assert await c.recv() == b"x"
        t = time.monotonic()
        await lst.stop()
        assert time.monotonic() - t < 5
        await _ended(c)
        t = time.monotonic()
        await c.close()
        assert time.monotonic() - t < 3
    run(go())


_KILLABLE = r"""
import asyncio, sys
from ember.transport import iroh as T
async def echo(c):
    while (f := await c.recv()) is not None:
        await c.send(f)
async def main():
    lst = T.IrohListener(offline=True, bind=["127.0.0.1:0", "[::1]:0"])
    await lst.start(echo)
    print(lst.ticket, flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""


@pytest.mark.timeout(90)
def test_sigkilled_peer_fails_reads_eventually_and_close_never_hangs() -> None:
    proc = subprocess.Popen([sys.executable, "-c", _KILLABLE], stdout=subprocess.PIPE, text=True)
    try:
        ticket = proc.stdout.readline().strip()  # type: ignore[union-attr]
        assert ticket.startswith("endpoint")

        async def go() -> float:
            c = await T.dial(ticket)
            await c.send(b"ping")
            assert await c.recv() == b"ping"
            pending = asyncio.ensure_future(c.recv())
            proc.kill()
            proc.wait(10)
            t = time.monotonic()
            with pytest.raises(ConnectionError):
                await asyncio.wait_for(pending, 60)
            took = time.monotonic() - t
            t2 = time.monotonic()
            await c.close()
            assert time.monotonic() - t2 < 3
            return took
        took = run(go(), 80)
        assert took < 60
    finally:
        proc.kill()
        proc.wait(10)
