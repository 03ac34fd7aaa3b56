"""The upload bomb: tiny UPLOAD frames declaring huge totals, against `ember serve` (RSS before/after).

For each source tree (``--tree NAME=PATH``, default: this checkout; add the
baseline, e.g. ``--tree main=/work/main/src``) the script starts
``ember serve --websocket 127.0.0.1:0 --no-iroh`` with that tree on PYTHONPATH
and the serve flags given (``--serve-args``), opens a raw WebSocket session
and sends ``--count`` UPLOAD frames of ~40 bytes, each declaring ``--gib`` GiB
and carrying one byte (``--fill MIB``: then that much real data for each), then reads one
of them back. It reports the peer's RSS
before and after, what the read answered, and whether a second client is still
served. Trees alternate and repeat (``--repeat``) so both see the same machine.

    python bench/bench_upload_bomb.py --tree main=/work/main/src --tree hardening=src [--gib 1 --count 3]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import msgpack


def peer_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def bomb(tree: str, gib: float, count: int, serve_args: list[str], fill_mib: int = 0) -> dict:
    env = {**os.environ, "PYTHONPATH": tree, "EMBER_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen([sys.executable, "-c", "import sys; from ember.cli.main import main; sys.exit(main())",
                          "serve", "--websocket", "127.0.0.1:0", "--no-iroh", *serve_args],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert p.stdout is not None
        addr = None
        for line in p.stdout:
            found = re.search(r"listening on (ws://\S+)", line)
            if found:
                addr = found.group(1)
                break
        assert addr, "no address"
        from websockets.sync.client import connect
        time.sleep(0.5)
        before = peer_rss(p.pid)
        total = int(gib * (1 << 30))
        ws = connect(addr, max_size=None)
        ws.send(msgpack.packb({"type": "hello", "protocol": 1, "session_id": os.urandom(16), "device": 0,
                               "credential": b"", "client": "bomb"}))
        ws.recv(timeout=10)
        sizes = []
        for i in range(count):
            frame = msgpack.packb([[1, 10 + i, "uint8", [total], 0, b"x", total]], use_bin_type=True)
            sizes.append(len(frame))
            ws.send(frame)
            chunk = b"\1" * (1 << 20)
            for off in range(1, min(total, fill_mib << 20), 1 << 20):  # then real bytes, if asked
                ws.send(msgpack.packb([[1, 10 + i, "uint8", [total], off, chunk[:min(1 << 20, total - off)], total]],
                                      use_bin_type=True))
        ws.send(msgpack.packb([[3, 1, 10], [4, 2]]))  # READ the first one, SYNC
        t0 = time.monotonic()
        answer = None
        while time.monotonic() - t0 < 60:
            for r in msgpack.unpackb(ws.recv(timeout=60)):
                if r[0] == 1:
                    answer = r[2]["kind"] + ": " + r[2]["message"][:160] if r[1] == 1 else "answered with data"
                if r[0] == 2:
                    break
            else:
                continue
            break
        after = peer_rss(p.pid)
        served = subprocess.run(
            [sys.executable, "-c", "import ember, ember.array_api as xp; d = ember.connect(%r);"
             "print(float(xp.sum(xp.arange(10, device=d))))" % addr],
            capture_output=True, text=True, env=env, timeout=60).stdout.strip() == "45.0"
        ws.close()
        return {"frame_bytes": sizes, "declared_gib": gib * count, "rss_before_mib": before / 2**20,
                "rss_after_mib": after / 2**20, "rss_growth_mib": (after - before) / 2**20, "read": answer,
                "other_client_served": served}
    finally:
        p.kill()
        p.wait(10)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", default=[], metavar="NAME=PATH")
    ap.add_argument("--gib", type=float, default=1.0, help="GiB each UPLOAD declares (default 1)")
    ap.add_argument("--count", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--fill", type=int, default=0, metavar="MIB",
                    help="after each declaring frame, send this many MiB of real data for that upload")
    ap.add_argument("--serve-args", default="", help="extra `ember serve` flags, e.g. '--session-memory 1GiB'")
    args = ap.parse_args()
    trees = [t.split("=", 1) for t in args.tree] or [["this", str(Path(__file__).resolve().parents[1] / "src")]]
    results: dict[str, list] = {name: [] for name, _ in trees}
    for _ in range(args.repeat):
        for name, path in trees:
            r = bomb(os.path.abspath(path), args.gib, args.count, args.serve_args.split(), args.fill)
            results[name].append(r)
            print(f"{name:>12}: RSS {r['rss_before_mib']:.0f} -> {r['rss_after_mib']:.0f} MiB "
                  f"(+{r['rss_growth_mib']:.0f}) after {args.count} frames of {r['frame_bytes'][0]} bytes "
                  f"declaring {args.gib:g} GiB each{f' (+{args.fill} MiB of data each)' if args.fill else ''}; "
                  f"read: {r['read']}; other client served: "
                  f"{r['other_client_served']}", flush=True)
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / "upload_bomb.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
