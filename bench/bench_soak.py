"""Soak: 64 concurrent sessions from 4 client processes, random mixed work checked against NumPy.

This process hosts the peer (NumPy, WebSocket on loopback); four client
processes each open 16 sessions (one thread each) and run random mixed work
(elementwise chains, matmuls, reductions and indexing, ~1 MB uploads and reads,
graph-cached loops, creation + where) for ``--seconds``, checking every result
against NumPy. Twice during the run one client process is SIGKILLed mid-batch
and replaced. At the end every session has gone; the peer's memory budget must
be back at zero and its RSS within 10 % of the baseline measured after a
warm-up with the same load in the same run. Prints sessions held, ops/s, results checked, anything
lost, budget and RSS, and writes JSON to bench/results/soak.json.

    python bench/bench_soak.py [--seconds 60] [--processes 4] [--sessions 16]

Exit status 1 when a check failed, something was lost, or the end figures are off.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("EMBER_OFFLINE", "1")


# ---- the client processes ------------------------------------------------------------------

def step(rng: np.random.Generator, dev: Any) -> int:
    """One random piece of work on ``dev``; returns the results checked (raises on a mismatch)."""
    import ember.array_api as xp
    kind = int(rng.integers(0, 6))
    a = rng.standard_normal(int(rng.integers(1, 4096)))
    x = xp.asarray(a, device=dev)
    if kind == 0:
        pairs = [((xp.tanh(x) * 2.0 + x * x).to_numpy(), np.tanh(a) * 2.0 + a * a)]
    elif kind == 1:
        k = int(rng.integers(1, 48))
        m = rng.standard_normal((k, k))
        xm = xp.asarray(m, device=dev)
        pairs = [((xm @ xp.matrix_transpose(xm) + 1.0).to_numpy(), m @ m.T + 1.0)]
    elif kind == 2:
        idx = rng.integers(0, a.size, size=min(16, a.size))
        pairs = [(float(xp.sum(x)), a.sum()), (float(xp.max(x)), a.max()),
                 (x[xp.asarray(idx, device=dev)].to_numpy(), a[idx]), (x[::3].to_numpy(), a[::3])]
    elif kind == 3:
        b = rng.standard_normal(1 << 17)  # 1 MiB up, 1 MiB down
        pairs = [((xp.asarray(b, device=dev) - 0.5).to_numpy(), b - 0.5)]
    elif kind == 4:
        w, v = xp.asarray(a[:16], device=dev), a[:16].copy()
        for _ in range(24):  # a recurring group: replayed from the graph cache
            w = w * 0.9 + xp.sin(w) * 0.1
            v = v * 0.9 + np.sin(v) * 0.1
        pairs = [(w.to_numpy(), v)]
    else:
        z = xp.zeros(a.shape, device=dev)
        pairs = [(xp.where(x > 0.0, x, z).to_numpy(), np.where(a > 0, a, 0.0)),
                 (float(xp.sum(xp.ones((64, 64), device=dev))), 4096.0)]
    for got, want in pairs:
        if not np.allclose(got, want, rtol=1e-10, atol=1e-10):
            raise AssertionError(f"work kind {kind}: result differs from NumPy")
    return len(pairs)


def client_main(address: str, sessions: int, seconds: float, seed: int) -> int:
    import ember
    stop_at = time.monotonic() + seconds
    out = {"checks": 0, "ops": 0, "errors": [], "sessions": 0}
    lock = threading.Lock()

    def worker(i: int) -> None:
        rng = np.random.default_rng([seed, i])
        try:
            dev = ember.connect(address, timeout=30.0)
        except Exception as e:  # noqa: BLE001
            with lock:
                out["errors"].append(f"connect: {type(e).__name__}: {e}")
            return
        with lock:
            out["sessions"] += 1
        checks = 0
        try:
            while time.monotonic() < stop_at:
                checks += step(rng, dev)
        except Exception as e:  # noqa: BLE001
            with lock:
                out["errors"].append(f"{type(e).__name__}: {e}")
        with lock:
            out["checks"] += checks
            out["ops"] += dev.stats()["ops"]
        dev.close()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print("RESULT " + json.dumps(out), flush=True)
    return 0


# ---- the driver (the peer) --------------------------------------------------------------------

def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def spawn(address: str, sessions: int, seconds: float, seed: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, "--client", address, "--sessions", str(sessions),
                             "--seconds", f"{seconds:.1f}", "--seed", str(seed)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def result_of(p: subprocess.Popen, timeout: float) -> dict[str, Any] | None:
    out, err = p.communicate(timeout=timeout)
    for line in out.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return None


def settle(srv: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while (srv.sessions or srv.live or srv.memory_held()) and time.monotonic() < deadline:
        time.sleep(0.05)
    gc.collect()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--processes", type=int, default=4)
    p.add_argument("--sessions", type=int, default=16, help="sessions per client process")
    p.add_argument("--kills", type=int, default=2, help="client processes SIGKILLed (and replaced) mid-run")
    p.add_argument("--client", default=None, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.client:
        return client_main(args.client, args.sessions, args.seconds, args.seed)

    from ember.server import Server
    total = args.processes * args.sessions
    srv = Server(["cpu"], max_sessions_per_client=total + args.sessions, session_memory="256MiB")
    srv.listen_websocket("127.0.0.1", 0)
    address = srv.start_in_thread()[0]
    print(f"peer at {address}; warm-up (the same load, briefly: one-time native allocations such as "
          "BLAS buffers and per-thread malloc arenas happen before the baseline)", flush=True)
    warm = [spawn(address, args.sessions, min(10.0, args.seconds / 6), 900 + k) for k in range(args.processes)]
    for w in warm:
        result_of(w, 120)
    settle(srv)
    baseline = rss()
    if os.environ.get("SOAK_DEBUG"):
        import collections
        import sys as _sys
        baseline_blocks = _sys.getallocatedblocks()
        baseline_counts = collections.Counter(type(o).__name__ for o in gc.get_objects())
        baseline_objects = sum(baseline_counts.values())
    print(f"baseline RSS {baseline / 2**20:.1f} MiB; {total} sessions from {args.processes} processes "
          f"for {args.seconds:g} s", flush=True)

    t0 = time.monotonic()
    procs = [spawn(address, args.sessions, args.seconds, k) for k in range(args.processes)]
    killed: list[subprocess.Popen] = []
    held, peak_budget = [], 0
    kill_times = [args.seconds * (k + 1) / (args.kills + 1) for k in range(args.kills)]
    while time.monotonic() - t0 < args.seconds:
        time.sleep(0.5)
        now = time.monotonic() - t0
        held.append(len(srv.sessions))
        peak_budget = max(peak_budget, srv.memory_held())
        if kill_times and now >= kill_times[0]:
            kill_times.pop(0)
            victim = procs.pop(0)
            victim.send_signal(signal.SIGKILL)  # mid-batch: the clients never stop working
            killed.append(victim)
            procs.append(spawn(address, args.sessions, max(1.0, args.seconds - now), 100 + len(killed)))
            print(f"  {now:5.1f} s: SIGKILLed client {victim.pid}, started a replacement", flush=True)
    results = [result_of(p_, 180) for p_ in procs]
    for v in killed:
        v.wait(10)
    wall = time.monotonic() - t0
    settle(srv)
    end_budget, end_rss = srv.memory_held(), rss()
    if os.environ.get("SOAK_DEBUG"):
        import collections
        import sys as _sys
        print("blocks", _sys.getallocatedblocks(), "baseline blocks", baseline_blocks)
        counts = collections.Counter(type(o).__name__ for o in gc.get_objects())
        print("objects", sum(counts.values()), "baseline", baseline_objects)
        print((counts - baseline_counts).most_common(15))
    srv.close()

    lost = [r is None for r in results].count(True)
    errors = [e for r in results if r for e in r["errors"]]
    checks = sum(r["checks"] for r in results if r)
    ops = sum(r["ops"] for r in results if r)
    summary = {
        "sessions": total, "processes": args.processes, "seconds": args.seconds, "wall_s": wall,
        "sessions_held_median": statistics.median(held) if held else 0, "sessions_held_min_after_start":
            min(held[4:] or held or [0]), "sessions_held_max": max(held or [0]),
        "ops": ops, "ops_per_s": ops / wall, "results_checked": checks, "client_processes_killed": len(killed),
        "surviving_processes_without_result": lost, "errors_in_surviving_clients": errors[:10],
        "peak_budget_bytes": peak_budget, "end_budget_bytes": end_budget,
        "baseline_rss_mib": baseline / 2**20, "end_rss_mib": end_rss / 2**20, "rss_ratio": end_rss / baseline,
    }
    print(json.dumps(summary, indent=2))
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / "soak.json").write_text(json.dumps(summary, indent=2))
    ok = not errors and not lost and end_budget == 0 and end_rss <= 1.10 * baseline and checks > 0
    print("OK" if ok else "FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
