"""Transport benchmark on loopback: Ember over iroh vs WebSocket, and raw frame baselines.

One run measures, for each row:

* ``ember/iroh`` and ``ember/websocket``: the full stack. Upload =
  ``xp.asarray(a, device=dev); dev.sync()``; download = ``x.to_numpy()``;
  op+read = ``float(xp.sum(x + i))`` on a 4-element array (one op, one read).
* ``frames/iroh`` and ``frames/tcp``: the transport alone (length-prefixed
  frames over one iroh stream, or over raw ``asyncio`` TCP streams). Upload =
  send one frame, wait for a 1-byte ack; download = ask for one frame of N
  bytes; op+read = round trip of a 5-byte frame.
* ``frames/iroh slow-copy``: the same with Ember's memmove fast path off on
  both ends (the byte-by-byte copy of iroh 1.2.0's binding), 1 and 16 MiB.

Servers run in subprocesses; the client is this process. Prints a table and
writes JSON to ``bench/results/`` (git-ignored).

    python bench/bench_iroh_transport.py [--sizes 1,16,256] [--latency 300] [--out PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

MiB = 1 << 20
LOOPBACK = ["127.0.0.1:0", "[::1]:0"]
REPS = {1: 10, 16: 4, 256: 2}

# ---- raw frame servers (run as subprocesses) ---------------------------------------------

FRAME_SERVER = r'''
import asyncio, sys
MAX = 600 * 2**20
BLOB = bytes(range(256)) * (1 << 20)  # 256 MiB to serve downloads from
async def serve_frames(recv, send):
    while True:
        f = await recv()
        if f is None:
            return
        if f == b"U":
            await recv(); await send(b"k")
        elif f[:1] == b"D":
            n = int.from_bytes(f[1:9], "big"); await send(memoryview(BLOB)[:n])
        else:
            await send(f)
async def tcp():
    async def handle(r, w):
        async def recv():
            try:
                n = int.from_bytes(await r.readexactly(4), "big")
                return await r.readexactly(n)
            except asyncio.IncompleteReadError:
                return None
        async def send(b):
            w.write(len(b).to_bytes(4, "big")); w.write(b); await w.drain()
        await serve_frames(recv, send); w.close()
    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    print("tcp", srv.sockets[0].getsockname()[1], flush=True)
    await asyncio.Event().wait()
async def iroh():
    from ember.transport import iroh as T
    async def handle(c):
        await serve_frames(c.recv, c.send)
    lst = T.IrohListener(offline=True, bind=["127.0.0.1:0", "[::1]:0"], max_frame=MAX)
    await lst.start(handle)
    print("iroh", lst.ticket, flush=True)
    await asyncio.Event().wait()
asyncio.run(tcp() if sys.argv[1] == "tcp" else iroh())
'''


def _spawn(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(args, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "RUST_BACKTRACE": "0", **(env or {})})


class TcpFrames:
    def __init__(self, port: int) -> None:
        self.port = port

    async def open(self) -> None:
        self.r, self.w = await asyncio.open_connection("127.0.0.1", self.port)

    async def send(self, b: Any) -> None:
        self.w.write(len(b).to_bytes(4, "big"))
        self.w.write(b)
        await self.w.drain()

    async def recv(self) -> bytes:
        n = int.from_bytes(await self.r.readexactly(4), "big")
        return await self.r.readexactly(n)

    async def close(self) -> None:
        self.w.close()


class IrohFrames:
    def __init__(self, ticket: str) -> None:
        self.ticket = ticket

    async def open(self) -> None:
        from ember.transport import iroh as T
        self.c = await T.dial(self.ticket, offline=True, max_frame=600 * MiB)
        self.send, self.recv = self.c.send, self.c.recv

    async def close(self) -> None:
        await self.c.close()


async def _frames_bench(link: Any, sizes: list[int], latency_n: int, reps: dict[int, int]) -> dict[str, Any]:
    await link.open()
    out: dict[str, Any] = {"upload": {}, "download": {}}
    payloads = {s: os.urandom(s * MiB) for s in sizes}
    for s in sizes:
        up, down = [], []
        for _ in range(reps.get(s, 2)):
            t = time.perf_counter()
            await link.send(b"U")
            await link.send(payloads[s])
            assert await link.recv() == b"k"
            up.append(time.perf_counter() - t)
            t = time.perf_counter()
            await link.send(b"D" + (s * MiB).to_bytes(8, "big"))
            got = await link.recv()
            down.append(time.perf_counter() - t)
            assert len(got) == s * MiB
        out["upload"][s], out["download"][s] = up, down
    lat = []
    for i in range(latency_n + 20):
        t = time.perf_counter()
        await link.send(b"P" + i.to_bytes(4, "big"))
        await link.recv()
        if i >= 20:
            lat.append(time.perf_counter() - t)
    out["latency"] = lat
    await link.close()
    return out


def frames_row(kind: str, sizes: list[int], latency_n: int, slow: bool = False) -> dict[str, Any]:
    """Benchmark raw frames against a fresh server subprocess."""
    from ember.transport import iroh_fastcopy
    env = {"EMBER_IROH_FAST_COPY": "0"} if slow else {}
    proc = _spawn([sys.executable, "-c", FRAME_SERVER, kind], env)
    try:
        first = proc.stdout.readline().split()  # type: ignore[union-attr]
        link: Any = TcpFrames(int(first[1])) if kind == "tcp" else IrohFrames(first[1])
        if slow:
            os.environ["EMBER_IROH_FAST_COPY"] = "0"
            iroh_fastcopy.uninstall_fast_copy()
        reps = {s: (3 if s == 1 else 1) for s in sizes} if slow else REPS

        async def go() -> dict[str, Any]:
            try:
                return await _frames_bench(link, sizes, latency_n, reps)
            finally:
                if kind == "iroh":
                    from ember.transport.iroh import close_client
                    await close_client()
        return asyncio.run(go())
    finally:
        if slow:
            os.environ.pop("EMBER_IROH_FAST_COPY", None)
            iroh_fastcopy.install_fast_copy()
        proc.kill()
        proc.wait(10)


def ember_row(dev: Any, sizes: list[int], latency_n: int) -> dict[str, Any]:
    """Upload / download / op+read through the whole Ember stack."""
    import ember.array_api as xp
    out: dict[str, Any] = {"upload": {}, "download": {}}
    warm = xp.asarray(np.ones(1024), device=dev)
    float(xp.sum(warm))
    for s in sizes:
        host = np.frombuffer(os.urandom(s * MiB), dtype=np.uint8)
        up, down = [], []
        for _ in range(REPS.get(s, 2)):
            t = time.perf_counter()
            x = xp.asarray(host, device=dev)
            dev.sync()
            up.append(time.perf_counter() - t)
            t = time.perf_counter()
            back = x.to_numpy()
            down.append(time.perf_counter() - t)
            assert back.nbytes == host.nbytes
            del x, back
        out["upload"][s], out["download"][s] = up, down
    small = xp.asarray(np.ones(4), device=dev)
    lat = []
    for i in range(latency_n + 20):
        t = time.perf_counter()
        float(xp.sum(small + float(i)))
        if i >= 20:
            lat.append(time.perf_counter() - t)
    out["latency"] = lat
    return out


def start_ember_server(tmp: str) -> tuple[subprocess.Popen, str, str]:
    subprocess.run([sys.executable, "-m", "ember.cli.main", "keygen", os.path.join(tmp, "k")],
                   capture_output=True, check=True)
    p = _spawn([sys.executable, "-m", "ember.cli.main", "serve", "--offline", "--key", os.path.join(tmp, "k"),
                "--bind", LOOPBACK[0], "--bind", LOOPBACK[1], "--websocket", "127.0.0.1:0"],
               env={"EMBER_OFFLINE": "1", "PYTHONUNBUFFERED": "1"})
    ticket = ws = None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (ticket and ws):
        line = p.stdout.readline()  # type: ignore[union-attr]
        if not line:
            break
        if m := re.search(r"iroh ticket (\S+)", line):
            ticket = m.group(1)
        if m := re.search(r"listening on (ws://\S+)", line):
            ws = m.group(1)
    if not (ticket and ws):
        p.kill()
        raise SystemExit("ember serve did not start")
    return p, ticket, ws


def summarise(name: str, res: dict[str, Any], sizes: list[int]) -> dict[str, Any]:
    row: dict[str, Any] = {"transport": name}
    for d in ("upload", "download"):
        for s in sizes:
            ts = res[d].get(s)
            row[f"{d}_{s}MiB_MBps"] = round(s * MiB / 1e6 / statistics.median(ts), 1) if ts else None
            row[f"{d}_{s}MiB_seconds"] = [round(t, 4) for t in ts] if ts else None
    lat = sorted(res["latency"])
    row["op_read_p50_us"] = round(lat[len(lat) // 2] * 1e6, 1)
    row["op_read_p99_us"] = round(lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e6, 1)
    row["latency_n"] = len(lat)
    return row


def print_table(rows: list[dict[str, Any]], sizes: list[int]) -> None:
    cols = [f"up {s}MiB" for s in sizes] + [f"down {s}MiB" for s in sizes] + ["op+read p50", "p99"]
    print(f"{'transport':<24}" + "".join(f"{c:>12}" for c in cols))
    for r in rows:
        cells = [r.get(f"upload_{s}MiB_MBps") for s in sizes] + [r.get(f"download_{s}MiB_MBps") for s in sizes]
        txt = [f"{c:>12.1f}" if c is not None else f"{'-':>12}" for c in cells]
        txt += [f"{r['op_read_p50_us']:>10.0f}us", f"{r['op_read_p99_us']:>10.0f}us"]
        print(f"{r['transport']:<24}" + "".join(txt))
    print("(MB/s = 10^6 bytes per second, median of repetitions; op+read = one op and one read through "
          "Ember, or one small-frame round trip for frames/*)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,16,256", help="MiB, comma-separated")
    ap.add_argument("--latency", type=int, default=300, help="op+read samples per transport")
    ap.add_argument("--no-slow-copy", action="store_true", help="skip the slow-copy rows")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/iroh_transport-<time>.json)")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]

    import ember
    from ember.transport import iroh as T
    from ember.transport import iroh_fastcopy
    import iroh

    T.configure_client(offline=True, bind=LOOPBACK)
    iroh_fastcopy.install_all()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        proc, ticket, ws = start_ember_server(tmp)
        try:
            for name, addr in (("ember/iroh", ticket), ("ember/websocket", ws)):
                print(f"running {name} ...", file=sys.stderr, flush=True)
                dev = ember.connect(addr, read_timeout=600)
                rows.append(summarise(name, ember_row(dev, sizes, args.latency), sizes))
                dev.close()
        finally:
            proc.kill()
            proc.wait(10)
    for name, kind, slow in (("frames/iroh", "iroh", False), ("frames/tcp (asyncio)", "tcp", False),
                             ("frames/iroh slow-copy", "iroh", True)):
        if slow and args.no_slow_copy:
            continue
        sz = [s for s in sizes if s <= 16] if slow else sizes
        print(f"running {name} ...", file=sys.stderr, flush=True)
        rows.append(summarise(name, frames_row(kind, sz, args.latency, slow), sz))
    print_table(rows, sizes)
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / \
        f"iroh_transport-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "python": sys.version.split()[0],
            "iroh": getattr(iroh, "__version__", None) or _pkg_version("iroh"), "platform": platform.platform(),
            "cpus": os.cpu_count(), "fast_copy": iroh_fastcopy.fast_copy_installed(),
            "ember": ember.__version__, "sizes_mib": sizes, "latency_samples": args.latency}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"wrote {out}")
    return 0


def _pkg_version(name: str) -> str | None:
    try:
        from importlib.metadata import version
        return version(name)
    except Exception:  # noqa: BLE001
        return None


if __name__ == "__main__":
    sys.exit(main())
