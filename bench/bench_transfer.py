"""Peer-to-peer tensor moves vs the same data relayed through the client, in one run.

Starts two `ember serve` peers (offline iroh + WebSocket on loopback), creates a
tensor on peer A and moves it to peer B: directly (B downloads from A) and with
``via_client=True`` (A -> this process -> B). Prints MB/s (median of repeats)
and writes JSON to bench/results/transfer.json.

    python bench/bench_transfer.py [--sizes 16,256] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ENV = {**os.environ, "EMBER_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
CLI = [sys.executable, "-m", "ember.cli.main"]


def start_peer(tmp: str, name: str) -> tuple[subprocess.Popen, str, str]:
    key = os.path.join(tmp, name)
    subprocess.run([*CLI, "keygen", key], check=True, capture_output=True, env=ENV)
    p = subprocess.Popen([*CLI, "serve", "--offline", "--key", key, "--bind", "127.0.0.1:0",
                          "--websocket", "127.0.0.1:0"], stdout=subprocess.PIPE, text=True, env=ENV)
    ws = ticket = ""
    assert p.stdout is not None
    for line in p.stdout:
        if mm := re.search(r"listening on (ws://\S+)", line):
            ws = mm.group(1)
        if mm := re.search(r"iroh ticket (endpoint\S+)", line):
            ticket = mm.group(1)
        if "relay-mode" in line:
            break
    return p, ws, ticket


def measure(src_addr: str, dst_addr: str, mib: int, via_client: bool, repeat: int) -> float:
    import ember
    import ember.array_api as xp
    src, dst = ember.connect(src_addr), ember.connect(dst_addr)
    x = xp.ones((mib * 1024 * 1024 // 8,), device=src) * 2.0
    src.sync()
    rates = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        y = x.to_device(dst, via_client=via_client, timeout=300)
        dst.sync(timeout=300)
        rates.append(mib * 1.048576 / (time.perf_counter() - t0))
        del y
    src.close()
    dst.close()
    return statistics.median(rates)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="16,256")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="ember-bench-")
    (pa, wa, ta), (pb, wb, tb) = start_peer(tmp, "a"), start_peer(tmp, "b")
    rows = []
    try:
        for mib in [int(s) for s in args.sizes.split(",")]:
            for transport, (a, b) in (("iroh", (ta, tb)), ("websocket", (wa, wb))):
                direct = measure(a, b, mib, False, args.repeat)
                relay = measure(a, b, mib, True, args.repeat)
                rows.append({"MiB": mib, "transport": transport, "peer_to_peer_MBps": round(direct, 1),
                             "via_client_MBps": round(relay, 1)})
                print(f"{mib:>5} MiB  {transport:<9}  peer-to-peer {direct:8.1f} MB/s   via client {relay:8.1f} MB/s",
                      flush=True)
    finally:
        pa.kill()
        pb.kill()
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / "transfer.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
