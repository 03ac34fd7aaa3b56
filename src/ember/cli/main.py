"""``ember`` command line: argument parsing and dispatch to one function per subcommand."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Sequence

from ..errors import EmberError


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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ember", description="Run array code on remote compute peers.")
    p.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="start a compute peer")
    s.add_argument("--device", action="append", default=[], metavar="SPEC",
                   help="device to host: cpu, torch:cpu, torch:cuda:N, cupy:N, jax:cpu, jax:gpu:N (repeatable)")
    s.add_argument("--websocket", action="append", default=[], type=_hostport, metavar="HOST:PORT",
                   help="serve WebSocket on HOST:PORT (port 0 picks a free port; repeatable)")
    s.add_argument("--tcp", action="append", default=[], type=_hostport, metavar="HOST:PORT",
                   help="serve raw TCP on HOST:PORT, dialled as tcp://HOST:PORT (fastest for bulk data; repeatable)")
    s.add_argument("--token", default=None, help="require this credential from clients (or EMBER_TOKEN)")
    s.add_argument("--tls-cert", default=None, metavar="PEM", help="serve WebSocket and TCP over TLS (wss://, tcps://) with this certificate chain")
    s.add_argument("--tls-key", default=None, metavar="PEM", help="private key for --tls-cert (default: in the cert file)")
    s.add_argument("--max-sessions", type=int, default=256)
    _iroh_options(s, serve=True)
    s.add_argument("--debug", action="store_true", default=argparse.SUPPRESS)

    k = sub.add_parser("keygen", help="write a new secret key (mode 0600) and print its peer id")
    k.add_argument("path", help="where to write the key")
    k.add_argument("--force", action="store_true", help="replace an existing key (its peer id is lost)")
    k.add_argument("--debug", action="store_true", default=argparse.SUPPRESS)

    dr = sub.add_parser("doctor", help="check that this host can serve over iroh")
    _iroh_options(dr, serve=False)
    dr.add_argument("--timeout", type=float, default=3.0, help="seconds per network check (default 3)")
    dr.add_argument("--debug", action="store_true", default=argparse.SUPPRESS)

    d = sub.add_parser("demo", help="run a small workload on a loopback peer and check it against NumPy")
    d.add_argument("--address", "--peer", dest="address", default=None,
                   help="use this peer instead of starting one (with --torch: one serving --device torch:cpu)")
    d.add_argument("--steps", type=int, default=None, help="gradient steps (default 300; 200 with --torch)")
    d.add_argument("--torch", action="store_true",
                   help="train a PyTorch MLP through ember.torch and compare it with local CPU torch")
    d.add_argument("--debug", action="store_true", default=argparse.SUPPRESS)

    from ..bench import build_parser as bench_options
    b = sub.add_parser("bench", help="the benchmark suite: every figure per transport, next to baselines")
    bench_options(b)
    b.add_argument("--debug", action="store_true", default=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        if args.command == "serve":
            from .serve import serve
            return serve(args)
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
