"""``ember serve``: host devices and print every address the peer can be reached at."""

from __future__ import annotations

import argparse
import os
import ssl
import sys
from typing import Any

from ..errors import EmberError
from ..server import Server, token_authorizer


def build_server(args: argparse.Namespace) -> Server:
    token = args.token or os.environ.get("EMBER_TOKEN")
    auth = token_authorizer(token.encode()) if token else None
    server = Server(args.device or ["cpu"], authorizer=auth, max_sessions=args.max_sessions)
    tls = tls_context(args.tls_cert, args.tls_key) if getattr(args, "tls_cert", None) else None
    for host, port in args.websocket:
        server.listen_websocket(host, port, ssl=tls)
    for host, port in getattr(args, "tcp", None) or []:
        server.listen_tcp(host, port, ssl=tls)
    if not getattr(args, "no_iroh", True):
        add_iroh(server, args)
    return server


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
