"""Raw TCP transport: length-prefixed frames on asyncio sockets, optional TLS.

Addresses: ``tcp://HOST:PORT`` (``tcps://HOST:PORT`` over TLS). The client opens with
the 4-byte preamble ``EMB`` + version (1); then both sides exchange frames, each a
4-byte big-endian length and the payload (the framing of the iroh transport). As over
WebSocket, a stream's kind (session or transfer) is told by its first frame, and the
session's Hello carries the credential the authorizer judges; TCP authenticates no peer
(``peer_id`` is None), TLS authenticates the server.

Plain TCP moves bulk data without copies in Python: a gathered frame (a header and a
view of an array) leaves with one ``sendmsg``, and a data frame's payload is read with
``recv_into`` straight into the buffer the data sink names (see ``transport.base``).
Small frames are parsed out of a 256 KiB staging buffer, so a burst of small frames costs
one system call. A read task reads ahead into a short queue; a server's session stream, once
trusted, is read by its consumer itself (``TcpConnection.pull``: one loop turn less per request). Sends hold no reference to the caller's buffers once they return:
``sendmsg`` either hands bytes to the kernel or waits for room. Over TLS the ``ssl``
module copies anyway; there the connection runs on asyncio streams. A client's plain
connection also lends itself to blocking round trips on the caller's thread while nothing
else is in flight (``transport.tcp_exchange``).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl as _ssl
from contextlib import suppress
from typing import Any

from ..errors import ConnectError, LimitExceeded
from ..protocol import codec
from ..protocol import messages as pm
from .base import PRE_AUTH_FRAME, DataSink, Frame, SessionHandler, bind_error, frame_parts
from .tcp_exchange import CalmLink
from .tcp_io import SocketIO, StreamIO, tune

log = logging.getLogger("ember.transport.tcp")

MAGIC = b"EMB"
VERSION = 1
PREAMBLE = MAGIC + bytes([VERSION])
_STAGE = 256 * 1024        # staging buffer for small frames
_DIRECT = 64 * 1024        # frames at least this large are read into their own buffer
_SMALL_SEND = 64 * 1024    # smaller frames are joined with their prefix and sent with one send()
_CLOSE_STEP = 1.0
_EOF = object()
_PULL = object()  # the read task's last item once the consumer reads itself (``TcpConnection.pull``)


def _ended(e: Exception, remote: str) -> ConnectionError:
    """What a read that failed with ``e`` tells the stream's consumer."""
    if isinstance(e, ConnectionError):
        return e
    if isinstance(e, (OSError, LimitExceeded)):
        return ConnectionError(str(e))
    return ConnectionError(f"{remote}: {e}")  # a malformed envelope


def parse_address(address: str) -> tuple[str, int, bool]:
    """``tcp://HOST:PORT`` or ``tcps://HOST:PORT`` -> (host, port, tls)."""
    scheme, sep, rest = address.partition("://")
    host, colon, port = rest.rstrip("/").rpartition(":")
    if not sep or scheme not in ("tcp", "tcps") or not colon or not port.isdigit() or not host:
        raise ConnectError(f"malformed TCP address {address!r}", hint="use tcp://HOST:PORT, e.g. tcp://127.0.0.1:7000")
    return host.strip("[]"), int(port), scheme == "tcps"


class TcpConnection:
    """A FrameConnection over one TCP (or TLS) connection."""

    peer_id: str | None = None
    #: A client's plain-TCP connection lends itself to round trips on a caller's thread while calm
    #: (``transport.tcp_exchange``); None on servers and over TLS.
    calm: CalmLink | None = None

    def __init__(self, io: Any, remote: str, *, max_frame: int, expect_preamble: bool = False) -> None:
        self.remote = remote
        # a server's connection holds a few KiB and reads one frame no larger than a Hello until the
        # peer trusts it (``trust``: after the handshake); a client's trusts its peer at once
        self.max_frame = PRE_AUTH_FRAME if expect_preamble else max_frame
        self._full_frame = max_frame
        self._trusted: asyncio.Event | None = asyncio.Event() if expect_preamble else None
        self._io = io
        self._q: asyncio.Queue = asyncio.Queue(maxsize=16)
        self._big = 0  # large frames (>= _DIRECT bytes) queued, not yet taken by recv
        self._taken = asyncio.Event()
        self._sink: DataSink | None = None
        self._lock = asyncio.Lock()
        self._closed = False
        self._broken: str | None = None
        self._stage = bytearray(PRE_AUTH_FRAME if expect_preamble else _STAGE)
        self._view = memoryview(self._stage)
        self._start = self._end = 0
        self._expect_preamble = expect_preamble
        self._pull = self._pulling = False  # (``pull``: asked for; the read task has handed over)
        self._pull_lock = asyncio.Lock()
        self._end_item: Any = None  # once pulling: how the stream ended (_EOF or the error)
        self._reader = asyncio.get_running_loop().create_task(self._read_loop())

    def trust(self) -> None:
        """The peer accepted this connection's first frame: full-size frames and staging from now on."""
        self.max_frame = self._full_frame
        if self._trusted is not None:
            self._trusted.set()

    def _grow_stage(self) -> None:
        stage = bytearray(_STAGE)
        n = self._end - self._start
        stage[:n] = self._view[self._start:self._end]
        self._stage, self._view, self._start, self._end = stage, memoryview(stage), 0, n

    def set_data_sink(self, sink: DataSink | None) -> None:
        """Read data-frame payloads into the buffers ``sink`` returns (see ``transport.base``)."""
        self._sink = sink

    # -- receiving ---------------------------------------------------------
    def _compact(self, k: int) -> None:
        """Room for ``k`` staged bytes from ``_start``: the staged bytes moved to the front when there is not."""
        if len(self._stage) - self._start < k:
            n = self._end - self._start
            self._view[:n] = self._view[self._start:self._end]
            self._start, self._end = 0, n

    async def _fill(self, k: int) -> bool:
        """At least ``k`` (<= _STAGE) bytes staged; False at a clean end before any of them."""
        if self._end - self._start >= k:
            return True
        self._compact(k)
        while self._end - self._start < k:
            r = await self._io.recv_into(self._view[self._end:])
            if not r:
                if self._end == self._start:
                    return False
                raise ConnectionError(f"{self.remote} ended the stream in the middle of a frame")
            self._end += r
        return True

    def _take(self, n: int) -> memoryview:
        v = self._view[self._start:self._start + n]
        self._start += n
        if self._start == self._end:
            self._start = self._end = 0
        return v

    async def _read_into(self, dest: memoryview) -> None:
        """Fill ``dest``: staged bytes first, then straight from the socket."""
        got = min(len(dest), self._end - self._start)
        if got:
            dest[:got] = self._take(got)
        recv_into, n = self._io.recv_into, len(dest)
        while got < n:
            r = await recv_into(dest[got:])
            if not r:
                raise ConnectionError(f"{self.remote} ended the stream in the middle of a frame")
            got += r

    async def _read_loop(self) -> None:
        try:
            if self._expect_preamble:
                if not await self._fill(4):
                    raise ConnectionError(f"{self.remote} sent nothing")
                got = bytes(self._take(4))
                if got[:3] != MAGIC:
                    raise ConnectionError(f"{self.remote} is not an Ember TCP client (preamble {got!r})")
                if got[3] != VERSION:
                    raise ConnectionError(f"{self.remote} speaks Ember TCP framing version {got[3]}, "
                                          f"this peer speaks version {VERSION}")
            while True:
                if self.calm is not None and self._start == self._end:
                    await self.calm.idle()  # (parked while a caller's thread has the link)
                if self._pull:  # from here on the consumer reads each frame itself (``pull``)
                    await self._put(_PULL)
                    return
                frame = await self._frame(True)
                if frame is _EOF:
                    await self._put(_EOF)
                    return
                if len(frame) >= _DIRECT:
                    self._big += 1
                await self._put(frame)
                if self._trusted is not None:  # the first frame: nothing more until it is judged
                    await self._trusted.wait()
                    self._trusted = None
                    self._grow_stage()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - broken, or a malformed envelope: the stream is unusable
            await self._put(_ended(e, self.remote))

    async def _frame(self, read_ahead: bool) -> Any:
        """The next frame (``_EOF`` at a clean end before it). ``read_ahead`` (the read task): a large
        frame waits until the reader took the one before, so nothing is buffered below back-pressure."""
        if not await self._fill(4):
            return _EOF
        n = int.from_bytes(self._take(4), "big")
        if n > self.max_frame:
            raise LimitExceeded(f"incoming frame of {n} bytes exceeds the limit of {self.max_frame} bytes")
        if n < _DIRECT:
            await self._fill(n)
            return bytes(self._take(n))
        while read_ahead and self._big:
            self._taken.clear()
            await self._taken.wait()
        frame = await self._read_data(n) if self._sink is not None else None
        if frame is None:
            buf = bytearray(n)
            await self._read_into(memoryview(buf))
            frame = buf
        return frame

    def pull(self) -> None:
        """A server's session stream, once trusted: its consumer reads each frame itself in ``recv`` (the
        read task hands over at the next frame boundary), a loop turn less per frame than through the read
        task's queue. Only the consumer's reads then take bytes off the socket: back-pressure as before."""
        self._pull = True

    async def _pulled(self) -> bytes | bytearray | None:
        """``recv`` once pulling: the next frame, read on the caller's task (one reader at a time)."""
        async with self._pull_lock:
            end = self._end_item
            if end is None:
                try:
                    frame = await self._frame(False)
                except asyncio.CancelledError:  # (its consumer is leaving) a read cut short ends the framing
                    self._end_item = ConnectionError(f"a read from {self.remote} was cancelled midway")
                    raise
                except Exception as e:  # noqa: BLE001 - as the read task: the stream ends, typed
                    end = _EOF if self._closed else _ended(e, self.remote)  # (closed here: a clean end)
                else:
                    if frame is not _EOF:
                        return frame
                    end = _EOF
                self._end_item = end
        if end is _EOF:
            return None
        raise type(end)(str(end))

    async def _read_data(self, n: int) -> bytes | bytearray | None:
        """A large frame of ``n`` bytes: a data frame's payload goes where the sink says (its head is
        returned); None when the frame is not a data frame (nothing consumed)."""
        await self._fill(pm.DATA_PREFIX)
        if self._stage[self._start] != pm.DATA_MARK:
            return None
        hn = pm.DATA_PREFIX + codec.data_head_size(self._view[self._start:self._start + pm.DATA_PREFIX])
        if hn > n:
            raise ConnectionError(f"data frame head of {hn} bytes in a frame of {n} bytes")
        await self._fill(hn)
        prefix = bytes(self._take(hn))
        assert self._sink is not None
        dest = self._sink(memoryview(prefix)[pm.DATA_PREFIX:], n - hn)
        if dest is not None and dest.nbytes == n - hn:
            await self._read_into(dest)
            return prefix
        buf = bytearray(n)
        buf[:hn] = prefix
        await self._read_into(memoryview(buf)[hn:])
        return buf

    async def _put(self, item: Any) -> None:
        if not self._closed:
            await self._q.put(item)

    async def recv(self) -> bytes | None:
        """Next frame, ``None`` at a clean end; ``ConnectionError`` if broken. Cancel-safe while the read
        task reads (once ``pull``-ing, a cancelled recv ends the stream)."""
        if self._closed:
            return None
        if self._pulling:
            return await self._pulled()
        item = await self._q.get()
        if item is _PULL:
            self._pulling = True
            return await self._pulled()
        if item is _EOF or isinstance(item, BaseException):
            with suppress(asyncio.QueueFull):
                self._q.put_nowait(item)  # every later recv sees the same end
            if item is _EOF:
                return None
            raise type(item)(str(item))
        if len(item) >= _DIRECT:
            self._big -= 1
            self._taken.set()
        return item

    # -- sending -----------------------------------------------------------
    async def send(self, frame: Frame) -> None:
        """Send one frame (or the parts of one). ``LimitExceeded`` above ``max_frame``."""
        if self._closed:
            raise ConnectionError("connection closed")
        if self._broken:
            raise ConnectionError(self._broken)
        if isinstance(frame, bytes) and len(frame) < _SMALL_SEND:
            n = len(frame)
            parts: list[Any] = [n.to_bytes(4, "big") + frame]
        else:
            parts = frame_parts(frame)
            n = sum(len(p) for p in parts)
            if n < _SMALL_SEND:
                parts = [n.to_bytes(4, "big") + b"".join(parts)]
            else:
                parts.insert(0, n.to_bytes(4, "big"))
        if n > self.max_frame:
            raise LimitExceeded(f"frame of {n} bytes exceeds the limit of {self.max_frame} bytes")
        async with self._lock:
            try:
                await self._io.write(parts)
            except asyncio.CancelledError:
                self._broken = "a send was cancelled midway; the connection is no longer usable"
                self._io.close()
                raise
            except (OSError, RuntimeError) as e:
                self._broken = f"connection to {self.remote} broke: {e}"
                raise ConnectionError(self._broken) from None

    # -- closing -----------------------------------------------------------
    async def close(self) -> None:
        """Finish our side, let the peer finish its own (bounded), then close. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.calm is not None:
            self.calm.close()  # the reader meets the end
        while not self._q.empty():  # unblock a reader waiting for room
            self._q.get_nowait()
        try:
            await asyncio.wait_for(self._lock.acquire(), _CLOSE_STEP)
            self._lock.release()
            self._io.shutdown()
            await asyncio.wait_for(asyncio.shield(self._reader), _CLOSE_STEP)
        except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - bounded: close anyway
            pass
        self._reader.cancel()
        self._io.close()
        with suppress(asyncio.QueueFull):
            self._q.put_nowait(_EOF)


class TcpListener:
    """Serves sessions on ``tcp://host:port`` (``tcps://`` when given an SSL context)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, max_frame: int,
                 ssl: _ssl.SSLContext | None = None) -> None:
        self.host, self.port, self.max_frame, self.ssl = host, port, max_frame, ssl
        self.addresses: list[str] = []
        self._sock: socket.socket | None = None
        self._server: Any = None
        self._accept: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self._conns: set[TcpConnection] = set()

    async def start(self, handler: SessionHandler) -> None:
        self._handler = handler
        try:
            if self.ssl is not None:
                self._server = await asyncio.start_server(self._on_stream, self.host, self.port, ssl=self.ssl)
                sockets = list(self._server.sockets)
            else:
                infos = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
                family, _, _, _, addr = infos[0]
                sock = socket.socket(family, socket.SOCK_STREAM)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    sock.bind(addr)
                    sock.listen(128)
                except OSError:
                    sock.close()
                    raise
                sock.setblocking(False)
                self._sock, sockets = sock, [sock]
                self._accept = asyncio.get_running_loop().create_task(self._accept_loop(sock))
        except OSError as e:
            raise bind_error(e, f"{self.host}:{self.port}", "TCP", "--tcp") from None
        scheme = "tcps" if self.ssl else "tcp"
        for s in sockets:
            host, port = s.getsockname()[:2]
            self.addresses.append(f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}")

    async def _accept_loop(self, lsock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, addr = await loop.sock_accept(lsock)
            except asyncio.CancelledError:
                raise
            except OSError as e:  # e.g. out of file descriptors: keep serving the others
                log.warning("accept failed: %s", e)
                await asyncio.sleep(0.1)
                continue
            tune(sock)
            conn = TcpConnection(SocketIO(sock, watch=True), f"{addr[0]}:{addr[1]}", max_frame=self.max_frame,
                                 expect_preamble=True)
            self._spawn(conn)

    async def _on_stream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername") or ("?", 0)
        sock = writer.get_extra_info("socket")
        if sock is not None:
            with suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = TcpConnection(StreamIO(reader, writer), f"{peer[0]}:{peer[1]}", max_frame=self.max_frame,
                             expect_preamble=True)
        await self._serve(conn)

    def _spawn(self, conn: TcpConnection) -> None:
        t = asyncio.get_running_loop().create_task(self._serve(conn))
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _serve(self, conn: TcpConnection) -> None:
        self._conns.add(conn)
        try:
            await self._handler(conn)
        except Exception:  # noqa: BLE001 - a handler bug must not hurt the listener
            log.exception("session handler failed for %s", conn.remote)
        finally:
            self._conns.discard(conn)
            await conn.close()

    async def stop(self) -> None:
        if self._accept is not None:
            self._accept.cancel()
            with suppress(BaseException):
                await self._accept
        if self._sock is not None:
            self._sock.close()
        if self._server is not None:
            self._server.close()
        for c in list(self._conns):
            await c.close()
        pending = [t for t in self._tasks if not t.done()]
        if pending:
            await asyncio.wait(pending, timeout=5.0)


async def dial(address: str, *, timeout: float, max_frame: int, ssl: _ssl.SSLContext | None = None) -> TcpConnection:
    """Connect to ``tcp://HOST:PORT`` (``tcps://`` verifies the server with ``ssl``)."""
    host, port, tls = parse_address(address)
    hint = "nothing is listening there? start a peer with `ember serve --tcp HOST:PORT`"
    try:
        if tls:
            ctx = ssl or _ssl.create_default_context()
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host, port, ssl=ctx, server_hostname=host), timeout)
            sock = writer.get_extra_info("socket")
            if sock is not None:
                with suppress(OSError):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            writer.write(PREAMBLE)
            io: Any = StreamIO(reader, writer)
        else:
            io = await asyncio.wait_for(_connect(host, port), timeout)
            await io.write([PREAMBLE])
            conn = TcpConnection(io, address, max_frame=max_frame)
            conn.calm = CalmLink(conn, io.sock, _DIRECT)
            return conn
    except asyncio.TimeoutError:
        raise ConnectError(f"no answer from {address} within {timeout:g} s",
                           hint="is the peer up and reachable? start one with `ember serve --tcp HOST:PORT`") from None
    except (OSError, _ssl.SSLError) as e:
        raise ConnectError(f"cannot connect to {address}: {e}", hint=hint) from None
    return TcpConnection(io, address, max_frame=max_frame)


async def _connect(host: str, port: int) -> SocketIO:
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    err: OSError | None = None
    for family, type_, proto, _, addr in infos:
        sock = socket.socket(family, type_, proto)
        tune(sock)
        try:
            await loop.sock_connect(sock, addr)
            return SocketIO(sock)
        except OSError as e:
            sock.close()
            err = e
    raise err or OSError(f"no address for {host}")
