"""Binding an iroh endpoint that never panics and never hangs.

Burn Remote binds with ``.bind().await.expect(...)``; Ember validates every
option in Python first, builds the endpoint through a custom
:class:`iroh.Preset` (so that ``bind`` addresses are exactly what was asked),
bounds every wait, and turns every failure into
:class:`ember.errors.BindError` with a ``cause``, a ``hint`` and a
``transient`` flag. Transient causes are retried with exponential backoff.

Networking modes:

* ``offline=True``: no relays, no discovery, direct addresses only
  (``apply_minimal``). Nothing ever leaves the host's own networks.
* ``relay="default"``: n0 relays and discovery.
* ``relay="disabled"``: discovery, no relays.
* ``relay=[url, ...]``: discovery and your own relays.

For modes that use relays, a listener waits (bounded by ``online_timeout``)
until the endpoint has a home relay; if none answers the bind fails with
cause ``relay_unreachable`` -- waiting longer is the retry there, so the
endpoint is not re-bound for it.

iroh always opens one UDP socket per IP family. When ``bind`` names only one
family, Ember pins the other family to its loopback address so that nothing
beyond what was asked is reachable from the network.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import urllib.parse
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import iroh

from ember.errors import BindError

from .iroh_fastcopy import install_all

__all__ = ["ALPN", "parse_relay", "parse_bind_address", "bind_endpoint",
           "classify_bind_error", "iroh_message", "relay_mode_name"]

#: ALPN of the Ember protocol over iroh.
ALPN = b"ember/1"

_OFFLINE_HINT = "use --offline (direct addresses only), --relay disabled, or your own relay with --relay URL"


def iroh_message(exc: BaseException) -> str:
    """iroh's own message for ``exc`` on one line (``str()`` of an ``IrohError`` is empty)."""
    if isinstance(exc, iroh.IrohError):
        try:
            text = exc.message()
        except Exception:  # noqa: BLE001
            text = repr(exc)
    else:
        text = str(exc) or repr(exc)
        # Errors raised inside a preset callback arrive as InternalError wrapping
        # the IrohError's debug form: pull out its message.
        m = re.search(r'message: \\?"(.*?)\\?"', text)
        text = m.group(1) if m else text
    text = re.sub(r"\s*\([^()]*\.rs:\d+:\d+\)", "", text)  # Rust source locations
    text = re.sub(r"\s*\n\s*Caused by:\s*", ": ", text)
    return re.sub(r"\s*\n\s*", "; ", text.strip())


@dataclass(frozen=True)
class BindAddress:
    """A validated ``HOST:PORT`` bind address."""

    host: str
    port: int
    family: int  # 4 or 6

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if self.family == 6 else f"{self.host}:{self.port}"


def parse_bind_address(text: str) -> BindAddress:
    """Validate ``HOST:PORT`` (IPv4 literal, or ``[IPv6]:PORT``)."""
    hint = "write HOST:PORT with an IP literal, e.g. 127.0.0.1:0, 0.0.0.0:7000 or [::1]:0 (port 0 = any free port)"
    s = text.strip() if isinstance(text, str) else ""
    m = re.fullmatch(r"\[([0-9A-Fa-f:.%a-zA-Z0-9]+)\]:(\d{1,5})", s) or re.fullmatch(
        r"([0-9.]+):(\d{1,5})", s)
    if not m:
        raise BindError(f"invalid bind address {text!r}", cause="invalid_address", hint=hint)
    host, port = m.group(1), int(m.group(2))
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise BindError(f"invalid bind address {text!r}: {host!r} is not an IP address",
                        cause="invalid_address", hint=hint) from None
    if port > 65535:
        raise BindError(f"invalid bind address {text!r}: port {port} is out of range",
                        cause="invalid_address", hint=hint)
    if ip.version == 6 and not s.startswith("["):
        raise BindError(f"invalid bind address {text!r}", cause="invalid_address", hint=hint)
    return BindAddress(str(ip), port, ip.version)


def _plan_binds(bind: Iterable[str] | None) -> list[str] | None:
    """Validated socket addresses to give iroh (None = iroh's defaults)."""
    if bind is None:
        return None
    if isinstance(bind, str):
        bind = [bind]
    addrs = [parse_bind_address(b) for b in bind]
    if not addrs:
        return None
    by_family: dict[int, BindAddress] = {}
    for a in addrs:
        if a.family in by_family and by_family[a.family] != a:
            raise BindError(
                f"more than one IPv{a.family} bind address: {by_family[a.family]} and {a}",
                cause="invalid_address",
                hint="iroh binds one socket per IP family: give at most one IPv4 and one IPv6 address")
        by_family[a.family] = a
    out = [str(a) for a in by_family.values()]
    if 4 not in by_family:
        out.append("127.0.0.1:0")
    if 6 not in by_family:
        out.append("[::1]:0")
    return out


def parse_relay(relay: Any) -> str | list[str]:
    """Normalise a relay option: "default", "disabled", or a list of URLs."""
    if relay is None:
        return "default"
    if isinstance(relay, str):
        low = relay.strip().lower()
        if low in ("default", "disabled"):
            return low
        relay = [u for u in relay.split(",") if u.strip()]
    urls = [str(u).strip() for u in relay]
    if not urls:
        raise BindError("empty relay list", cause="invalid_address",
                        hint="use --relay default, --relay disabled or --relay https://relay.example.com")
    for u in urls:
        p = urllib.parse.urlparse(u)
        if p.scheme not in ("http", "https") or not p.hostname:
            raise BindError(f"invalid relay URL {u!r}", cause="invalid_address",
                            hint="relay URLs look like https://relay.example.com (comma-separated)")
    return urls


def relay_mode_name(relay: str | list[str], offline: bool) -> str:
    """One word describing the relay mode, for ``ember serve`` output."""
    if offline:
        return "offline"
    if isinstance(relay, list):
        return ",".join(relay)
    return relay


def _check_key(key: bytes | None) -> bytes | None:
    if key is None:
        return None
    if not isinstance(key, (bytes, bytearray)) or len(key) != 32:
        n = len(key) if isinstance(key, (bytes, bytearray)) else type(key).__name__
        raise BindError(f"invalid secret key: expected 32 bytes, got {n}", cause="invalid_key",
                        hint="create a key with `ember keygen PATH` and pass --key PATH")
    try:
        iroh.SecretKey.from_bytes(bytes(key))
    except Exception as e:  # noqa: BLE001
        raise BindError(f"invalid secret key: {iroh_message(e)}", cause="invalid_key",
                        hint="create a key with `ember keygen PATH`") from None
    return bytes(key)


class _EmberPreset(iroh.Preset):
    """Applies exactly the options asked for; never raises into Rust."""

    def __init__(self, *, offline: bool, relay: str | list[str], binds: list[str] | None,
                 key: bytes | None, alpns: list[bytes] | None, discovery: bool = True) -> None:
        self.offline, self.relay, self.binds, self.discovery = offline, relay, binds, discovery
        self.key, self.alpns = key, alpns
        self.error: BaseException | None = None

    def apply(self, builder: Any) -> None:  # called from a Rust thread
        try:
            if self.offline:
                builder.apply_minimal()
                builder.relay_mode(iroh.RelayMode.disabled())
            elif not self.discovery:  # relays only (doctor, tests with a local relay)
                builder.apply_minimal()
                builder.relay_mode(iroh.RelayMode.custom_from_urls(self.relay)
                                   if isinstance(self.relay, list) else
                                   iroh.RelayMode.disabled() if self.relay == "disabled"
                                   else iroh.RelayMode.default_mode())
            elif self.relay == "disabled":
                builder.apply_n0_disable_relay()
            else:
                builder.apply_n0()
                if isinstance(self.relay, list):
                    builder.relay_mode(iroh.RelayMode.custom_from_urls(self.relay))
            for a in self.binds or ():
                builder.bind_addr(a)
            if self.key is not None:
                builder.secret_key(self.key)
            if self.alpns is not None:
                builder.alpns(self.alpns)
        except BaseException as e:  # noqa: BLE001 - an exception here panics in Rust
            self.error = e


_ERRNO_RULES: list[tuple[tuple[str, ...], str, bool]] = [
    (("os error 98", "address already in use", "os error 48", "os error 10048"), "address_in_use", True),
    (("os error 99", "cannot assign requested address", "os error 49", "os error 10049"),
     "address_not_available", False),
    (("os error 97", "os error 93", "os error 94", "address family not supported",
      "protocol not supported", "os error 1)", "operation not permitted"), "no_udp", False),
    (("invalid socket address", "only a single default address"), "invalid_address", False),
    (("secret key", "invalid key"), "invalid_key", False),
    (("relay url",), "invalid_address", False),
]


def classify_bind_error(exc: BaseException, binds: Sequence[str] | None = None) -> BindError:
    """Map an iroh (or OS) failure while binding to a :class:`BindError`."""
    msg = iroh_message(exc)
    low = msg.lower()
    where = ", ".join(binds) if binds else "the default addresses"
    cause, transient = "other", False
    for needles, c, t in _ERRNO_RULES:
        if any(n in low for n in needles):
            cause, transient = c, t
            break
    else:
        if isinstance(exc, iroh.IrohError):
            try:
                kind = exc.kind()
            except Exception:  # noqa: BLE001
                kind = None
            if kind == iroh.IrohErrorKind.INVALID_INPUT:
                cause = "invalid_address"
            elif kind == iroh.IrohErrorKind.TIMEOUT:
                transient = True
        if "permission denied" in low or "os error 13" in low:
            cause = "other"
    hints = {
        "address_in_use": f"another process already uses {where}: pick another port (port 0 = any free port) or stop that process",
        "address_not_available": f"{where} is not an address of this host: bind one of its IPs, 127.0.0.1, [::1] or 0.0.0.0",
        "no_udp": "this host does not allow UDP sockets (sandbox or firewall): allow UDP, or serve with --websocket HOST:PORT",
        "invalid_address": "write HOST:PORT with an IP literal, e.g. 127.0.0.1:0 or [::1]:0",
        "invalid_key": "create a key with `ember keygen PATH` and pass --key PATH",
        "other": ("ports below 1024 need privileges: use a higher port"
                  if "permission denied" in low or "os error 13" in low
                  else "run `ember doctor` to check this host's networking; --debug shows details"),
    }
    return BindError(f"cannot bind iroh endpoint on {where}: {msg}", cause=cause,
                     hint=hints[cause], transient=transient)


def _needs_relay(offline: bool, relay: str | list[str]) -> bool:
    return not offline and relay != "disabled"


async def _bind_once(preset: _EmberPreset, protocols: dict[bytes, Any] | None,
                     bind_timeout: float, binds: list[str] | None) -> Any:
    opts = iroh.EndpointOptions(preset=preset)
    if protocols:
        opts.protocols = protocols
    try:
        ep = await asyncio.wait_for(iroh.Endpoint.bind(opts), bind_timeout)
    except asyncio.TimeoutError:
        raise BindError(f"binding the iroh endpoint took longer than {bind_timeout:g}s",
                        cause="other", transient=True,
                        hint="run `ember doctor` to check this host's networking") from None
    except BindError:
        raise
    except Exception as e:  # noqa: BLE001 - IrohError, InternalError, OSError...
        raise classify_bind_error(preset.error or e, binds) from None
    if preset.error is not None:  # the preset failed halfway: do not serve half a config
        await close_endpoint(ep)
        raise classify_bind_error(preset.error, binds)
    return ep


async def close_endpoint(ep: Any, timeout: float = 2.0) -> None:
    """Close an endpoint, bounded; never raises."""
    try:
        await asyncio.wait_for(ep.close(), timeout)
    except BaseException as e:  # noqa: BLE001
        if isinstance(e, asyncio.CancelledError):
            raise


async def bind_endpoint(*, key: bytes | None = None, relay: Any = "default",
                        offline: bool = False, bind: Sequence[str] | str | None = None,
                        alpns: Sequence[bytes] | None = (ALPN,),
                        protocols: dict[bytes, Any] | None = None,
                        retries: int = 3, backoff: float = 0.25,
                        require_relay: bool = True, online_timeout: float = 5.0,
                        bind_timeout: float = 10.0, discovery: bool = True) -> Any:
    """Bind an iroh endpoint; raise :class:`BindError` on any failure.

    ``retries`` transient failures are retried after ``backoff``, doubling
    each time (defaults: at most 4 attempts, 1.75 s of sleeping). Permanent
    failures raise at once. When ``require_relay`` and the mode uses relays,
    wait at most ``online_timeout`` seconds for a home relay, else raise cause
    ``relay_unreachable``. ``discovery=False`` keeps relays but turns off
    n0 discovery (publishing and lookups).
    """
    install_all()
    key = _check_key(key)
    relay_spec = "disabled" if offline else parse_relay(relay)
    binds = _plan_binds(bind)
    attempt = 0
    while True:
        preset = _EmberPreset(offline=offline, relay=relay_spec, binds=binds, key=key,
                              alpns=list(alpns) if alpns is not None else None,
                              discovery=discovery)
        try:
            ep = await _bind_once(preset, protocols, bind_timeout, binds)
            break
        except BindError as e:
            if binds and e.cause in ("address_not_available", "no_udp") and _filler_failed(binds, bind):
                binds = [b for b in binds if b in _requested(bind)]  # host lacks the other family
                continue
            if not e.transient or attempt >= retries:
                raise
        await asyncio.sleep(backoff * (2 ** attempt))
        attempt += 1
    if require_relay and _needs_relay(offline, relay_spec):
        try:
            await asyncio.wait_for(ep.online(), online_timeout)
        except asyncio.TimeoutError:
            await close_endpoint(ep)
            which = "the default n0 relays" if relay_spec == "default" else ", ".join(relay_spec)
            raise BindError(f"relays unreachable: no answer from {which} within {online_timeout:g}s",
                            cause="relay_unreachable", transient=True,
                            hint=f"unreachable — {_OFFLINE_HINT}") from None
    return ep


def _requested(bind: Sequence[str] | str | None) -> set[str]:
    if bind is None:
        return set()
    items = [bind] if isinstance(bind, str) else list(bind)
    return {str(parse_bind_address(b)) for b in items}


def _filler_failed(binds: list[str], bind: Sequence[str] | str | None) -> bool:
    """True when ``binds`` holds a loopback filler that might be the culprit."""
    return any(b not in _requested(bind) for b in binds)
