"""The long hostile-argument run: every public function of ``ember.array_api`` called with hostile
arguments (``ember.testing``), round after round, over ``"local"`` and over a WebSocket peer, a canary
op on the same session after each call. Reports how many hostile calls ran, how many raised (at the
call, as they should), how many problems (an unexpected exception type, an unsendable message, a
wrong canary) and how many sessions were lost (must be 0).

    python bench/bench_hostile.py --cases 20000            # stop after this many hostile calls
    python bench/bench_hostile.py --minutes 5 --seed 7     # or after this long
    python bench/bench_hostile.py --transports local       # one transport only
    python bench/bench_hostile.py --json

The peers refuse tensors over 32 MiB (``max_tensor``): a hostile size is refused at the call by the
client's checks against that limit, never allocated. Exit status 1 when a session was lost or a
problem seen.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from typing import Any

from hypothesis import HealthCheck, given, seed, settings

import ember.array_api as xp
from ember.testing import Target, calls, hostile_peer, public_functions, run_call


def run(transport: str, cases: int, minutes: float, seed_: int, per_round: int) -> dict[str, Any]:
    with hostile_peer(transport) as target:
        return _rounds(target, transport, cases, minutes, seed_, per_round)


def _rounds(target: Target, transport: str, cases: int, minutes: float, seed_: int, per_round: int) -> dict[str, Any]:
    functions = public_functions(xp)
    stats = {"transport": transport, "functions": len(functions), "calls": 0, "raised": 0, "returned": 0,
             "problems": 0, "sessions_lost": 0, "examples_of_problems": []}
    deadline = time.monotonic() + minutes * 60 if minutes else float("inf")
    t0 = time.monotonic()
    round_ = 0
    try:
        while stats["calls"] < cases and time.monotonic() < deadline:
            for name, fn in functions:
                if stats["calls"] >= cases or time.monotonic() >= deadline:
                    break

                @seed(seed_ * 1_000_003 + round_)
                @settings(max_examples=per_round, deadline=None, database=None, derandomize=False,
                          suppress_health_check=list(HealthCheck))
                @given(call=calls(target, name, fn))
                def one(call: Any) -> None:
                    out = run_call(target, name, fn, *call)
                    stats["calls"] += 1
                    stats["raised" if out.raised is not None else "returned"] += 1
                    if out.problem is not None:
                        stats["problems"] += 1
                        if len(stats["examples_of_problems"]) < 10:
                            stats["examples_of_problems"].append(out.problem[:300])
                    if out.session_lost:
                        stats["sessions_lost"] += 1
                        target.reset()  # new work reconnects: go on with fresh arrays

                one()
                if target.calls > 400:
                    target.reset()
            round_ += 1
    finally:
        stats["seconds"] = round(time.monotonic() - t0, 1)
        stats["rounds"] = round_
    return stats


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=10_000, help="hostile calls per transport, at most")
    ap.add_argument("--minutes", type=float, default=0.0, help="stop a transport after this long (0: no limit)")
    ap.add_argument("--seed", type=int, default=20260101)
    ap.add_argument("--per-round", type=int, default=10, help="calls per function before moving to the next")
    ap.add_argument("--transports", default="local,websocket")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    results = [run(t, a.cases, a.minutes, a.seed, a.per_round) for t in a.transports.split(",")]
    if a.json:
        print(json.dumps(results, indent=2))
    else:
        for r in results:
            print(f"{r['transport']:>9}: {r['calls']} hostile calls ({r['functions']} functions, {r['rounds']} rounds) "
                  f"in {r['seconds']} s: {r['raised']} raised at the call, {r['returned']} returned; "
                  f"problems {r['problems']}, sessions lost {r['sessions_lost']}")
            for p in r["examples_of_problems"]:
                print("           problem:", p)
    return 1 if any(r["sessions_lost"] or r["problems"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
