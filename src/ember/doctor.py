"""``ember doctor``: can this host serve Ember over iroh? Each check has a verdict and a hint.

Checks, in order: a UDP socket can be bound (and the requested ``--bind``
addresses); the secret key file exists, is private and holds a valid key; an
endpoint binds with the requested options; relays answer (skipped offline or
with ``--relay disabled``); discovery answers (skipped offline); and a
loopback self-connection echoes a frame. Every check is bounded by a timeout,
so the doctor never hangs. The exit status is 0 when serving is possible
(warnings, such as unreachable discovery, do not prevent it).
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence, TextIO

from .errors import BindError

__all__ = ["Check", "run_checks", "run_checks_async", "print_checks", "exit_status"]

_DISCOVERY_HOST = "dns.iroh.link"


@dataclass
class Check:
    """One verdict. ``status`` is ok, warn, fail or skip; ``ok`` is False only for fail."""

    name: str
    ok: bool
    detail: str
    hint: str | None = None
    status: str = "ok"

    @classmethod
    def make(cls, name: str, status: str, detail: str, hint: str | None = None) -> "Check":
        return cls(name, status != "fail", detail, hint, status)


def _udp_check(bind: Sequence[str] | None) -> Check:
    from .transport.iroh_endpoint import parse_bind_address

    done: list[str] = []
    try:
        targets = [parse_bind_address(b) for b in bind] if bind else []
    except BindError as e:
        return Check.make("UDP sockets", "fail", e.message, e.hint)
    plan = [(socket.AF_INET, "127.0.0.1", 0)] + [
        (socket.AF_INET6 if t.family == 6 else socket.AF_INET, t.host, t.port) for t in targets]
    for fam, host, port in plan:
        s = socket.socket(fam, socket.SOCK_DGRAM)
        try:
            s.bind((host, port))
            done.append(f"[{host}]:{port}" if fam == socket.AF_INET6 else f"{host}:{port}")
        except OSError as e:
            where = f"[{host}]:{port}" if fam == socket.AF_INET6 else f"{host}:{port}"
            if e.errno in (97, 93, 1, 94):
                return Check.make("UDP sockets", "fail", f"cannot create a UDP socket: {e.strerror}",
                                  "this host does not allow UDP (sandbox/firewall): allow it, or serve "
                                  "WebSocket only with --no-iroh --websocket HOST:PORT")
            return Check.make("UDP sockets", "fail", f"cannot bind UDP {where}: {e.strerror}",
                              "pick another --bind address or port (port 0 = any free port)")
        finally:
            s.close()
    return Check.make("UDP sockets", "ok", "can bind " + ", ".join(dict.fromkeys(done)))


def _key_check(key_path: str | os.PathLike | None) -> tuple[Check, bytes | None]:
    from .keys import default_key_path, key_file_problems, load_key, peer_id_of

    explicit = key_path is not None
    p = Path(key_path).expanduser() if explicit else default_key_path()
    if not p.exists():
        if explicit:
            return Check.make("secret key", "fail", f"{p} does not exist",
                              f"create it with `ember keygen {p}`"), None
        return Check.make("secret key", "ok",
                          f"no key yet at {p}; `ember serve` will create one there"), None
    try:
        key = load_key(p, check_permissions=False)
    except BindError as e:
        return Check.make("secret key", "fail", e.message, e.hint), None
    problems = key_file_problems(p)
    if problems:
        return Check.make("secret key", "fail", f"{p} is not private: {'; '.join(problems)}",
                          f"run `chmod 600 {p}` (as its owner)"), key
    return Check.make("secret key", "ok", f"{p}: private, valid, peer id {peer_id_of(key)}"), key


def _resolve(host: str, timeout: float) -> str | None:
    """Resolve ``host`` on a daemon thread; None on failure or timeout (never hangs)."""
    out: list[Any] = []

    def work() -> None:
        try:
            out.append(socket.getaddrinfo(host, 443, proto=socket.IPPROTO_TCP))
        except OSError as e:
            out.append(e)
    th = threading.Thread(target=work, daemon=True, name="ember-doctor-dns")
    th.start()
    th.join(timeout)
    if not out or isinstance(out[0], BaseException) or not out[0]:
        return None
    return str(out[0][0][4][0])


async def _self_connection(timeout: float) -> Check:
    from .transport import iroh as T

    async def echo(conn: Any) -> None:
        while (f := await conn.recv()) is not None:
            await conn.send(f)

    lst = T.IrohListener(offline=True, bind=["127.0.0.1:0", "[::1]:0"], retries=0)
    try:
        await asyncio.wait_for(lst.start(echo), timeout)
        t = time.perf_counter()
        c = await T.dial(lst.ticket, timeout=timeout, offline=True)
        try:
            await c.send(b"ember doctor")
            got = await asyncio.wait_for(c.recv(), timeout)
        finally:
            await c.close()
        ms = (time.perf_counter() - t) * 1e3
        if got != b"ember doctor":
            return Check.make("self-connection", "fail", f"echo came back wrong: {got!r}",
                              "please report this with `ember doctor --debug` output")
        return Check.make("self-connection", "ok",
                          f"dialed itself over iroh on loopback and echoed a frame in {ms:.1f} ms")
    except BindError as e:
        return Check.make("self-connection", "fail", e.message, e.hint)
    except (asyncio.TimeoutError, ConnectionError, Exception) as e:  # noqa: BLE001
        return Check.make("self-connection", "fail", f"{type(e).__name__}: {e}",
                          "a local firewall may drop loopback UDP; `--debug` shows details")
    finally:
        await lst.stop()
        await T.close_client()


async def run_checks_async(key_path: str | os.PathLike | None = None, relay: Any = "default",
                           offline: bool = False, bind: Sequence[str] | None = None,
                           timeout: float = 3.0) -> list[Check]:
    """Run every check (see module docstring); each is bounded by ``timeout``."""
    from .transport.iroh_endpoint import bind_endpoint, close_endpoint, parse_relay

    checks = [_udp_check(bind)]
    key_check, key = _key_check(key_path)
    checks.append(key_check)
    ep = None
    try:
        relay_spec = "disabled" if offline else parse_relay(relay)
        relay_ok = True
    except BindError as e:
        checks.append(Check.make("endpoint", "fail", e.message, e.hint))
        relay_spec, relay_ok = "disabled", False
    if relay_ok:
        try:
            ep = await bind_endpoint(key=key, relay=relay_spec, offline=offline, bind=bind,
                                     require_relay=False, retries=0, bind_timeout=timeout)
            mode = "offline" if offline else f"relay {relay_spec if isinstance(relay_spec, str) else ','.join(relay_spec)}"
            checks.append(Check.make("endpoint", "ok",
                                     f"bound {', '.join(ep.bound_sockets())} ({mode})"))
        except BindError as e:
            checks.append(Check.make("endpoint", "fail", e.message, e.hint))
    try:
        if offline or relay_spec == "disabled":
            checks.append(Check.make("relays", "skip", "offline: no relays used" if offline
                                     else "relays disabled"))
        elif ep is None:
            checks.append(Check.make("relays", "skip", "no endpoint to test relays with"))
        else:
            try:
                await asyncio.wait_for(ep.online(), timeout)
                checks.append(Check.make("relays", "ok", f"home relay {ep.addr().relay_url()}"))
            except asyncio.TimeoutError:
                checks.append(Check.make(
                    "relays", "fail", f"no relay answered within {timeout:g} s",
                    "unreachable — use --offline or your own relay (--relay URL)"))
    finally:
        if ep is not None:
            await close_endpoint(ep)
    if offline:
        checks.append(Check.make("discovery", "skip", "offline: no discovery"))
    else:
        ip = await asyncio.get_running_loop().run_in_executor(None, _resolve_bounded, timeout)
        if ip:
            checks.append(Check.make("discovery", "ok", f"{_DISCOVERY_HOST} resolves ({ip})"))
        else:
            checks.append(Check.make(
                "discovery", "warn", f"{_DISCOVERY_HOST} did not resolve within {timeout:g} s",
                "unreachable — clients must use the ticket, not the bare peer id; or use --offline"))
    checks.append(await _self_connection(max(timeout, 5.0)))
    return checks


def _resolve_bounded(timeout: float) -> str | None:
    return _resolve(_DISCOVERY_HOST, timeout)


def run_checks(key_path: str | os.PathLike | None = None, relay: Any = "default",
               offline: bool = False, bind: Sequence[str] | None = None,
               timeout: float = 3.0) -> list[Check]:
    """Synchronous :func:`run_checks_async` (runs its own event loop)."""
    return asyncio.run(run_checks_async(key_path, relay, offline, bind, timeout))


def exit_status(checks: Sequence[Check]) -> int:
    """0 when serving is possible (no check failed), else 1."""
    return 0 if all(c.ok for c in checks) else 1


def print_checks(checks: Sequence[Check], file: TextIO | None = None) -> int:
    """Print one line per check (and its hint); return :func:`exit_status`."""
    out = file or sys.stdout
    width = max(len(c.name) for c in checks) if checks else 0
    for c in checks:
        print(f"  {c.status.upper() if c.status == 'fail' else c.status:<5} {c.name:<{width}}  {c.detail}",
              file=out)
        if c.hint and c.status in ("fail", "warn"):
            print(f"  {'':<5} {'':<{width}}  hint: {c.hint}", file=out)
    status = exit_status(checks)
    print("ember doctor: serving is possible" if status == 0
          else "ember doctor: serving is NOT possible with these options", file=out)
    out.flush()
    return status
