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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ember", description="Run array code on remote compute peers.")
    p.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="start a compute peer")
    s.add_argument("--device", action="append", default=[], metavar="SPEC",
                   help="device to host: cpu, torch:cpu, torch:cuda:N, cupy:N, jax:cpu, jax:gpu:N (repeatable)")
    s.add_argument("--websocket", action="append", default=[], type=_hostport, metavar="HOST:PORT",
                   help="serve WebSocket on HOST:PORT (port 0 picks a free port; repeatable)")
    s.add_argument("--token", default=None, help="require this credential from clients (or EMBER_TOKEN)")
    s.add_argument("--max-sessions", type=int, default=256)
    s.add_argument("--debug", action="store_true", default=argparse.SUPPRESS)

    d = sub.add_parser("demo", help="run a small workload on a loopback peer and check it against NumPy")
    d.add_argument("--address", default=None, help="use this peer instead of starting one")
    d.add_argument("--steps", type=int, default=300)
    d.add_argument("--debug", action="store_true", default=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        if args.command == "serve":
            from .serve import serve
            return serve(args)
        if args.command == "demo":
            from ..demo import run
            return 0 if run(args.address, steps=args.steps) else 1
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
