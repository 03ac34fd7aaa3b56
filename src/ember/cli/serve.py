"""``ember serve``: host devices and print every address the peer can be reached at."""

from __future__ import annotations

import argparse
import os
import sys

from ..server import Server, token_authorizer


def build_server(args: argparse.Namespace) -> Server:
    token = args.token or os.environ.get("EMBER_TOKEN")
    auth = token_authorizer(token.encode()) if token else None
    server = Server(args.device or ["cpu"], authorizer=auth, max_sessions=args.max_sessions)
    for host, port in args.websocket:
        server.listen_websocket(host, port)
    return server


def describe_devices(server: Server) -> str:
    devs = ", ".join(f"{b.spec}, {b.kind}" if b.spec != b.kind else b.spec for b in server.backends)
    n = len(server.backends)
    return f"{n} device{'s' if n != 1 else ''}: {devs}"


def serve(args: argparse.Namespace) -> int:
    server = build_server(args)
    if not server.listeners:
        print("ember serve: error: no transport to serve on", file=sys.stderr)
        print("  hint: add --websocket 127.0.0.1:0", file=sys.stderr)
        return 2

    def ready(addresses: list[str]) -> None:
        for a in addresses:
            print(f"ember serve: listening on {a} ({describe_devices(server)})", flush=True)

    server.run(ready)
    print("ember serve: stopped", flush=True)
    return 0
