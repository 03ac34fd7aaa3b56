"""Client-side cost of one namespace call: recording an op, with the batch never flushed.

Every ``ember.array_api`` function computes its result's shape and dtype on the client and
appends one message to the session's pending batch; nothing is sent here (the session is
opened with an idle flush of an hour, and each timed run stays under the peer's batch limit,
``max_messages``: the batch is sent between runs, never during one), so the time measured is
purely the client's: argument checks, promotion, shape inference, id allocation, the
``RemoteArray`` object, and the release of the previous result.

    python bench/bench_client_overhead.py            # table (µs per call, best of 5 runs)
    python bench/bench_client_overhead.py --json     # machine-readable
    python bench/bench_client_overhead.py --quick    # fewer calls per run
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from typing import Any, Callable

import numpy as np


def _time(f: Callable[[], Any], n: int, repeat: int, before: Callable[[], Any] = lambda: None) -> float:
    """Best per-call time in µs over ``repeat`` runs of ``n`` calls (results dropped as they come).

    As ``timeit`` does, the cyclic GC is off while timing: the never-flushed batch grows to
    hundreds of thousands of messages, and full collections walking it would be measured
    instead of the call.
    """
    best = float("inf")
    for _ in range(repeat):
        before()
        gc.collect()
        gc.disable()
        try:
            t0 = time.perf_counter()
            for _ in range(n):
                f()
            best = min(best, (time.perf_counter() - t0) / n * 1e6)
        finally:
            gc.enable()
    return best


def cases(xp: Any, dev: Any) -> dict[str, Callable[[], Any]]:
    a = xp.asarray(np.arange(16.0), device=dev)
    b = xp.asarray(np.ones(16), device=dev)
    m = xp.reshape(a, (4, 4))
    c = a > b
    return {
        "xp.add(a, b)": lambda: xp.add(a, b),
        "a + b": lambda: a + b,
        "a * 2.0": lambda: a * 2.0,
        "xp.exp(a)": lambda: xp.exp(a),
        "xp.where(c, a, b)": lambda: xp.where(c, a, b),
        "xp.sum(a, axis=0)": lambda: xp.sum(a, axis=0),
        "xp.reshape(a, (4, 4))": lambda: xp.reshape(a, (4, 4)),
        "a[1:5]": lambda: a[1:5],
        "xp.matmul(m, m)": lambda: xp.matmul(m, m),
        "xp.astype(a, xp.float32)": lambda: xp.astype(a, xp.float32),
        "xp.linalg.vector_norm(a)": lambda: xp.linalg.vector_norm(a),
        "xp.concat([a, b])": lambda: xp.concat([a, b]),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args(argv)
    n = 2_000 if args.quick else 20_000

    import ember
    import ember.array_api as xp
    results: dict[str, dict[str, float]] = {}
    for label, graphs in (("graph capture on (default)", True), ("graph capture off", False)):
        dev = ember.connect("local", idle_flush=3600.0, max_batch=1 << 40, graphs=graphs)
        s = dev.session
        col = results[label] = {}
        for name, f in cases(xp, dev).items():
            for _ in range(100):
                f()  # warm: the dtype-combination caches
            calls = min(n, s.max_batch // 2)  # (each call may also queue the release of the one before)
            sent: list[int] = []

            def send_then_count() -> None:
                if sent:
                    assert s.stats["batches"] == sent[-1], "the batch was flushed during the measurement"
                dev.sync()
                sent.append(s.stats["batches"])
            col[name] = _time(f, calls, args.repeat, before=send_then_count)
            send_then_count()
        dev.close()
    ref = np.ones(16)
    refs = results["reference (local, no recording)"] = {}
    refs["numpy np.add"] = _time(lambda: np.add(ref, ref), n, args.repeat)
    try:
        import array_api_strict as xs
        sa = xs.asarray(ref)
        refs["array-api-strict xs.add"] = _time(lambda: xs.add(sa, sa), n, args.repeat)
    except ImportError:
        pass
    if args.json:
        json.dump({"unit": "us_per_call", "calls_per_run": n, "repeat": args.repeat, "results": results},
                  sys.stdout, indent=2)
        print()
    else:
        print(f"client overhead per call (µs, best of {args.repeat} runs of {n} calls, batch never flushed)")
        for label, col in results.items():
            print(f"  {label}")
            for name, us in col.items():
                print(f"    {name:38s} {us:7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
