"""``Device``: one device of one peer, as the user sees it; ``connect``, ``devices``, defaults."""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import threading
import warnings
from typing import Any, Callable

from ..errors import ConnectError, EmberError, SessionLost
from ..protocol import codec
from ..protocol import messages as m
from ..protocol.lanes import DEFAULT_LANES, MAX_LANES
from ..transport import SessionHandler, dial, is_iroh_address, uses_tls
from .io import get_loop, run_sync
from .session import ClientSession, open_session

LOCAL = "local"
log = logging.getLogger("ember.client")


class Device:
    """A device on a compute peer. Arrays created with ``device=dev`` live there.

    A lost session is replaced on the next new work (arrays of the old session
    raise ``SessionLost`` when used).
    """

    def __init__(self, address: str, index: int, *, credential: bytes = b"", timeout: float = 10.0,
                 read_timeout: float = 300.0, session_options: dict[str, Any] | None = None,
                 tls: ssl.SSLContext | None = None, admin: bool = False) -> None:
        self.address = address
        self.index = index
        self.admin = admin
        self._credential = credential
        self._timeout = timeout
        self._read_timeout = read_timeout
        self._options = dict(session_options or {})
        if is_embedded(address):  # an in-process peer cannot vanish: a stalled loop (a loaded box) is no loss
            self._options["heartbeat_timeout"] = float("inf")
        # data_frames=False: offer no data frames (MessagePack chunks only; benchmarks compare the two)
        data_frames = self._options.pop("data_frames", True)
        # lanes=N: stripe large uploads and reads over N more streams (protocol.lanes); default over iroh
        lanes = self._options.pop("lanes", None)
        self._lanes = int(lanes) if lanes is not None else (DEFAULT_LANES if is_iroh_address(address) else 0)
        if not 0 <= self._lanes <= MAX_LANES:
            raise ConnectError(f"lanes must be between 0 and {MAX_LANES}, got {lanes!r}")
        # compile=True: ask the peer to compile replayed graphs (granted by `ember serve --compile` only)
        self._compile = bool(self._options.pop("compile", False))
        self._features = [f for f in m.FEATURES if (self._lanes or f != m.LANES_FEATURE) and f != m.COMPILE_FEATURE] \
            if data_frames else []
        if self._compile:
            self._features.append(m.COMPILE_FEATURE)
        self._ssl = tls
        self._lock = threading.Lock()
        self._session: ClientSession | None = None
        self._session = self._open()

    # ---- session -----------------------------------------------------------------
    def _open(self) -> ClientSession:
        loop = get_loop()
        sid = os.urandom(16)

        async def go() -> ClientSession:
            conn = await _dial(self.address, self._timeout, self._ssl)
            try:
                welcome = await open_session(conn, address=self.address, device=self.index,
                                             credential=self._credential, timeout=self._timeout, session_id=sid,
                                             features=self._features, admin=self.admin)
            except BaseException:
                await conn.close()
                raise
            return ClientSession(conn, welcome, loop, address=self.address, device=self.index,
                                 read_timeout=self._read_timeout, lanes=self._lanes, session_id=sid,
                                 dial_lane=lambda: _dial(self.address, self._timeout, self._ssl), **self._options)

        session = run_sync(go(), self._timeout + 1.0, f"connecting to {self.address}")
        session.compiled = self._compile and m.COMPILE_FEATURE in codec.agreed_features(session.welcome_features)
        if self._compile and not session.compiled:
            warnings.warn(f"compiled graphs refused by {self.address[:60]}: the peer was not started with --compile "
                          "(or serves no torch device); graphs replay eagerly", RuntimeWarning, stacklevel=3)
        log.debug("session %s with %s device %d opened%s", sid.hex()[:8], self.address[:40], self.index,
                  " (admin)" if self.admin else "")
        return session

    @property
    def session(self) -> ClientSession:
        """The live session; reconnects once for new work after a loss."""
        s = self._session
        if s is not None and s.lost is None:
            return s
        with self._lock:
            if self._session is None or self._session.lost is not None:
                if self._session is not None and isinstance(self._session.lost, SessionLost) \
                        and self._session.lost.message == "session closed by this client":
                    raise SessionLost(f"device {self!r} was closed", hint="connect again with ember.connect")
                if self._session is not None:
                    log.info("session with %s device %d was lost (%s); reconnecting for new work",
                             self.address[:40], self.index, self._session.lost)
                self._session = self._open()
            return self._session

    @property
    def info(self) -> dict[str, Any]:
        """This device's description from the peer: backend, name, dtypes, memory."""
        return self.session.welcome["devices"][self.index]

    @property
    def peer_id(self) -> str | None:
        return self.session.welcome.get("peer_id")

    @property
    def dtypes(self) -> tuple[str, ...]:
        return tuple(self.info["dtypes"])

    def stats(self, peer: bool = True) -> dict[str, Any]:
        """This device's session in figures (no admin rights needed).

        The client's counters (``ops``, ``batches``, ``bytes_sent``, ``bytes_received``, ``reads``,
        ``graphs``, ``replays``, ...), read before asking the peer, and with ``peer`` (one round
        trip) what the peer reports for this session under ``"peer"``: ``session`` (ops run,
        bytes in and out, tensors and bytes held, graph hits, its last error, ...) and ``device``.
        """
        s = self.session
        out: dict[str, Any] = dict(s.stats)
        if peer:
            out["peer"] = s.request(m.STATS, "session")
        return out

    def peer_stats(self) -> dict[str, Any]:
        """The whole peer in figures: devices, sessions, totals, recent transfers and errors.

        Only for an admin session (``connect(address, admin=True, credential=ADMIN_TOKEN)``, or
        from an allowlisted admin iroh peer); others get ``AuthorizationError``.
        """
        return self.session.request(m.STATS, "server")

    def sync(self, timeout: float | None = None) -> None:
        """Wait until everything recorded so far has run on the peer."""
        self.session.sync(timeout)

    def close(self) -> None:
        """End the session; the peer frees everything it held for it."""
        if self._session is not None:
            self._session.close()

    # ---- default device ----------------------------------------------------------
    def __enter__(self) -> "Device":
        _stack().append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _stack().pop()

    def __repr__(self) -> str:
        return f"Device({self.address!r}, {self.index})"

    def __eq__(self, other: object) -> bool:
        return self is other

    def __hash__(self) -> int:
        return id(self)


async def _dial(address: str, timeout: float, tls: ssl.SSLContext | None = None) -> Any:
    factory = _embedded.get(address)
    if factory is not None:
        from ..transport.memory import memory_pair
        client_end, server_end = memory_pair()
        asyncio.ensure_future(factory()(server_end))
        return client_end
    return await dial(address, timeout=timeout, max_frame=m.DEFAULT_MAX_FRAME, tls=tls)


#: In-process peers by address: a factory returning the peer's session handler, served on the I/O
#: loop over an in-memory link. ``ember.embedded`` registers ``"local"``; the client knows only this seam.
_embedded: dict[str, Callable[[], SessionHandler]] = {}


def register_embedded(address: str, factory: Callable[[], SessionHandler]) -> None:
    """Make ``connect(address)`` reach an in-process peer whose handler ``factory()`` returns."""
    _embedded[address] = factory


# ---- public functions ----------------------------------------------------------------

_tls = threading.local()
_default: Device | None = None
_local: Device | None = None
_default_lock = threading.Lock()


_entered: dict[int, list[Device]] = {}  # thread id -> its ``with dev:`` stack (see entered_device)


def _stack() -> list[Device]:
    s = getattr(_tls, "stack", None)
    if s is None:
        s = _tls.stack = _entered[threading.get_ident()] = []
    return s


def entered_device() -> Device | None:
    """This thread's innermost ``with dev:`` device; outside any, the one every thread inside one has
    innermost, when they all agree; else None. For threads that work on a user thread's behalf (torch's
    autograd engine runs a backward on one of its own)."""
    own = getattr(_tls, "stack", None)
    if own:
        return own[-1]
    tops = {id(s[-1]): s[-1] for s in list(_entered.values()) if s}
    return next(iter(tops.values())) if len(tops) == 1 else None


def connect(address: str = LOCAL, *, device: int = 0, credential: bytes | str = b"", timeout: float = 10.0,
            read_timeout: float = 300.0, tls_ca: str | ssl.SSLContext | None = None, admin: bool = False,
            **session_options: Any) -> Device:
    """Connect to one device of a peer, eagerly.

    ``address`` is ``"local"``, ``"ws://host:port"``, ``"tcp://host:port"``, or an iroh ticket / peer id.
    An unreachable peer, a refused session or a bad device index raises here.
    ``tls_ca`` (a CA file or an ``ssl.SSLContext``; default ``$EMBER_TLS_CA``, else
    the system's CAs) verifies a ``wss://`` or ``tcps://`` peer. ``admin=True`` opens an admin
    session (``credential`` is then the peer's admin token): ``dev.peer_stats()`` works on it.
    """
    if isinstance(credential, str):
        credential = credential.encode()
    if not isinstance(device, int) or device < 0:
        raise ConnectError(f"device index must be a non-negative int, got {device!r}")
    return Device(address, device, credential=credential, timeout=timeout, read_timeout=read_timeout,
                  session_options=session_options, tls=_tls_context(address, tls_ca), admin=admin)


def _tls_context(address: str, ca: str | ssl.SSLContext | None) -> ssl.SSLContext | None:
    if not uses_tls(address):
        return None
    if isinstance(ca, ssl.SSLContext):
        return ca
    ca = ca or os.environ.get("EMBER_TLS_CA") or None
    try:
        return ssl.create_default_context(cafile=ca)
    except (OSError, ssl.SSLError) as e:
        raise ConnectError(f"cannot load the CA file {ca}: {e}", hint="pass tls_ca= a PEM CA bundle") from None


def devices(address: str = LOCAL, **options: Any) -> list[Device]:
    """Every device the peer at ``address`` hosts (``options`` as for :func:`connect`)."""
    first = connect(address, **options)
    n = int(first.session.welcome.get("device_count", 1))
    return [first] + [connect(address, device=i, **options) for i in range(1, n)]


def set_default_device(dev: Device | None) -> None:
    """Use ``dev`` for functions called without ``device=`` (``None``: back to the local peer)."""
    global _default
    if dev is not None and not isinstance(dev, Device):
        raise TypeError(f"expected an ember Device, got {type(dev).__name__}")
    _default = dev


def is_embedded(address: str) -> bool:
    """Is ``address`` an in-process peer (``"local"``, ``"local:torch"``)? Its data moves through the client."""
    return address in _embedded


def chosen_device() -> Device | None:
    """The innermost ``with dev:`` device, else the one set by ``set_default_device``, else None."""
    s = getattr(_tls, "stack", None)
    return s[-1] if s else _default


def default_device() -> Device:
    """The innermost ``with dev:`` device, else the one set by ``set_default_device``, else local
    (made on first use and kept apart: it is no choice of the user's, see ``chosen_device``)."""
    global _local
    dev = chosen_device()
    if dev is not None:
        return dev
    if _local is None:
        with _default_lock:
            if _local is None:
                _local = connect(LOCAL)
    return _local


__all__ = ["Device", "connect", "devices", "set_default_device", "default_device", "register_embedded", "is_embedded",
           "chosen_device", "entered_device", "EmberError"]
