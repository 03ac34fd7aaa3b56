"""What telemetry costs: pipelined ops/s with the probe unsubscribed and subscribed, against a baseline.

Three servers, measured alternately in every round so that all see the same machine:

* ``base``: the code before telemetry (``--baseline-src``, e.g. ``/work/main/src``);
* ``off``:  this tree, as ``ember serve`` runs it: the probe compiled in, only session-event
  subscribers (the figures for ``ember top``/``status`` and the session log);
* ``metrics``: this tree with op events subscribed by Prometheus ``/metrics`` (its figures
  aggregate every op), as ``ember serve --metrics`` runs;
* ``all``:  ``metrics`` plus a Python subscriber that receives every event (``Op`` objects).

Figures: the pipelined chain of ``ember bench`` (10,000 elementwise ops on 16-element arrays,
one read) over WebSocket (server in its own process, pinned to core 1, the client on core 0)
and over the in-memory link (client and server in one process, one per variant and round),
each with op-graph caching on (the default) and off. Medians over rounds, and the ratios to
``base`` (targets: ``off`` >= 0.97, subscribed >= 0.85).

    PYTHONPATH=src python bench/bench_telemetry.py --baseline-src /work/main/src --rounds 7
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

HERE = os.path.abspath(__file__)
VARIANTS = ("base", "off", "metrics", "all")


def _subscribe(srv: Any, variant: str) -> None:
    """``metrics``: figures with op events (what --metrics does); ``all``: and a subscriber of every event."""
    srv.figures.stop()
    srv.figures.start(ops=True)
    if variant != "all":
        return
    sub = srv.telemetry.subscribe()

    def drain() -> None:
        n = 0
        while not sub.closed:
            for ev in sub:
                n += 1
    threading.Thread(target=drain, daemon=True).start()


def _server_child(variant: str, core: int | None) -> None:
    if core is not None:
        os.sched_setaffinity(0, {core})
    from ember.server import Server
    srv = Server(["cpu"])
    srv.listen_websocket("127.0.0.1", 0)
    if variant in ("metrics", "all"):
        srv.listen_metrics("127.0.0.1", 0)
    srv.start_in_thread()
    if variant == "all":
        _subscribe(srv, variant)
    print(json.dumps({"address": srv.addresses[0]}), flush=True)
    for _ in sys.stdin:  # each line asks for this process's CPU seconds so far
        print(time.process_time(), flush=True)
    srv.close()


def _memory_child(variant: str, chain: int, repeat: int, core: int | None) -> None:
    if core is not None:
        os.sched_setaffinity(0, {core})
    import ember
    from ember.bench.figures import ember_pipelined
    if variant != "base":  # as `ember serve` runs: session-event subscribers on
        srv = ember.embedded.local_server()
        srv.figures.start()
        srv.session_log.start()
        if variant in ("metrics", "all"):
            _subscribe(srv, variant)
    out = {}
    for graphs in (True, False):
        d = ember.connect("local", graphs=graphs)
        ember_pipelined(d, 2000)
        key = "graphs" if graphs else "nographs"
        c0 = time.process_time()
        out[key] = [ember_pipelined(d, chain) for _ in range(repeat)]
        out["cpu:" + key] = [(time.process_time() - c0) / (repeat * chain)]  # CPU seconds per op, all threads
        d.close()
    print(json.dumps(out), flush=True)


def _server_cpu(p: subprocess.Popen) -> float:
    p.stdin.write("cpu\n")
    p.stdin.flush()
    return float(p.stdout.readline())


def _env(variant: str, baseline_src: str) -> dict[str, str]:
    src = baseline_src if variant == "base" else os.path.join(os.path.dirname(os.path.dirname(HERE)), "src")
    return {**os.environ, "PYTHONPATH": src, "EMBER_OFFLINE": "1"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline-src", required=True, help="the src/ directory of the code before telemetry")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--chain", type=int, default=10_000)
    p.add_argument("--transports", default="websocket,memory")
    p.add_argument("--out", default=os.path.join("bench", "results"))
    p.add_argument("--server-child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--core", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.server_child:
        return _server_child(args.server_child, args.core)
    if args.memory_child:
        return _memory_child(args.memory_child, args.chain, 1, args.core)

    cores = sorted(os.sched_getaffinity(0))
    pin = len(cores) >= 2
    transports = args.transports.split(",")
    servers: dict[str, subprocess.Popen] = {}
    addresses: dict[str, str] = {}
    if "websocket" in transports:
        for v in VARIANTS:
            cmd = [sys.executable, HERE, "--baseline-src", args.baseline_src, "--server-child", v]
            cmd += ["--core", str(cores[1])] if pin else []
            servers[v] = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                          env=_env(v, args.baseline_src))
            addresses[v] = json.loads(servers[v].stdout.readline())["address"]
    if pin:
        os.sched_setaffinity(0, {cores[0]})
    import ember
    from ember.bench.figures import ember_pipelined
    runs: dict[str, list[float]] = {}
    try:
        devs = {(v, g): ember.connect(a, graphs=g) for v, a in addresses.items() for g in (True, False)}
        for d in devs.values():
            ember_pipelined(d, 2000)  # warm up
        for r in range(args.rounds):
            k = r % len(VARIANTS)
            order = VARIANTS[k:] + VARIANTS[:k]  # rotate who goes first
            for v in order:
                for g in (True, False):
                    if (v, g) in devs:
                        key = "graphs" if g else "nographs"
                        c0 = _server_cpu(servers[v])
                        runs.setdefault(f"websocket/{key}/{v}", []).append(ember_pipelined(devs[v, g], args.chain))
                        runs.setdefault(f"server-cpu:websocket/{key}/{v}", []).append(
                            (_server_cpu(servers[v]) - c0) / args.chain)
                if "memory" in transports:
                    cmd = [sys.executable, HERE, "--baseline-src", args.baseline_src, "--memory-child", v,
                           "--chain", str(args.chain)] + (["--core", str(cores[0])] if pin else [])
                    res = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True,
                                                    env=_env(v, args.baseline_src)).stdout)
                    for k, xs in res.items():
                        name = f"process-cpu:memory/{k[4:]}" if k.startswith("cpu:") else f"memory/{k}"
                        runs.setdefault(f"{name}/{v}", []).extend(xs)
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
        for d in devs.values():
            d.close()
    finally:
        for s in servers.values():
            s.stdin.close()
            s.wait(15)
    report: dict[str, Any] = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "rounds": args.rounds,
                              "chain": args.chain, "pinned": pin, "runs": runs, "medians": {}}
    print(f"{'figure (ops/s)':40}" + "".join(f"{v:>10}" for v in VARIANTS) +
          "".join(f"{v + '/base':>14}" for v in VARIANTS[1:]))
    keys = sorted({k.rsplit('/', 1)[0] for k in runs}, key=lambda k: (":" in k, k))
    for key in keys:
        med = {v: statistics.median(runs[f"{key}/{v}"]) for v in VARIANTS}
        report["medians"][key] = med
        if ":" in key:  # CPU seconds per op: show ns, ratios base/variant (>1 would be cheaper)
            print(f"{key[:40]:40}" + "".join(f"{med[v] * 1e9:>8.0f}ns" for v in VARIANTS) +
                  "".join(f"{med['base'] / med[v]:>14.3f}" for v in VARIANTS[1:]))
        else:
            print(f"{key:40}" + "".join(f"{med[v]:>10,.0f}" for v in VARIANTS) +
                  "".join(f"{med[v] / med['base']:>14.3f}" for v in VARIANTS[1:]))
    print(f"medians over {args.rounds} rounds (variants alternating). ops/s rows: variant/base; CPU rows "
          "(per op; server process, or the whole in-memory process): base/variant.\n"
          "targets: off >= 0.97, metrics and all >= 0.85")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"telemetry-{time.strftime('%Y%m%d-%H%M%S')}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
