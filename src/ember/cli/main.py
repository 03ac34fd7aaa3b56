"""``ember`` command line: argument parsing and dispatch to one function per subcommand."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from ..errors import EmberError
from .logs import LEVELS
from .logs import configure as configure_logging


def _hostport(s: str) -> tuple[str, int]:
    host, sep, port = s.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {s!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def _iroh_options(p: argparse.ArgumentParser, serve: bool) -> None:
    p.add_argument("--key", default=None, metavar="PATH",
                   help="secret key file (default: created or reused at $EMBER_KEY or ~/.config/ember/secret.key)")
    p.add_argument("--relay", default=None, metavar="default|disabled|URL[,URL]",
                   help="relay servers for iroh (default: the n0 relays)")
    p.add_argument("--offline", action="store_true", default=None,
                   help="no relays, no discovery: direct addresses only (default when EMBER_OFFLINE=1)")
    p.add_argument("--bind", action="append", default=None, metavar="HOST:PORT",
                   help="exact UDP address for iroh, one per IP family (repeatable; default $EMBER_BIND or all)")
    if serve:
        p.add_argument("--no-iroh", action="store_true", help="do not serve over iroh (WebSocket only)")


def _log_options(p: argparse.ArgumentParser, top: bool) -> None:
    d = None if top else argparse.SUPPRESS
    p.add_argument("--log-level", choices=LEVELS, default=d,
                   help="how much ember logs to stderr (default: info for serve, warning otherwise)")
    p.add_argument("--log-json", action="store_true", default=False if top else argparse.SUPPRESS,
                   help="log one JSON object per line")
    p.add_argument("--debug", action="store_true", default=False if top else argparse.SUPPRESS,
                   help="show tracebacks and debug logs")


def _admin_client_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("address", help="the peer: ws://HOST:PORT, tcp://HOST:PORT, wss://..., or an iroh ticket")
    p.add_argument("--token", default=None, help="the peer's admin token (default: $EMBER_ADMIN_TOKEN)")
    p.add_argument("--key", default=None, metavar="PATH",
                   help="present this iroh identity (a peer allowlisted with ember serve --admin-peer)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to connect and to wait for figures")
    _log_options(p, top=False)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ember", description="Run array code on remote compute peers.")
    _log_options(p, top=True)
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="start a compute peer")
    s.add_argument("--device", action="append", default=[], metavar="SPEC",
                   help="device to host: cpu, torch:cpu, torch:cuda:N, cupy:N, jax:cpu, jax:gpu:N (repeatable)")
    s.add_argument("--websocket", action="append", default=[], type=_hostport, metavar="HOST:PORT",
                   help="serve WebSocket on HOST:PORT (port 0 picks a free port; repeatable)")
    s.add_argument("--tcp", action="append", default=[], type=_hostport, metavar="HOST:PORT",
                   help="serve raw TCP on HOST:PORT, dialled as tcp://HOST:PORT (fastest for bulk data; repeatable)")
    from .serve import add_serve_options
    add_serve_options(s)
    s.add_argument("--metrics", type=_hostport, default=None, metavar="HOST:PORT",
                   help="serve Prometheus /metrics on HOST:PORT (port 0 picks a free port)")
    s.add_argument("--admin-token", default=None, metavar="T",
                   help="operators presenting T may see the whole peer (ember top/status; or EMBER_ADMIN_TOKEN)")
    s.add_argument("--admin-token-file", default=None, metavar="PATH", help="read the admin token from PATH")
    s.add_argument("--admin-peer", action="append", default=[], metavar="PEER_ID",
                   help="an iroh peer id allowed admin access without a token (repeatable)")
    _iroh_options(s, serve=True)
    _log_options(s, top=False)

    st = sub.add_parser("status", help="a peer's figures once: devices, sessions, memory, totals (admin)")
    _admin_client_options(st)
    st.add_argument("--json", action="store_true", help="print the figures as JSON")

    tp = sub.add_parser("top", help="a live view of a peer: devices, sessions, transfers, errors (admin; q quits)")
    _admin_client_options(tp)
    tp.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")

    k = sub.add_parser("keygen", help="write a new secret key (mode 0600) and print its peer id")
    k.add_argument("path", help="where to write the key")
    k.add_argument("--force", action="store_true", help="replace an existing key (its peer id is lost)")
    _log_options(k, top=False)

    dr = sub.add_parser("doctor", help="check that this host can serve over iroh")
    _iroh_options(dr, serve=False)
    dr.add_argument("--timeout", type=float, default=3.0, help="seconds per network check (default 3)")
    _log_options(dr, top=False)

    d = sub.add_parser("demo", help="run a small workload on a loopback peer and check it against NumPy")
    d.add_argument("--address", "--peer", dest="address", default=None,
                   help="use this peer instead of starting one (with --torch: one serving --device torch:cpu)")
    d.add_argument("--steps", type=int, default=None, help="gradient steps (default 300; 200 with --torch)")
    d.add_argument("--torch", action="store_true",
                   help="train a PyTorch MLP through ember.torch and compare it with local CPU torch")
    _log_options(d, top=False)

    r = sub.add_parser("run", help="run an unchanged PyTorch script with \"ember\" as its device (like torchrun)")
    from .launch import add_options as launch_options
    launch_options(r)
    _log_options(r, top=False)

    po = sub.add_parser("pool", help="the broker that leases peers from a Ray cluster (ember[ray])")
    from .pool import add_options as pool_options
    pool_options(po)
    _log_options(po, top=False)

    from ..bench import build_parser as bench_options
    b = sub.add_parser("bench", help="the benchmark suite: every figure per transport, next to baselines")
    bench_options(b)
    _log_options(b, top=False)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = "debug" if args.debug else args.log_level or ("info" if args.command == "serve" else "warning")
    configure_logging(level, args.log_json)
    try:
        if args.command == "serve":
            from .serve import serve
            return serve(args)
        if args.command in ("status", "top"):
            from . import top
            return top.status(args) if args.command == "status" else top.top(args)
        if args.command == "keygen":
            from .identity import keygen
            return keygen(args)
        if args.command == "doctor":
            from .identity import doctor
            return doctor(args)
        if args.command == "demo":
            from ..demo import run, run_torch
            if args.torch:
                return 0 if run_torch(args.address, steps=args.steps or 200) else 1
            return 0 if run(args.address, steps=args.steps or 300) else 1
        if args.command == "run":
            from .launch import run as launch
            return launch(args)
        if args.command == "pool":
            from .pool import run as pool_run
            return pool_run(args)
        if args.command == "bench":
            from ..bench import run_args
            run_args(args)
            return 0
    except EmberError as e:
        if args.debug:
            raise
        print(f"ember {args.command}: error: {e.message}", file=sys.stderr)
        if e.hint:
            print(f"  hint: {e.hint}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
