"""``ember bench``: Ember's benchmark suite, every figure next to baselines measured in the same run.

Figures (each over the in-memory link, WebSocket and iroh, repeated; medians reported):

* ``pipelined``  a chain of 10,000 elementwise ops on 16-element arrays, one read at
  the end (ops/s), with graph caching on (the default: the chain is periodic, so after
  ~500 ops it is replayed in 128-op graphs) and off. Baseline: the same chain in local
  NumPy; rpyc driving remote NumPy (one call per op) where rpyc is installed.
* ``latency``    op + read of a 1-element array, p50 and p99 (µs). Baselines: raw
  asyncio TCP round trip of a small message; a WebSocket echo; an asyncio
  thread-hop round trip (the floor of the in-memory link); rpyc per call.
* ``bandwidth``  upload and download of 16 MiB and 256 MiB (MB/s, 1 MB = 10^6 bytes).
  Baseline: raw asyncio TCP bulk transfer of the same size.
* ``graphs``     wire bytes of a repeated ~50-op training step, first (sent op by op)
  vs replayed (op-graph caching), and the step time with graph caching off and on.
* ``memory``     peak client memory during a 1 GiB upload over the array's size (a fresh
  client process per transport).
* ``--link-delay MS``: the slow-link figure (``bench.slow_link``): the demo fit, an Array API
  training loop and an unchanged PyTorch loop through ``ember.torch`` with the peer behind a
  delaying loopback proxy, against torch.rpc (one call per op).

Baselines for latency, bandwidth and pipelined ops also include torch.distributed.rpc
(``bench.rpc_baseline``: TensorPipe's default transports, and its TCP transport alone),
each run alternating with Ember's runs. Ratios against the issue's targets are printed
after the table.

The server runs in a separate process (``python -m ember.bench --child``) that also
hosts the raw-TCP and rpyc baselines; with two or more CPUs the client is pinned to
core 0 and the server to core 1. Results go to stdout (a table) and to
``bench/results/bench-<time>.json`` (plus a PNG chart when matplotlib is importable).

``bench/run_suite.py`` and ``bench/bench_small_ops.py`` are the scripts in the
repository; ``ember bench --quick`` is the seconds-long smoke version used by the tests.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Callable

from .common import FIGURES, TRANSPORTS, Config
from .report import format_ratios, format_table, write_chart
from .server_process import child_main
from .suite import Suite

__all__ = ["build_parser", "main", "run", "run_args"]


def run(argv: list[str] | None = None, out: Callable[[str], None] = print) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    return run_args(args, out)


def run_args(args: argparse.Namespace, out: Callable[[str], None] = print) -> dict[str, Any]:
    os.environ.setdefault("EMBER_OFFLINE", "1")  # loopback only: no relays, no discovery
    cfg = Config.make(args.quick, args.repeat)
    if args.link_delay:
        cfg.link_delays = tuple(float(x) for x in args.link_delay.split(",") if x.strip())
    if args.link_steps:
        cfg.link_steps = args.link_steps
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    figures = [f.strip() for f in args.only.split(",") if f.strip()] if args.only else list(FIGURES)
    for t in transports:
        if t not in TRANSPORTS:
            raise SystemExit(f"ember bench: unknown transport {t!r} (choose from {', '.join(TRANSPORTS)})")
    for f in figures:
        if f not in FIGURES:
            raise SystemExit(f"ember bench: unknown figure {f!r} (choose from {', '.join(FIGURES)})")
    report = Suite(cfg, transports, figures, pin=not args.no_pin, log=out).run()
    out(format_table(report))
    out(format_ratios(report))
    os.makedirs(args.out, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = os.path.join(args.out, f"bench-{'quick-' if cfg.quick else ''}{stamp}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    report["json_path"] = path
    out(f"ember bench: wrote {path}")
    if not args.no_chart:
        png = write_chart(report, path[:-5] + ".png")
        out(f"ember bench: wrote {png}" if png else "ember bench: no chart (matplotlib is not installed)")
    return report


def build_parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = p or argparse.ArgumentParser(prog="ember bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes, few repeats: a smoke run of seconds")
    p.add_argument("--transports", default=",".join(TRANSPORTS),
                   help="comma-separated, from: memory, websocket, tcp, iroh (default: all)")
    p.add_argument("--only", default="", help=f"comma-separated figures, from: {', '.join(FIGURES)}")
    p.add_argument("--repeat", type=int, default=None, help="runs per figure (default 5, quick 2)")
    p.add_argument("--out", default=os.path.join("bench", "results"), help="directory for the JSON (and PNG)")
    p.add_argument("--no-pin", action="store_true", help="do not pin client and server to separate cores")
    p.add_argument("--no-chart", action="store_true", help="do not write the PNG chart")
    p.add_argument("--link-delay", default="", metavar="MS[,MS]",
                   help="also run the slow-link figure with the peer behind a loopback proxy adding this RTT "
                        "(e.g. 10,50): the demo fit and a training loop, against torch.rpc one call per op")
    p.add_argument("--link-steps", type=int, default=None, help="steps of each slow-link workload (default 50)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    core = int(argv[argv.index("--core") + 1]) if "--core" in argv else None
    if argv and argv[0] == "--child":
        child_main(core, "--no-iroh" not in argv)
        return 0
    if argv and argv[0] == "--memory-child":
        from .server_process import memory_child
        memory_child(argv[1], int(argv[2]))
        return 0
    if argv and argv[0] == "--proxy":
        from .slow_link import proxy_main
        proxy_main(argv[1], argv[argv.index("--upstream") + 1], float(argv[argv.index("--delay-ms") + 1]), core)
        return 0
    if argv and argv[0] in ("--rpc-server", "--rpc-client"):
        from . import rpc_baseline
        port, transport = int(argv[argv.index("--port") + 1]), argv[argv.index("--rpc-transport") + 1]
        (rpc_baseline.server_main if argv[0] == "--rpc-server" else rpc_baseline.client_main)(port, core, transport)
        return 0
    run(argv)
    return 0
