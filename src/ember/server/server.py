"""``Server``: the devices a compute peer hosts, its listeners, custom ops and authorizer."""

from __future__ import annotations

import asyncio
import hmac
import os
import logging
import signal
import threading
from typing import Any, Callable, Iterable, Sequence

from .._version import __version__
from ..errors import AuthorizationError, EmberError
from ..protocol import messages as m
from ..transport.base import FrameConnection, Listener
from ..transport.loop import run_loop
from .execute.backends import Backend, make_backend
from .execute.interpreter import build_table
from .guard.auth import Authorizer, allowlist_authorizer, all_of, token_authorizer
from .guard.limits import Admission, ClientLimits
from .guard.memory import DeviceMemory, default_limit, parse_size
from .session import Session, drive_session
from .telemetry.figures import Figures
from .telemetry.probe import Probe
from .telemetry.session_log import SessionLog
from .transfer import TransferHub

log = logging.getLogger("ember.server")

CustomOp = Callable[..., Any]


def _on_host(b: Backend) -> bool:
    """Does this device keep its arrays in host RAM (so it shares the host's budget)?"""
    if b.kind == "numpy":
        return True
    if b.kind == "torch":
        return getattr(b.device, "type", "") == "cpu"
    if b.kind == "jax":
        return getattr(b.device, "platform", "") == "cpu"
    return False


class Server:
    """A compute peer.

    >>> srv = Server(["cpu"])
    >>> srv.listen_websocket("127.0.0.1", 0)   # doctest: +SKIP
    >>> srv.run()                              # blocks until SIGINT/SIGTERM  # doctest: +SKIP
    """

    def __init__(self, devices: Sequence[str | Backend] = ("cpu",), *,
                 authorizer: Authorizer | None = None,
                 custom_ops: dict[str, CustomOp] | None = None,
                 max_sessions: int = ClientLimits.max_sessions,
                 max_frame: int = m.DEFAULT_MAX_FRAME,
                 chunk: int = m.DEFAULT_CHUNK,
                 max_tensor: int = 1 << 40,
                 peer_id: str | None = None,
                 graph_cache: int = m.DEFAULT_GRAPH_CACHE,
                 inline_small: bool = True,
                 admin_tokens: Iterable[bytes | str] = (),
                 admin_peers: Iterable[str] = (),
                 memory_limit: int | str | None = None,
                 session_memory: int | str | None = None,
                 max_sessions_per_client: int = ClientLimits.max_sessions_per_client,
                 max_uploads: int = ClientLimits.max_uploads,
                 max_tensors: int = ClientLimits.max_tensors,
                 max_messages: int = ClientLimits.max_messages,
                 handshake_timeout: float = ClientLimits.handshake_timeout,
                 collectives: bool = False, dist_host: str = "127.0.0.1", dist_allow: Iterable[str] = (),
                 compile: bool = False,
                 **limits: Any) -> None:
        """``memory_limit``: bytes (or ``"16GiB"``) each device budget holds, default a safe fraction of
        RAM / device memory (host devices share one budget); ``session_memory``: per session, default
        the device's budget. ``collectives``: offer torch.distributed collectives among the peers of a
        mesh, bound to ``dist_host`` (an IP), reaching stores on ``dist_allow`` hosts. ``compile``: sessions
        that ask for it (feature ``"compile"``) replay their graphs compiled by inductor on torch devices
        (:mod:`.execute.compiled`). The per-client limits are described in :mod:`ember.server.guard.limits`
        (``limits`` takes the rest of :class:`~ember.server.limits.ClientLimits` by name)."""
        self.backends: list[Backend] = [d if isinstance(d, Backend) else make_backend(d) for d in devices]
        if not self.backends:
            raise EmberError("a server needs at least one device", hint="e.g. Server(['cpu'])")
        self.tables = [build_table(b) for b in self.backends]
        if collectives:  # torch.distributed among mesh peers, bound to dist_host (server/execute/collectives.py)
            from .execute.collectives import enable
            enable(self.tables, self.backends, dist_host, list(dist_allow))
        self.compiler: Any = None
        if compile:
            from .execute.compiled import Compiler
            self.compiler = Compiler()
        self.authorizer = authorizer
        self.custom_ops: dict[str, CustomOp] = dict(custom_ops or {})
        try:
            self.client_limits = ClientLimits(
                max_sessions=max_sessions, max_sessions_per_client=max_sessions_per_client, max_uploads=max_uploads,
                max_tensors=max_tensors, max_messages=max_messages, handshake_timeout=handshake_timeout, **limits)
        except TypeError as e:
            raise EmberError(f"unknown Server option: {e}") from None
        self.admission = Admission(self.client_limits)
        self.budgets = self._make_budgets(None if memory_limit is None else parse_size(memory_limit))
        self.session_memory = None if session_memory is None else parse_size(session_memory)
        self.limits = {"max_frame": max_frame, "chunk": min(chunk, max_frame - 1024), "max_tensor": max_tensor,
                       "graph_cache": max(0, int(graph_cache)),  # graphs per session (LRU); 0: no graph caching
                       **self.client_limits.wire()}
        self.inline_small = inline_small  # the network loop runs tiny, cheap batches itself (server/session.py)
        self.peer_id = peer_id
        self.version = __version__
        self.listeners: list[Listener] = []
        self.sessions: dict[bytes, Session] = {}
        self.live: set[Session] = set()
        self.transfers = TransferHub()
        self.instance = os.urandom(8).hex()       # tells clients two sessions share this process
        self.transfer_peer_id: str | None = None  # the id this peer presents when it downloads
        self.addresses: list[str] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        # telemetry (server/telemetry/probe.py): the probe, its subscribers, and who may see the whole peer
        self.telemetry = Probe()
        self.figures = Figures(self)
        self.session_log = SessionLog(self.telemetry, [b.spec for b in self.backends])
        self.admin_tokens = tuple(t.encode() if isinstance(t, str) else bytes(t) for t in admin_tokens if t)
        self.admin_peers = frozenset(p.strip().lower() for p in admin_peers if p.strip())
        self.metrics_address: str | None = None
        self._metrics_bind: tuple[str, int] | None = None
        self._metrics_close: Callable[[], None] | None = None

    # ---- configuration -----------------------------------------------------------
    def register_op(self, name: str, fn: CustomOp) -> None:
        """Register a custom op: ``fn(xp, *arrays, **scalars) -> array | tuple[array, ...]``."""
        if not isinstance(name, str) or not name:
            raise ValueError("a custom op needs a non-empty name")
        self.custom_ops[name] = fn

    def custom_op(self, name: str) -> Callable[[CustomOp], CustomOp]:
        """Decorator form of :meth:`register_op`."""
        def deco(fn: CustomOp) -> CustomOp:
            self.register_op(name, fn)
            return fn
        return deco

    def add_listener(self, listener: Listener) -> None:
        self.listeners.append(listener)

    def listen_websocket(self, host: str = "127.0.0.1", port: int = 0, *, ssl: Any = None,
                         insecure: bool = False) -> None:
        """Serve WebSocket on ``host:port``. A non-loopback address needs an authorizer (WebSocket
        authenticates nobody) unless ``insecure``."""
        from ..transport.websocket import WebSocketListener
        self._check_exposure("WebSocket", host, port, insecure)
        self.add_listener(WebSocketListener(host, port, max_frame=self.limits["max_frame"], ssl=ssl))

    def _check_exposure(self, kind: str, host: str, port: int, insecure: bool) -> None:
        from ..transport.websocket import is_loopback
        if not is_loopback(host) and self.authorizer is None and not insecure:
            raise EmberError(f"refusing to serve {kind} on {host}:{port} without an authorizer: anyone who can "
                             "reach that address could compute on this peer",
                             hint="pass authorizer=token_authorizer(b'...') (ember serve --token-file PATH), "
                                  "or insecure=True (--insecure)")

    def listen_tcp(self, host: str = "127.0.0.1", port: int = 0, *, ssl: Any = None, insecure: bool = False) -> None:
        """Serve on ``tcp://host:port`` (``tcps://`` with an SSL context): length-prefixed frames,
        the fastest transport for bulk data. Like WebSocket, a non-loopback address needs an
        authorizer unless ``insecure``."""
        from ..transport.tcp import TcpListener
        self._check_exposure("TCP", host, port, insecure)
        self.add_listener(TcpListener(host, port, max_frame=self.limits["max_frame"] + 65536, ssl=ssl))

    def listen_iroh(self, *, key: bytes | None = None, relay: Any = "default", offline: bool = False,
                    bind: Sequence[str] | None = None, **options: Any) -> Any:
        """Serve over iroh (ALPN ``ember/1``); returns the ``IrohListener``.

        ``key`` (32 bytes, see ``ember.keys``) fixes the peer id; ``offline``
        means no relays and no discovery; ``bind`` lists exact ``HOST:PORT``
        addresses. Session and transfer streams both reach :meth:`handle`.
        """
        from ..transport.iroh import IrohListener
        lst = IrohListener(key=key, relay=relay, offline=offline, bind=bind,
                           max_frame=self.limits["max_frame"] + 65536, transfer_handler=self.handle,
                           **options)
        self.add_listener(lst)
        return lst

    def listen_metrics(self, host: str = "127.0.0.1", port: int = 0) -> None:
        """Serve Prometheus ``/metrics`` on ``host:port`` once started (``metrics_address`` says where)."""
        self._metrics_bind = (host, port)

    @staticmethod
    def vetted_aten(name: str) -> bool:
        """Whether ``name`` is an ATen overload a torch device of this peer would run."""
        from .execute.aten import refusal  # (imports torch: only asked on peers with a torch device)
        return refusal(name) is None

    def device_info(self) -> list[dict[str, Any]]:
        return [b.info(i) for i, b in enumerate(self.backends)]

    def authorize(self, peer_id: str | None, device: int, credential: bytes) -> str | None:
        """None when the session may proceed, else the reason it may not."""
        if self.authorizer is None:
            return None
        try:
            verdict = self.authorizer(peer_id, device, credential)
        except AuthorizationError as e:
            return e.reason
        except Exception as e:  # a buggy authorizer refuses, it does not crash the peer
            log.exception("authorizer raised")
            return f"authorizer failed: {type(e).__name__}"
        if verdict is None or verdict is True:
            return None
        return verdict if isinstance(verdict, str) else "refused by the peer's authorizer"

    def authorize_admin(self, peer_id: str | None, credential: bytes) -> str | None:
        """None when this Hello may open an admin session (``ember top``/``status``), else why not."""
        if not self.admin_tokens and not self.admin_peers:
            return ("this peer grants no admin access (start it with --admin-token, --admin-token-file "
                    "or --admin-peer)")
        if peer_id is not None and peer_id.lower() in self.admin_peers:
            return None
        if credential and any(hmac.compare_digest(credential, t) for t in self.admin_tokens):
            return None
        if not self.admin_tokens:
            return f"peer {(peer_id or 'unauthenticated (WebSocket)')[:16]} is not an admin peer of this peer"
        return "wrong admin token" if credential else "missing admin token"

    @property
    def max_sessions(self) -> int:
        return self.client_limits.max_sessions

    def _make_budgets(self, limit: int | None) -> list[DeviceMemory]:
        """One budget per device index; devices in host RAM share the host's."""
        host: DeviceMemory | None = None
        out = []
        for b in self.backends:
            if _on_host(b):
                if host is None:
                    host = DeviceMemory(limit if limit is not None else default_limit(None, True),
                                        "host")
                out.append(host)
            else:
                out.append(DeviceMemory(limit if limit is not None else default_limit(b.memory, False),
                                        b.spec))
        return out

    def welcome_limits(self, device: int) -> dict[str, Any]:
        """The limits a session on ``device`` is told in Welcome (its memory budget included)."""
        dev = self.budgets[device].limit
        mine = self.session_memory if dev is None else min(dev, self.session_memory or dev)
        return {**self.limits, "session_memory": mine, "device_memory": dev}

    def held_tensors(self) -> int:
        """Tensors (values and poisoned ids) held by all sessions, including closing ones."""
        return sum(s.interp.held() for s in list(self.live))

    def memory_stats(self) -> dict[str, Any]:
        """Budgets and what they hold: ``{"devices": [...], "sessions": [...]}`` (plain figures, bytes)."""
        devices = [{"device": i, "spec": b.spec, **self.budgets[i].stats()} for i, b in enumerate(self.backends)]
        sessions = [{"device": s.device_index, "client": s.identity, "tensors": s.interp.held(),
                     "inflight": s.inflight(), "staged": s.staged, **s.mem.stats()} for s in list(self.live)]
        return {"devices": devices, "sessions": sessions}

    def memory_held(self) -> int:
        """Bytes charged to every budget of this peer together (0 once every session has ended)."""
        return sum(b.held() for b in {id(b): b for b in self.budgets}.values())

    def client_stats(self) -> dict[str, Any]:
        """Sessions per client identity and refusals per limit."""
        return {"sessions": len(self.sessions), **self.admission.stats()}

    # ---- running -----------------------------------------------------------------
    async def handle(self, conn: FrameConnection) -> None:
        """Serve one session stream (what every listener calls)."""
        await drive_session(self, conn)

    async def start(self, listening: Callable[[list[str]], None] | None = None) -> list[str]:
        """Start every listener; return the addresses clients can use. ``listening(addresses)`` is called once
        the listeners that start at once (WebSocket, TCP) serve, before one that waits (iroh's relays), so
        their addresses can be told (and used) without that wait."""
        self._loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        self.figures.start(ops=self._metrics_bind is not None)
        self.session_log.start()
        if self._metrics_bind is not None and self._metrics_close is None:
            from .telemetry.metrics import serve_metrics
            self.metrics_address, self._metrics_close = serve_metrics(self, *self._metrics_bind)
        told = listening is None
        for lst in self.listeners:
            if not told and hasattr(lst, "relay_mode"):  # iroh: it may wait seconds for a relay
                told = True
                if self.addresses:
                    listening(list(self.addresses))  # type: ignore[misc]
            await lst.start(self.handle)
            self.addresses.extend(lst.addresses)
            if self.peer_id is None and getattr(lst, "peer_id", None):
                self.peer_id = lst.peer_id  # the authenticated iroh identity, sent in Welcome
        if self.transfer_peer_id is None and any(getattr(lst, "peer_id", None) for lst in self.listeners):
            from ..transport.iroh import client_peer_id
            self.transfer_peer_id = await client_peer_id()  # the endpoint downloads dial from
        return self.addresses

    async def stop(self) -> None:
        """Stop listening and end every session (their tensors are freed)."""
        self.telemetry.stopping = True
        for lst in self.listeners:
            try:
                await lst.stop()
            except Exception:
                log.exception("stopping listener")
        await asyncio.gather(*(asyncio.wait_for(s.conn.close(), 3.0) for s in list(self.sessions.values())),
                             return_exceptions=True)  # together and bounded: a silent peer holds nobody's stop
        for _ in range(200):  # let the pumps end (and report) their sessions, at most 2 s
            if not self.telemetry.sessions:
                break
            await asyncio.sleep(0.01)
        self.session_log.stop()
        self.figures.stop()
        if self._metrics_close is not None:
            await asyncio.to_thread(self._metrics_close)
            self._metrics_close = None
        if self.transfer_peer_id is not None:
            from ..transport.iroh import close_client
            await close_client()
        if self._stopped is not None:
            self._stopped.set()

    async def serve(self, ready: Callable[[list[str]], None] | None = None,
                    listening: Callable[[list[str]], None] | None = None) -> None:
        """Async form of :meth:`run`: start (``listening``: see :meth:`start`), call ``ready(addresses)``, serve
        until :meth:`stop`."""
        await self.start(listening)
        if ready is not None:
            ready(self.addresses)
        assert self._stopped is not None
        await self._stopped.wait()

    def run(self, ready: Callable[[list[str]], None] | None = None,
            listening: Callable[[list[str]], None] | None = None) -> None:
        """Serve until SIGINT or SIGTERM, then close sessions and return (``listening``: see :meth:`start`).
        On uvloop when it is installed (``pip install 'ember[fast]'``; ``EMBER_UVLOOP=0`` keeps asyncio's loop)."""
        async def main() -> None:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                try:
                    loop.add_signal_handler(sig, lambda: asyncio.ensure_future(self.stop()))
                except (NotImplementedError, RuntimeError):
                    pass
            await self.serve(ready, listening)
        run_loop(main(), hot=True)  # (the process's own loop: it may poll hot after a small answer)

    def start_in_thread(self, timeout: float = 30.0) -> list[str]:
        """Serve on a background thread (tests, notebooks); return the addresses once listening."""
        ready = threading.Event()
        errors: list[BaseException] = []

        def target() -> None:
            try:
                run_loop(self.serve(lambda _a: ready.set()))
            except BaseException as e:
                errors.append(e)
                ready.set()

        self._thread = threading.Thread(target=target, name="ember-server", daemon=True)
        self._thread.start()
        if not ready.wait(timeout):
            raise EmberError(f"server did not start within {timeout:g} s")
        if errors:
            raise errors[0]
        return self.addresses

    def close(self, timeout: float = 10.0) -> None:
        """Stop a server started with :meth:`start_in_thread`."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                asyncio.run_coroutine_threadsafe(self.stop(), loop).result(timeout)
            except Exception:
                pass
        if self.compiler is not None:
            self.compiler.close()
        if self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["Server", "Authorizer", "token_authorizer", "allowlist_authorizer", "all_of", "parse_devices"]


def parse_devices(specs: Iterable[str]) -> list[str]:
    return [s.strip() for s in specs if s.strip()] or ["cpu"]
