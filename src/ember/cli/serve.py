"""``ember serve``: host devices and print every address the peer can be reached at."""

from __future__ import annotations

import argparse
import os
import re
import ssl
import sys
from typing import Any

from ..errors import EmberError
from ..server import Server, token_authorizer


def build_server(args: argparse.Namespace) -> Server:
    token = args.token or os.environ.get("EMBER_TOKEN")
    auth = token_authorizer(token.encode()) if token else None
    peers = getattr(args, "admin_peer", None) or []
    for p in peers:
        if not re.fullmatch(r"[0-9a-fA-F]{64}", p):
            raise EmberError(f"--admin-peer {p[:70]!r} is not an iroh peer id",
                             hint="a peer id is 64 hex characters (`ember keygen` prints one)")
    server = Server(args.device or ["cpu"], authorizer=auth, max_sessions=args.max_sessions,
                    admin_tokens=admin_tokens(args), admin_peers=peers)
    tls = tls_context(args.tls_cert, args.tls_key) if getattr(args, "tls_cert", None) else None
    for host, port in args.websocket:
        server.listen_websocket(host, port, ssl=tls)
    for host, port in getattr(args, "tcp", None) or []:
        server.listen_tcp(host, port, ssl=tls)
    if getattr(args, "metrics", None) is not None:
        server.listen_metrics(*args.metrics)
    if not getattr(args, "no_iroh", True):
        add_iroh(server, args)
    return server


def admin_tokens(args: argparse.Namespace) -> list[str]:
    """The admin token from --admin-token, --admin-token-file or EMBER_ADMIN_TOKEN (at most one kind)."""
    token, path = getattr(args, "admin_token", None), getattr(args, "admin_token_file", None)
    if token and path:
        raise EmberError("--admin-token and --admin-token-file both given", hint="pass one of them")
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as e:
            raise EmberError(f"cannot read the admin token file {path}: {e.strerror or e}",
                             hint="write the token in a file readable by ember serve, e.g. mode 0600") from None
        if not token:
            raise EmberError(f"the admin token file {path} is empty", hint="put the token on its first line")
    token = token or os.environ.get("EMBER_ADMIN_TOKEN") or None
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
    from ..keys import load_key, load_or_create_key
    from ..transport.iroh import configure_client
    from .identity import iroh_settings

    offline, relay, bind = iroh_settings(args)
    if args.key is not None:
        key, where = load_key(args.key), f"{args.key} (given)"
    else:
        key, path, created = load_or_create_key()
        where = f"{path} ({'created' if created else 'reused'})"
    configure_client(offline=offline)  # downloads from other peers use the same mode
    lst = server.listen_iroh(key=key, relay=relay, offline=offline, bind=bind)
    server.iroh_listener, server.iroh_key_note = lst, where  # type: ignore[attr-defined]
    return lst


def describe_devices(server: Server) -> str:
    devs = ", ".join(f"{b.spec}, {b.kind}" if b.spec != b.kind else b.spec for b in server.backends)
    n = len(server.backends)
    return f"{n} device{'s' if n != 1 else ''}: {devs}"


def serve(args: argparse.Namespace) -> int:
    server = build_server(args)
    if not server.listeners:
        print("ember serve: error: no transport to serve on", file=sys.stderr)
        print("  hint: drop --no-iroh, or add --websocket 127.0.0.1:0 or --tcp 127.0.0.1:0", file=sys.stderr)
        return 2

    def ready(addresses: list[str]) -> None:
        for a in addresses:  # WebSocket and TCP first, then the iroh ticket
            print(f"ember serve: listening on {a} ({describe_devices(server)})", flush=True)
        if server.metrics_address:
            print(f"ember serve: metrics on {server.metrics_address}", flush=True)
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

    server.run(ready)
    print("ember serve: stopped", flush=True)
    return 0
