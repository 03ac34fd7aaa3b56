"""The protocol fuzzer at volume: >= 100,000 hostile cases against a live peer, with a canary client.

Hypothesis draws a corpus of structured hostile messages, frames, Hello/transfer
first frames and raw iroh streams (``ember.bench.fuzz_cases``); a seeded
mutator recombines it into ``--cases`` cases fed to a peer in this process over
WebSocket and offline iroh on loopback, while a canary client checks every
result against NumPy. Prints cases, cases/s, crashes, hangs (a SYNC neither
answered nor followed by the peer closing that session) and the canary's
figures, and writes JSON to bench/results/fuzz.json.

    python bench/bench_fuzz.py [--cases 100000] [--seed 1] [--corpus 3000]

Exit status 1 when anything was found.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("EMBER_OFFLINE", "1")
os.environ.setdefault("EMBER_CLIENT_BIND", "127.0.0.1:0,[::1]:0")

from ember.bench import fuzz  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", type=int, default=100_000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--corpus", type=int, default=None, help="items hypothesis draws (default min(cases, 3000)/2)")
    p.add_argument("--hang-timeout", type=float, default=20.0)
    args = p.parse_args()
    step = max(1000, args.cases // 20)

    def progress(r: fuzz.Report) -> None:
        if r.cases % step < fuzz.CASES_PER_EXAMPLE:
            print(f"  {r.cases:>7} cases  {len(r.crashes)} crashes  {len(r.hangs)} hangs  "
                  f"canary {r.canary_checks}", flush=True)

    r = fuzz.run(cases=args.cases, seed=args.seed, hang_timeout=args.hang_timeout, corpus=args.corpus,
                 progress=progress)
    print(r.summary())
    for c in r.crashes[:5]:
        print("CRASH:", c[:3000])
    for h in r.hangs[:5]:
        print("HANG:", h[:1000])
    for c in r.canary_failures[:5]:
        print("CANARY:", c)
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / "fuzz.json").write_text(json.dumps({
        "cases": r.cases, "seconds": r.seconds, "cases_per_s": r.cases_per_s, "crashes": len(r.crashes),
        "hangs": len(r.hangs), "canary_checks": r.canary_checks, "canary_failures": len(r.canary_failures),
        "sessions_ended_by_peer": r.sessions_ended_by_peer, "alive_after": r.alive_after,
        "budget_after": r.budget_after, "kinds": dict(r.kinds), "seed": args.seed}, indent=2))
    return 0 if r.ok() else 1


if __name__ == "__main__":
    sys.exit(main())
