"""``bench/bench_opinfo.py``: run slices of the OpInfo database into JSON lines, and print the table."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from typing import Any

os.environ.setdefault("EMBER_OFFLINE", "1")


def _peer(kind: str) -> Any:
    """None (the embedded peer), or a WebSocket ``Server(["torch:cpu"])`` in this process, set as default."""
    if kind == "local":
        return None
    import ember
    from ember.server import Server
    srv = Server(["torch:cpu"])
    srv.listen_websocket("127.0.0.1", 0)
    addr = srv.start_in_thread()[0]
    ember.set_default_device(ember.connect(addr))
    return srv


def run(args: argparse.Namespace) -> None:
    import torch
    import ember.torch  # noqa: F401 - registers the device
    from . import opinfo as O
    torch.set_num_threads(1)
    srv = _peer(args.peer)
    db = O.op_db()
    chosen = set(args.ops.split(",")) if args.ops else None
    with open(args.out, "a") as f:
        for k, op in enumerate(db[args.start:args.stop], args.start):
            if chosen is not None and op.name not in chosen:
                continue
            for p in args.passes.split(","):
                if not O.applies(op, p) or p not in O.PASSES or args.every and p in ("f64", "i64", "bool"):
                    continue
                row = O.run_op(op, p, every=args.every, limit_s=args.limit)
                row["index"], row["peer"] = k, args.peer
                f.write(json.dumps(row) + "\n")
                f.flush()
                if row["status"] != "pass":
                    print(f"{k} {row['op']} {p}: {row['status']} {row['detail'][:150]}", flush=True)
    if srv is not None:
        srv.close()


def table(paths: list[str]) -> str:
    """The issue's table: per pass and sample set, ops passing / ops run (%), and how many were wrong."""
    rows: dict[tuple[str, bool, str], dict[str, Any]] = {}
    for p in paths:
        with open(p) as f:
            for line in f:
                r = json.loads(line)
                rows[(r["pass"], r["every"], r["op"])] = r  # a later run of an op replaces an earlier one
    agg: dict[tuple[str, bool], dict[str, int]] = defaultdict(lambda: {"pass": 0, "error": 0, "wrong": 0})
    for (p, every, _op), r in rows.items():
        if r["status"] != "n/a":  # CPU torch's own sample generator failed: no reference
            agg[(p, every)][r["status"]] += 1
    out = ["| pass | 3 samples per op | every sample (reference_inputs) |", "|---|---|---|"]
    from .opinfo import PASSES
    for p in PASSES:
        cells = []
        for every in (False, True):
            a = agg.get((p, every))
            if not a:
                cells.append("—")
                continue
            n = sum(a.values())
            cells.append(f"{a['pass']}/{n} ({100 * a['pass'] / n:.1f} %), {a['wrong']} silently wrong")
        out.append(f"| {p} | {cells[0]} | {cells[1]} |")
    return "\n".join(out)


def failures(paths: list[str]) -> str:
    rows: dict[tuple[str, bool, str], dict[str, Any]] = {}
    for p in paths:
        with open(p) as f:
            for line in f:
                r = json.loads(line)
                rows[(r["pass"], r["every"], r["op"])] = r
    return "\n".join(f"{r['pass']}{'*' if r['every'] else ''} {r['op']}: {r['status']} {r['detail'][:160]}"
                     for r in rows.values() if r["status"] not in ("pass", "n/a"))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--pass", dest="passes", default="forward")
    r.add_argument("--every", action="store_true", help="every sample (reference_inputs), not the first 3")
    r.add_argument("--start", type=int, default=0)
    r.add_argument("--stop", type=int, default=None)
    r.add_argument("--ops", default="")
    r.add_argument("--peer", choices=("local", "ws"), default="local")
    r.add_argument("--limit", type=int, default=60, help="seconds per op and pass")
    r.add_argument("--canary", action="store_true",
                   help="fill every malloc'd buffer with a canary (glibc malloc.perturb) and fail any ember result "
                        "that holds it: memory no kernel wrote (the process re-runs itself under it)")
    r.add_argument("--out", required=True)
    t = sub.add_parser("table")
    t.add_argument("paths", nargs="+")
    t.add_argument("--failures", action="store_true")
    a = ap.parse_args(argv)
    if a.cmd == "run" and a.canary:
        from .opinfo import canary_env, canary_on
        if not canary_on():  # (glibc reads its tunables at start: a process of its own)
            os.execve(sys.executable, [sys.executable, "-m", "ember.bench.opinfo_cli",
                                       *(argv if argv is not None else sys.argv[1:])], canary_env())
    if a.cmd == "run":
        run(a)
    else:
        print(table(a.paths))
        if a.failures:
            print(failures(a.paths))
    sys.stdout.flush()


__all__ = ["main", "table", "run"]


if __name__ == "__main__":
    main()
