"""``ember serve``: host devices and print every address the peer can be reached at."""

from __future__ import annotations

import argparse
import asyncio
import os
import ssl
import sys
from typing import Any

from ..errors import BindError, EmberError
from ..server import Server
from ..server.guard.limits import ClientLimits
from ..server.guard.auth import all_of, allowlist_authorizer, peer_id, read_peer_list, read_secret_file, token_authorizer
from ..server.guard.memory import KEEP_FREED, keep_freed_pages, parse_size
from ..transport import spin
from ..transport.websocket import is_loopback


def add_serve_options(s: argparse.ArgumentParser) -> None:
    """The flags of ``ember serve`` (besides the iroh options it shares with ``ember doctor``)."""
    s.add_argument("--token", default=None, help="require this credential from clients (or EMBER_TOKEN)")
    s.add_argument("--token-file", default=None, metavar="PATH",
                   help="read the credential from the first line of PATH (keeps it out of `ps`)")
    s.add_argument("--insecure", action="store_true",
                   help="allow WebSocket or TCP on a non-loopback address without a token (anyone who reaches it "
                        "can compute)")
    s.add_argument("--allow", action="append", default=[], metavar="PEER_ID",
                   help="accept only these iroh peer ids (repeatable)")
    s.add_argument("--allow-file", default=None, metavar="PATH", help="accept only the iroh peer ids in PATH (one per line)")
    s.add_argument("--tls-cert", default=None, metavar="PEM",
                   help="serve WebSocket and TCP over TLS (wss://, tcps://) with this certificate chain")
    s.add_argument("--tls-key", default=None, metavar="PEM", help="private key for --tls-cert (default: in the cert file)")
    lim = s.add_argument_group("limits (see the README's security model)")
    lim.add_argument("--memory-limit", type=_size, default=None, metavar="SIZE",
                     help="memory budget of each device (e.g. 16GiB; default 75%% of RAM, 90%% of a GPU's memory)")
    lim.add_argument("--session-memory", type=_size, default=None, metavar="SIZE",
                     help="memory budget of each session (default: its device's budget)")
    lim.add_argument("--keep-freed", type=_size, default=KEEP_FREED, metavar="SIZE",
                     help="freed host memory each session thread keeps for reuse while its session lasts "
                          "(glibc; default 512MiB; 0: give it back at once, as a plain process does)")
    d = ClientLimits()  # the defaults, and their one source
    lim.add_argument("--max-sessions", type=int, default=d.max_sessions, metavar="N",
                     help=f"sessions in all (default {d.max_sessions})")
    lim.add_argument("--max-sessions-per-client", type=int, default=d.max_sessions_per_client, metavar="N",
                     help="sessions per client: iroh peer id, or IP address for WebSocket "
                          f"(default {d.max_sessions_per_client}; 0: no limit)")
    lim.add_argument("--max-uploads", type=int, default=d.max_uploads, metavar="N",
                     help=f"chunked uploads in progress per session (default {d.max_uploads})")
    lim.add_argument("--max-tensors", type=int, default=d.max_tensors, metavar="N",
                     help=f"tensors per session (default {d.max_tensors})")
    lim.add_argument("--max-messages", type=int, default=d.max_messages, metavar="N",
                     help=f"messages per batch (default {d.max_messages})")
    lim.add_argument("--handshake-timeout", type=float, default=d.handshake_timeout, metavar="SECONDS",
                     help=f"close connections that send no Hello within this time (default {d.handshake_timeout:g})")
    lim.add_argument("--idle-timeout", type=float, default=d.idle_timeout, metavar="SECONDS",
                     help="end sessions whose client sent nothing for this long while their work was done "
                          f"(a vanished host or link; clients ping well within it; default {d.idle_timeout:g}; 0: never)")
    s.add_argument("--threads", type=int, default=None, metavar="N",
                   help="intra-op threads of each torch kernel (default: torch's, all cores). Results are bit-equal to "
                        "a client's local CPU torch when N is its torch.get_num_threads(): reductions and GEMMs split "
                        "work by it")
    s.add_argument("--compile", action="store_true",
                   help="compile the graphs sessions replay with inductor on torch devices, for clients that ask "
                        "(connect(..., compile=True)): vetted ATen ops only, compiled in the background, cached")
    s.add_argument("--spin-us", type=_spin_us, default=None, metavar="US",
                   help="poll the sockets this long without sleeping after a small answer (0 to 10000; default: "
                        "EMBER_SPIN_US or 300, and 0 when this process may use only one CPU); give it to a peer "
                        "pinned to a core of its own (taskset -c N), which no client shares")
    s.add_argument("--collectives", action="store_true",
                   help="offer torch.distributed collectives to meshes of peers (gloo/NCCL authenticate nobody)")
    s.add_argument("--dist-host", default="127.0.0.1", metavar="IP",
                   help="the address collectives bind and announce (a private interface; default 127.0.0.1)")
    s.add_argument("--dist-allow", action="append", default=[], metavar="IP",
                   help="hosts whose mesh stores this peer may reach (default: loopback iff --dist-host is)")
    s.add_argument("--require-relay", action="store_true",
                   help="exit if no iroh relay answers (default: serve on direct addresses and keep retrying)")
    s.add_argument("--no-discovery", action="store_true",
                   help="no iroh discovery (publishing or lookups); relays, if any, still used")


def _spin_us(text: str) -> float:
    try:
        us = float(text)
    except ValueError:
        us = -1.0
    if not 0 <= us <= spin.MAX_SPIN_US:  # (NaN too)
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number of microseconds from 0 to {spin.MAX_SPIN_US:g} (0: never poll)")
    return us


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _secret(args: argparse.Namespace, flag: str, env: str, what: str) -> str | None:
    """A secret from ``--FLAG``, ``--FLAG-file`` or the environment variable ``env`` (one flag at most)."""
    name = flag.replace("-", "_")
    value, path = getattr(args, name, None), getattr(args, name + "_file", None)
    if value and path:
        raise EmberError(f"both --{flag} and --{flag}-file given", hint="pass one of them")
    if path:
        return read_secret_file(path, what)
    return value or os.environ.get(env) or None


def build_server(args: argparse.Namespace) -> Server:
    token = _secret(args, "token", "EMBER_TOKEN", "token")
    allowed = list(getattr(args, "allow", None) or [])
    if getattr(args, "allow_file", None):
        allowed += read_peer_list(args.allow_file)
    if getattr(args, "allow_file", None) and not allowed:
        raise EmberError(f"the allowlist {args.allow_file} names no peer", hint="one 64-hex peer id per line")
    for kind, listen in (("WebSocket", args.websocket), ("TCP", getattr(args, "tcp", None) or [])):
        for host, port in listen:
            if not is_loopback(host) and not token and not getattr(args, "insecure", False):
                raise EmberError(
                    f"refusing to serve {kind} on {host}:{port} without a token: anyone who can reach that address "
                    f"could run computations on this peer and use its memory ({kind} authenticates nobody)",
                    hint="pass --token-file PATH (or --token / EMBER_TOKEN) and give clients the credential; "
                         "--insecure serves anyway; 127.0.0.1 serves this host only")
    auth = all_of(allowlist_authorizer(allowed) if allowed else None,
                  token_authorizer(token.encode()) if token else None)
    peers = [peer_id(p, "--admin-peer") for p in getattr(args, "admin_peer", None) or []]
    server = Server(args.device or ["cpu"], authorizer=auth, max_sessions=args.max_sessions,
                    admin_tokens=admin_tokens(args), admin_peers=peers,
                    memory_limit=getattr(args, "memory_limit", None), session_memory=getattr(args, "session_memory", None),
                    max_sessions_per_client=getattr(args, "max_sessions_per_client", ClientLimits.max_sessions_per_client),
                    max_uploads=getattr(args, "max_uploads", ClientLimits.max_uploads),
                    max_tensors=getattr(args, "max_tensors", ClientLimits.max_tensors),
                    max_messages=getattr(args, "max_messages", ClientLimits.max_messages),
                    handshake_timeout=getattr(args, "handshake_timeout", ClientLimits.handshake_timeout),
                    idle_timeout=getattr(args, "idle_timeout", ClientLimits.idle_timeout),
                    collectives=getattr(args, "collectives", False), dist_host=getattr(args, "dist_host", "127.0.0.1"),
                    dist_allow=getattr(args, "dist_allow", None) or (), compile=getattr(args, "compile", False))
    server.allowlist = allowed  # type: ignore[attr-defined]
    tls = tls_context(args.tls_cert, args.tls_key) if getattr(args, "tls_cert", None) else None
    for host, port in args.websocket:
        server.listen_websocket(host, port, ssl=tls, insecure=getattr(args, "insecure", False))
    for host, port in getattr(args, "tcp", None) or []:
        server.listen_tcp(host, port, ssl=tls, insecure=getattr(args, "insecure", False))
    if getattr(args, "metrics", None) is not None:
        server.listen_metrics(*args.metrics)
    if not getattr(args, "no_iroh", True):
        add_iroh(server, args)
    return server


def admin_tokens(args: argparse.Namespace) -> list[str]:
    """The admin token from --admin-token, --admin-token-file or EMBER_ADMIN_TOKEN (at most one kind)."""
    token = _secret(args, "admin-token", "EMBER_ADMIN_TOKEN", "admin token")
    return [token] if token else []


def tls_context(cert: str, key: str | None) -> ssl.SSLContext:
    """A server TLS context; unreadable or mismatched files are a clear error."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as e:
        raise EmberError(f"cannot load the TLS certificate {cert}" + (f" / key {key}" if key else "") + f": {e}",
                         hint="pass a PEM certificate chain with --tls-cert and its key with --tls-key") from None
    return ctx


def add_iroh(server: Server, args: argparse.Namespace) -> Any:
    """Serve over iroh with the key, relay, offline and bind options; says which key it uses."""
    from ..keys import claim_key, load_key, load_or_create_key, new_key
    from ..transport.iroh import configure_client
    from .identity import iroh_settings

    offline, relay, bind = iroh_settings(args)
    if args.key is not None:
        key, where = load_key(args.key), f"{args.key} (given)"
        claim = claim_key(args.key)
        if claim is None:
            raise BindError(f"another running ember serve uses the secret key {args.key}: two peers with one key are "
                            "one address to every client, and this one would receive nothing", cause="key_in_use",
                            hint="give each peer its own key: `ember keygen PATH`, then --key PATH")
    else:
        key, path, created = load_or_create_key()
        where = f"{path} ({'created' if created else 'reused'})"
        claim = claim_key(path)
        if claim is None:  # (a second peer of this user on this machine: its own identity, for this run only)
            key = new_key()
            where = (f"new for this run: {path} is in use by another running ember serve (two peers with one key "
                     "would be one address to every client); for a lasting identity: `ember keygen PATH`, --key PATH")
    configure_client(offline=offline)  # downloads from other peers use the same mode
    lst = server.listen_iroh(key=key, relay=relay, offline=offline, bind=bind,
                             require_relay=getattr(args, "require_relay", False),
                             discovery=not getattr(args, "no_discovery", False))
    server.iroh_listener, server.iroh_key_note = lst, where  # type: ignore[attr-defined]
    server.iroh_key_claim = claim  # type: ignore[attr-defined]  # (held, locked, while the peer serves)
    return lst


def describe_devices(server: Server) -> str:
    devs = ", ".join(f"{b.spec}, {b.kind}" if b.spec != b.kind else b.spec for b in server.backends)
    n = len(server.backends)
    return f"{n} device{'s' if n != 1 else ''}: {devs}"


def serve(args: argparse.Namespace) -> int:
    if args.threads is not None:
        if args.threads < 1:
            print("ember serve: error: --threads must be at least 1", file=sys.stderr)
            return 2
        try:
            from ..server.execute import aten as peer_aten  # (torch is imported only by torch devices' peers)
        except ImportError:
            print("ember serve: error: --threads sets torch's thread count, and torch is not installed",
                  file=sys.stderr)
            return 2
        peer_aten.THREADS[0] = args.threads  # every kernel-running thread follows it (aten._follow_threads)
    server = build_server(args)
    if args.keep_freed:  # this process is the peer's alone: buffers reused, not faulted in afresh each step
        keep_freed_pages(trim_threshold=args.keep_freed)
    if args.spin_us is not None:  # (before the loop is made: it polls hot only with a spin)
        spin.set_spin_us(args.spin_us)
    if not server.listeners:
        print("ember serve: error: no transport to serve on", file=sys.stderr)
        print("  hint: drop --no-iroh, or add --websocket 127.0.0.1:0 or --tcp 127.0.0.1:0", file=sys.stderr)
        return 2

    def relay_reached(ticket: str) -> None:
        print(f"ember serve: iroh relay reached; ticket {ticket}", flush=True)

    told: list[str] = []

    def listening(addresses: list[str]) -> None:
        """WebSocket and TCP serve already: told before iroh waits for its relays."""
        for a in addresses:
            if a not in told:
                told.append(a)
                print(f"ember serve: listening on {a} ({describe_devices(server)})", flush=True)

    def ready(addresses: list[str]) -> None:
        if getattr(server, "iroh_listener", None) is not None and not server.authorizer:
            print("ember serve: note: anyone with this peer's iroh ticket can use this peer; --allow/--token to "
                  "restrict", file=sys.stderr, flush=True)
        listening(addresses)  # WebSocket and TCP first, then the iroh ticket
        if server.metrics_address:
            print(f"ember serve: metrics on {server.metrics_address}", flush=True)
        if hasattr(asyncio.get_running_loop(), "keep_hot"):  # (EMBER_SPIN_US, --spin-us; never uvloop's)
            print(f"ember serve: polls hot for {spin.SPIN * 1e6:g} µs after a small answer", flush=True)
        if server.admin_tokens or server.admin_peers:
            ways = (["admin token"] if server.admin_tokens else []) + \
                [f"{len(server.admin_peers)} admin peer(s)"] * bool(server.admin_peers)
            print(f"ember serve: admin access (ember top/status) by {' and '.join(ways)}", flush=True)
        lst = getattr(server, "iroh_listener", None)
        if lst is not None:  # each value is its own whitespace-separated word
            print(f"ember serve: iroh ticket {lst.ticket}", flush=True)
            print(f"ember serve: iroh peer-id {lst.peer_id}", flush=True)
            print(f"ember serve: iroh direct-addresses {' '.join(lst.direct_addresses)}", flush=True)
            print(f"ember serve: iroh relay-mode {lst.relay_mode}", flush=True)
            print(f"ember serve: iroh secret-key {server.iroh_key_note}", flush=True)  # type: ignore[attr-defined]
            if lst.relay_warning:
                print(f"ember serve: warning: {lst.relay_warning}", file=sys.stderr, flush=True)
                print("  hint: the ticket above works for clients that reach a direct address; --offline skips "
                      "relays, --require-relay exits instead", file=sys.stderr, flush=True)
                lst.on_relay.append(relay_reached)

    server.run(ready, listening)
    print("ember serve: stopped", flush=True)
    return 0
