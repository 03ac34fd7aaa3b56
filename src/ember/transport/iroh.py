"""The iroh transport: frames over QUIC bidirectional streams.

Wire format (ALPN ``ember/1``): one bidirectional stream per session (or per
transfer). Every frame is a 4-byte big-endian length followed by the payload.
The first frame of every stream is a small MessagePack header
``{"kind": "session" | "transfer", "version": 1}``. A process keeps **one
QUIC connection per remote peer**, shared by all of its sessions.

* :class:`IrohConnection` -- a :class:`~ember.transport.base.FrameConnection`
  over one stream; ``peer_id`` is the remote's authenticated 64-hex id.
  ``recv`` is cancel-safe (a reader task owns the stream), every ``close``
  step is bounded.
* :class:`IrohListener` -- binds (see :mod:`.iroh_endpoint`), accepts
  connections, dispatches streams by header kind.
* :func:`dial` -- the client side, on a lazily bound process endpoint per
  event loop; :func:`configure_client` / ``EMBER_OFFLINE=1`` choose its mode.
* :func:`mount` -- Ember as one protocol of an application's own endpoint.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import weakref
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Sequence

import iroh
import msgpack

from ember.errors import ConnectError

from . import iroh_fastcopy
from .base import SessionHandler
from .iroh_conn import (CODE_BAD_HEADER, CODE_BAD_VERSION, CODE_DONE, CODE_NO_HANDLER,
                        CODE_SHUTDOWN, DEFAULT_MAX_FRAME, HEADER_LIMIT, KINDS, STREAM_VERSION,
                        FrameTooLarge, IrohConnection)
from .iroh_address import Target, is_iroh_address, parse_address
from .iroh_endpoint import (ALPN, bind_endpoint, close_endpoint, iroh_message, parse_relay,
                            relay_mode_name)

__all__ = ["ALPN", "STREAM_VERSION", "DEFAULT_MAX_FRAME", "FrameTooLarge", "IrohConnection",
           "IrohListener", "dial", "configure_client", "close_client", "client_peer_id", "is_iroh_address",
           "parse_address", "mount", "EmberProtocol", "bind_endpoint"]

log = logging.getLogger("ember.transport.iroh")
_CLOSE_STEP = 1.0

TransferHandler = Callable[[IrohConnection], Awaitable[None]]


# ---------------------------------------------------------------------------
# Server side
# ---------------------------------------------------------------------------

def _parse_header(frame: bytes | None) -> tuple[str | None, int]:
    """(kind, code): kind None with a reset code when the header is bad."""
    if frame is None:
        return None, CODE_BAD_HEADER
    try:
        h = msgpack.unpackb(frame, raw=False)
    except Exception:  # noqa: BLE001
        return None, CODE_BAD_HEADER
    if not isinstance(h, dict) or h.get("kind") not in KINDS:
        return None, CODE_BAD_HEADER
    if h.get("version") != STREAM_VERSION:
        return None, CODE_BAD_VERSION
    return h["kind"], CODE_DONE


class _ConnectionServer:
    """Serves the streams of accepted connections (listener and mount)."""

    def __init__(self, handler: SessionHandler, transfer_handler: TransferHandler | None,
                 max_frame: int, header_timeout: float, max_streams: int | None) -> None:
        self.handler = handler
        self.transfer_handler = transfer_handler
        self.max_frame = max_frame
        self.header_timeout = header_timeout
        self.max_streams = max_streams
        self.tasks: set[asyncio.Task] = set()
        self.conns: set[Any] = set()

    def spawn(self, coro: Awaitable[None]) -> asyncio.Task:
        t = asyncio.get_running_loop().create_task(coro)  # type: ignore[arg-type]
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)
        return t

    async def serve_connection(self, conn: Any) -> None:
        """Accept streams on ``conn`` until it closes."""
        peer = str(conn.remote_id())
        if self.max_streams:
            with suppress(Exception):
                conn.set_max_concurrent_bi_streams(self.max_streams)
        self.conns.add(conn)
        try:
            while True:
                try:
                    bi = await conn.accept_bi()
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # noqa: BLE001 - connection closed
                    log.debug("connection from %s ended: %s", peer, iroh_message(e))
                    return
                self.spawn(self._serve_stream(bi, conn, peer))
        finally:
            self.conns.discard(conn)

    async def _serve_stream(self, bi: Any, conn: Any, peer: str) -> None:
        c = IrohConnection(bi, conn, peer_id=peer, max_frame=self.max_frame, queue_size=2,
                           first_frame_limit=HEADER_LIMIT)
        try:
            try:
                head = await asyncio.wait_for(c.recv(), self.header_timeout)
            except (ConnectionError, asyncio.TimeoutError) as e:
                log.debug("bad stream from %s: %s", peer, e or "header timeout")
                await c.abort(CODE_BAD_HEADER)
                return
            kind, code = _parse_header(head)
            if kind is None:
                log.debug("rejecting stream from %s (code %d)", peer, code)
                await c.abort(code)
                return
            c.kind = kind
            if kind == "session":
                await self.handler(c)
            elif self.transfer_handler is not None:
                await self.transfer_handler(c)
            else:
                await c.abort(CODE_NO_HANDLER)
        except asyncio.CancelledError:
            with suppress(BaseException):
                await asyncio.shield(c.abort(CODE_SHUTDOWN))
            raise
        except ConnectionError as e:  # the link broke under the handler: routine
            log.debug("%s stream from %s ended: %s", c.kind, peer, e)
        except Exception:  # noqa: BLE001 - a handler bug must not hurt the listener
            log.exception("%s handler failed for peer %s", c.kind, peer)
        finally:
            with suppress(Exception):
                await c.close()

    async def shutdown(self, grace: float = 2.0) -> None:
        for conn in list(self.conns):
            with suppress(Exception):
                conn.close(CODE_SHUTDOWN, b"server stopping")
        pending = [t for t in self.tasks if not t.done()]
        if pending:
            done, still = await asyncio.wait(pending, timeout=grace)
            for t in still:
                t.cancel()
            if still:
                await asyncio.wait(still, timeout=grace)


class IrohListener:
    """Serve Ember sessions over iroh (implements ``Listener``)."""

    def __init__(self, *, key: bytes | None = None, relay: Any = "default",
                 offline: bool = False, bind: Sequence[str] | str | None = None,
                 max_frame: int = DEFAULT_MAX_FRAME,
                 transfer_handler: TransferHandler | None = None,
                 retries: int = 3, backoff: float = 0.25, online_timeout: float = 5.0,
                 header_timeout: float = 10.0, handshake_timeout: float = 10.0,
                 max_streams: int | None = 256, require_relay: bool = False,
                 discovery: bool = True) -> None:
        self.key, self.relay_spec, self.offline = key, relay, offline
        self.bind = bind
        self.max_frame = max_frame
        self.transfer_handler = transfer_handler
        self.online_timeout = online_timeout
        self.require_relay = require_relay
        self._bind_opts = dict(retries=retries, backoff=backoff, online_timeout=online_timeout,
                               require_relay=require_relay, discovery=discovery)
        self.header_timeout = header_timeout
        self.handshake_timeout = handshake_timeout
        self.max_streams = max_streams
        self.endpoint: Any = None
        self._server: _ConnectionServer | None = None
        self._accept_task: asyncio.Task | None = None
        self._relay_task: asyncio.Task | None = None
        self._stopping = False
        self._addr: Any = None
        #: "offline", "disabled", "online" or "unreachable" (serving on direct addresses, retrying relays)
        self.relay_status = "offline" if offline else "pending"
        #: why relays were unreachable (the one warning), when they were
        self.relay_warning: str | None = None
        #: called with the new ticket once a relay is reached after all
        self.on_relay: list[Callable[[str], None]] = []

    async def start(self, handler: SessionHandler) -> None:
        """Bind and accept; raises :class:`ember.errors.BindError`.

        Relays unreachable and ``require_relay`` off: serve on the direct addresses anyway,
        warn once (``relay_warning``, logged) and keep waiting for a relay in the background."""
        if self.endpoint is not None or self._stopping:
            raise RuntimeError("an IrohListener starts once")
        self.endpoint = await bind_endpoint(key=self.key, relay=self.relay_spec,
                                            offline=self.offline, bind=self.bind,
                                            **self._bind_opts)  # type: ignore[arg-type]
        self._server = _ConnectionServer(handler, self.transfer_handler, self.max_frame,
                                         self.header_timeout, self.max_streams)
        self._accept_task = asyncio.get_running_loop().create_task(self._accept_loop())
        await self._reach_relay()

    async def _reach_relay(self) -> None:
        spec = "disabled" if self.offline else parse_relay(self.relay_spec)
        if self.offline or spec == "disabled":
            self.relay_status = "offline" if self.offline else "disabled"
            return
        if self.require_relay:  # bind_endpoint waited (and would have raised)
            self.relay_status = "online"
            return
        try:
            await asyncio.wait_for(self.endpoint.online(), self.online_timeout)
            self.relay_status = "online"
            return
        except asyncio.TimeoutError:
            pass
        which = "the default n0 relays" if spec == "default" else ", ".join(spec)
        self.relay_status = "unreachable"
        self.relay_warning = (f"relays unreachable: no answer from {which} within {self.online_timeout:g} s; "
                              "serving on direct addresses (and WebSocket), retrying relays in the background")
        log.debug("%s", self.relay_warning)  # (ember serve prints it; Python callers read relay_warning)
        self._relay_task = asyncio.get_running_loop().create_task(self._await_relay())

    async def _await_relay(self) -> None:
        """iroh keeps dialing its relays; say so once one answers."""
        try:
            await self.endpoint.online()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the endpoint closed
            log.debug("waiting for a relay ended: %s", iroh_message(e))
            return
        self.relay_status = "online"
        log.info("relay reached: %s", self.relay_url)
        for cb in list(self.on_relay):
            with suppress(Exception):
                cb(self.ticket)

    async def _accept_loop(self) -> None:
        assert self._server is not None
        while True:
            try:
                inc = await self.endpoint.accept_next()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001
                log.warning("accept failed: %s", iroh_message(e))
                return
            if inc is None:
                return
            if self._stopping:
                with suppress(Exception):
                    await inc.refuse()
                continue
            self._server.spawn(self._handle_incoming(inc))

    async def _handle_incoming(self, inc: Any) -> None:
        assert self._server is not None
        try:
            accepting = await inc.accept()
            conn = await asyncio.wait_for(accepting.connect(), self.handshake_timeout)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - failed handshakes are the peer's problem
            log.debug("handshake failed: %s", iroh_message(e) if not isinstance(
                e, asyncio.TimeoutError) else "timeout")
            return
        await self._server.serve_connection(conn)

    async def stop(self) -> None:
        """Refuse new connections, close open ones, close the endpoint."""
        if self.endpoint is None or self._stopping:
            return
        self._stopping = True
        if self._relay_task is not None:
            self._relay_task.cancel()
            with suppress(BaseException):
                await asyncio.wait_for(self._relay_task, _CLOSE_STEP)
        if self._server is not None:
            await self._server.shutdown()
        if self._accept_task is not None:
            self._accept_task.cancel()
            with suppress(BaseException):
                await asyncio.wait_for(self._accept_task, _CLOSE_STEP)
        self._addr = self.endpoint.addr()
        await close_endpoint(self.endpoint)
        self.endpoint = None  # iroh frees the UDP sockets only once the object is gone
        self._server = None

    # -- what `ember serve` prints ------------------------------------------
    def _current_addr(self) -> Any:
        if self.endpoint is not None:
            return self.endpoint.addr()
        if self._addr is None:
            raise RuntimeError("listener not started")
        return self._addr

    @property
    def peer_id(self) -> str:
        return str(self._current_addr().id())

    @property
    def ticket(self) -> str:
        return str(iroh.EndpointTicket.from_addr(self._current_addr()))

    @property
    def direct_addresses(self) -> list[str]:
        return list(self._current_addr().direct_addresses())

    @property
    def relay_url(self) -> str | None:
        return self._current_addr().relay_url()

    @property
    def relay_mode(self) -> str:
        return relay_mode_name(parse_relay(self.relay_spec) if not self.offline else "disabled",
                               self.offline)

    @property
    def addresses(self) -> list[str]:
        return [self.ticket] if self.endpoint is not None or self._addr is not None else []


# ---------------------------------------------------------------------------
# Client side
# ---------------------------------------------------------------------------

@dataclass
class _ClientConfig:
    offline: bool | None = None
    relay: Any = "default"
    bind: Sequence[str] | None = None
    key: bytes | None = None


_config = _ClientConfig()


def configure_client(*, offline: bool | None = None, relay: Any = None,
                     bind: Sequence[str] | None = None, key: bytes | None = None) -> None:
    """Choose how the process-wide client endpoint binds.

    Applies to endpoints bound afterwards (call :func:`close_client` on a loop
    to rebind there). ``offline=None`` defers to ``EMBER_OFFLINE=1``; ``bind``
    defaults to ``EMBER_CLIENT_BIND`` (comma-separated) else all interfaces;
    ``key`` gives the client a stable identity (default: a fresh one per
    endpoint, or the key file named by ``EMBER_CLIENT_KEY``).
    """
    if offline is not None:
        _config.offline = offline
    if relay is not None:
        _config.relay = parse_relay(relay)
    if bind is not None:
        _config.bind = list(bind) or None
    if key is not None:
        _config.key = key


def _client_offline(override: bool | None) -> bool:
    if override is not None:
        return override
    if _config.offline is not None:
        return _config.offline
    return os.environ.get("EMBER_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _client_bind() -> list[str] | None:
    if _config.bind is not None:
        return list(_config.bind)
    env = os.environ.get("EMBER_CLIENT_BIND", "")
    return [b.strip() for b in env.split(",") if b.strip()] or None


def _client_key() -> bytes | None:
    if _config.key is not None:
        return _config.key
    path = os.environ.get("EMBER_CLIENT_KEY")
    if path:
        from ember.keys import load_key

        return load_key(path)
    return None


@dataclass(eq=False)
class _ClientState:
    """Per-event-loop client endpoint and its connection cache."""

    offline: bool
    endpoint: Any = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    conns: dict[str, Any] = field(default_factory=dict)
    pending: dict[str, asyncio.Task] = field(default_factory=dict)
    streams: "weakref.WeakSet[IrohConnection]" = field(default_factory=weakref.WeakSet)  # opened by dial

    async def get_endpoint(self) -> Any:
        async with self.lock:
            if self.endpoint is None or self.endpoint.is_closed():
                self.conns.clear()
                self.endpoint = await bind_endpoint(
                    key=_client_key(), relay=_config.relay, offline=self.offline,
                    bind=_client_bind(), require_relay=False, retries=2)
            return self.endpoint

    async def connection(self, target: Target, fresh: bool = False) -> Any:
        """The open QUIC connection to ``target``. ``fresh``: unless a stream of ours is open on it, close
        it and connect anew -- a peer that restarted (same key) leaves a dead connection that a Hello would
        wait on until QUIC's idle timeout, and whose old path iroh keeps trying while it lives."""
        conn = self.conns.get(target.peer_id)
        if conn is not None:
            busy = any(c._conn is conn and not c._closed for c in list(self.streams))
            if conn.close_reason() is None and (busy or not fresh):
                return conn
            self.conns.pop(target.peer_id, None)
            with suppress(Exception):
                conn.close(0, b"replaced")
        task = self.pending.get(target.peer_id)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._connect(target))
            self.pending[target.peer_id] = task
            task.add_done_callback(lambda t, p=target.peer_id: self._done(p, t))
        return await asyncio.shield(task)

    def _done(self, peer_id: str, task: asyncio.Task) -> None:
        self.pending.pop(peer_id, None)
        if not task.cancelled():
            task.exception()  # retrieved: a caller that timed out no longer awaits it

    async def _connect(self, target: Target) -> Any:
        ep = await self.get_endpoint()
        conn = await ep.connect(target.addr, ALPN)
        self.conns[target.peer_id] = conn
        return conn

    def forget(self, peer_id: str, conn: Any) -> None:
        if self.conns.get(peer_id) is conn:
            del self.conns[peer_id]


_states: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[bool, _ClientState]]" = \
    weakref.WeakKeyDictionary()
_states_lock = threading.Lock()


def _state(offline: bool) -> _ClientState:
    loop = asyncio.get_running_loop()
    with _states_lock:
        per_loop = _states.setdefault(loop, {})
        st = per_loop.get(offline)
        if st is None:
            st = per_loop[offline] = _ClientState(offline)
        return st


async def client_peer_id(offline: bool | None = None) -> str:
    """This process's client identity on the running loop (binds if needed)."""
    st = _state(_client_offline(offline))
    return str((await st.get_endpoint()).id())


async def close_client() -> None:
    """Close this loop's client connections and endpoints (bounded)."""
    loop = asyncio.get_running_loop()
    with _states_lock:
        per_loop = _states.pop(loop, {})
    for st in per_loop.values():
        pending = list(st.pending.values())
        for task in pending:  # abandoned attempts would delay the close
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=_CLOSE_STEP)
        for conn in list(st.conns.values()):
            with suppress(Exception):
                conn.close(CODE_DONE, b"client closing")
        st.conns.clear()
        if st.endpoint is not None:
            await close_endpoint(st.endpoint)


def _connect_error(e: BaseException, t: Target) -> ConnectError:
    msg = iroh_message(e)
    low = msg.lower()
    tried = ", ".join(t.addresses) or "no addresses"
    if "unknownissuer" in low or "invalid peer certificate" in low:
        return ConnectError(
            f"wrong peer: the endpoint at {tried} is not peer {t.peer_id} ({msg})",
            hint="the ticket or peer id is stale: copy the current ticket from `ember serve`")
    if "known protocol" in low or "noapplicationprotocol" in low or "alpn" in low:
        return ConnectError(
            f"peer {t.peer_id} at {tried} does not speak Ember (ALPN {ALPN.decode()} not offered): {msg}",
            hint="check that the address belongs to an `ember serve` of a compatible version")
    if "refused" in low:
        return ConnectError(f"peer {t.peer_id} at {tried} refused the connection: {msg}",
                            hint="the server may be stopping or overloaded; try again")
    if "addressing information" in low or "address lookup" in low:
        return ConnectError(f"no address known for peer {t.peer_id}: {msg}",
                            hint="use the `endpoint…` ticket: a bare peer id needs discovery")
    return ConnectError(f"could not connect to peer {t.peer_id} (tried {tried}): {msg}")


async def dial(address: str, *, timeout: float = 10.0, kind: str = "session",
               offline: bool | None = None, max_frame: int = DEFAULT_MAX_FRAME) -> IrohConnection:
    """Open a ``kind`` stream to the peer named by ``address``.

    Reuses this process's QUIC connection to that peer when one is open (a ``session`` stream only
    while another stream of ours is open on it).
    Raises :class:`ConnectError` (naming the peer and addresses tried) on
    failure or after ``timeout`` seconds.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}")
    target = parse_address(address)
    off = _client_offline(offline)
    if off and not target.from_ticket:
        raise ConnectError(
            f"cannot reach peer {target.peer_id} by id alone in offline mode",
            hint="offline mode has no discovery: pass the `endpoint…` ticket printed by `ember serve`")
    st = _state(off)
    await st.get_endpoint()  # a BindError surfaces as itself

    async def _open() -> IrohConnection:
        for attempt in (0, 1):
            # a new session does not trust an idle cached connection; lanes and transfers share theirs
            conn = await st.connection(target, fresh=kind == "session" and not attempt)
            try:
                bi = await conn.open_bi()
            except Exception:  # noqa: BLE001 - cached connection died: reconnect once
                st.forget(target.peer_id, conn)
                if attempt:
                    raise
                continue
            c = IrohConnection(bi, conn, peer_id=str(conn.remote_id()), kind=kind,
                               max_frame=max_frame)
            st.streams.add(c)
            await c._send_header(kind)
            c._start()
            return c
        raise AssertionError("unreachable")

    try:
        return await asyncio.wait_for(_open(), timeout)
    except asyncio.TimeoutError:
        tried = ", ".join(target.addresses) or "no addresses"
        raise ConnectError(
            f"timed out after {timeout:g}s connecting to peer {target.peer_id} (tried {tried})",
            hint="is the server running and reachable from here? check the ticket, firewalls "
                 "and `ember doctor`") from None
    except ConnectionError as e:
        raise ConnectError(f"connection to peer {target.peer_id} failed: {e}") from None
    except (iroh.IrohError, iroh.InternalError) as e:
        raise _connect_error(e, target) from None


# ---------------------------------------------------------------------------
# Composition: Ember as one protocol of an application's endpoint
# ---------------------------------------------------------------------------

class EmberProtocol(iroh.ProtocolHandler):
    """iroh router handler feeding Ember streams to a session handler."""

    def __init__(self, server: _ConnectionServer) -> None:
        self._server = server

    async def accept(self, conn: Any) -> None:
        await self._server.serve_connection(conn)

    async def shutdown(self) -> None:
        await self._server.shutdown()


class _EmberCreator(iroh.ProtocolCreator):
    def __init__(self, server: _ConnectionServer) -> None:
        self._server = server

    def create(self, endpoint: Any) -> EmberProtocol:
        return EmberProtocol(self._server)


def mount(handler: SessionHandler, *, transfer_handler: TransferHandler | None = None,
          max_frame: int = DEFAULT_MAX_FRAME, header_timeout: float = 10.0,
          loop: asyncio.AbstractEventLoop | None = None) -> dict[bytes, Any]:
    """``{ALPN: creator}`` for ``EndpointOptions(protocols=...)``.

    Call on the loop that should run the handlers (it is registered with
    ``uniffi_set_event_loop``, which router callbacks need)::

        protocols = {b"myapp/1": MyCreator(), **ember.transport.iroh.mount(server.handle)}
        ep = await iroh.Endpoint.bind(iroh.EndpointOptions(preset=..., protocols=protocols))
    """
    iroh_fastcopy.install_all()
    iroh.iroh_ffi.uniffi_set_event_loop(loop or asyncio.get_running_loop())
    server = _ConnectionServer(handler, transfer_handler, max_frame, header_timeout, None)
    return {ALPN: _EmberCreator(server)}
