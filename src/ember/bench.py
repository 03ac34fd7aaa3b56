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

The server runs in a separate process (``python -m ember.bench --child``) that also
hosts the raw-TCP and rpyc baselines; with two or more CPUs the client is pinned to
core 0 and the server to core 1. Results go to stdout (a table) and to
``bench/results/bench-<time>.json`` (plus a PNG chart when matplotlib is importable).

``bench/run_suite.py`` and ``bench/bench_small_ops.py`` are the scripts in the
repository; ``ember bench --quick`` is the seconds-long smoke version used by the tests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

MiB = 1 << 20
TRANSPORTS = ("memory", "websocket", "iroh")
FIGURES = ("pipelined", "latency", "bandwidth", "graphs")

#: figure key -> transport -> (comparison, target). Values are in the units of the key.
TARGETS: dict[str, dict[str, tuple[str, float]]] = {
    "pipelined_ops_s": {"websocket": (">=", 100_000), "iroh": (">=", 50_000)},
    "latency_p50_us": {"websocket": ("<=", 100), "iroh": ("<=", 300)},
    "upload_16MiB_MBps": {"websocket": (">=", 1000), "iroh": (">=", 250)},
    "download_16MiB_MBps": {"websocket": (">=", 1000), "iroh": (">=", 250)},
    "upload_256MiB_MBps": {"websocket": (">=", 1000), "iroh": (">=", 250)},
    "download_256MiB_MBps": {"websocket": (">=", 1000), "iroh": (">=", 250)},
    "graph_wire_ratio": {"websocket": (">=", 10), "iroh": (">=", 10)},
}


@dataclass
class Config:
    quick: bool = False
    repeat: int = 5
    chain: int = 10_000
    latency_samples: int = 2000
    sizes: tuple[int, ...] = (16 * MiB, 256 * MiB)
    big_repeat: int = 3
    steps: int = 200
    rpyc_calls: int = 60

    @classmethod
    def make(cls, quick: bool, repeat: int | None) -> "Config":
        if quick:
            c = cls(quick=True, repeat=2, chain=2000, latency_samples=200, sizes=(1 * MiB, 4 * MiB),
                    big_repeat=1, steps=12, rpyc_calls=10)
        else:
            c = cls()
        if repeat:
            c.repeat = repeat
            c.big_repeat = min(c.big_repeat, repeat)
        return c


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def _entry(runs: list[float], unit: str) -> dict[str, Any]:
    return {"median": _median(runs), "runs": runs, "unit": unit}


# ---- the server process ---------------------------------------------------------------

def child_main(core: int | None, iroh_on: bool) -> None:
    """Serve Ember (WebSocket, iroh) and the raw baselines until stdin closes; print addresses."""
    if core is not None:
        os.sched_setaffinity(0, {core})
    os.environ.setdefault("EMBER_OFFLINE", "1")
    from .server import Server

    async def main() -> None:
        loop = asyncio.get_running_loop()
        srv = Server(["cpu"])
        srv.listen_websocket("127.0.0.1", 0)
        info: dict[str, Any] = {}
        iroh_lst = None
        if iroh_on:
            try:
                iroh_lst = srv.listen_iroh(offline=True, bind=["127.0.0.1:0"])
            except Exception as e:  # noqa: BLE001
                info["iroh_error"] = f"{type(e).__name__}: {e}"
        try:
            await srv.start()
        except Exception as e:  # noqa: BLE001 - iroh may fail to bind: serve WebSocket anyway
            info["iroh_error"] = f"{type(e).__name__}: {e}"
            iroh_lst = None
            srv = Server(["cpu"])
            srv.listen_websocket("127.0.0.1", 0)
            await srv.start()
        info["websocket"] = srv.addresses[0]
        if iroh_lst is not None:
            info["iroh"] = iroh_lst.ticket
        tcp = await asyncio.start_server(_tcp_baseline, "127.0.0.1", 0)
        info["tcp"] = tcp.sockets[0].getsockname()[1]
        info["wsecho"] = await _ws_echo_server()
        info["rpyc"] = _rpyc_server()
        frames_lst = None
        if iroh_on and iroh_lst is not None:
            try:
                from .transport.iroh import IrohListener
                frames_lst = IrohListener(offline=True, bind=["127.0.0.1:0"])
                await frames_lst.start(_frames_baseline)
                info["iroh_frames"] = frames_lst.ticket
            except Exception as e:  # noqa: BLE001
                info["iroh_frames_error"] = f"{type(e).__name__}: {e}"
        print(json.dumps(info), flush=True)
        await loop.run_in_executor(None, sys.stdin.read)  # until the parent closes our stdin
        tcp.close()
        if frames_lst is not None:
            await frames_lst.stop()
        await srv.stop()

    asyncio.run(main())


async def _tcp_baseline(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    """Raw asyncio TCP: ``E`` + n: echo n bytes; ``U`` + n: swallow n bytes, answer ok; ``D`` + n: send n bytes."""
    import socket
    w.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload = b""
    try:
        while True:
            head = await r.readexactly(9)
            kind, n = head[:1], int.from_bytes(head[1:], "little")
            if kind == b"E":
                w.write(await r.readexactly(n))
            elif kind == b"U":
                left = n
                while left:
                    chunk = await r.read(min(left, 4 * MiB))
                    if not chunk:
                        return
                    left -= len(chunk)
                w.write(b"ok")
            elif kind == b"D":
                if len(payload) < n:
                    payload = bytes(n)
                mv = memoryview(payload)
                for off in range(0, n, 4 * MiB):
                    w.write(mv[off:off + 4 * MiB])
                    await w.drain()
            else:
                return
    except (asyncio.IncompleteReadError, ConnectionError):
        return
    finally:
        w.close()


async def _frames_baseline(conn: Any) -> None:
    """Raw frames over one iroh stream (no Ember session): ``E``: echo; ``U`` + n: swallow n bytes of
    frames, answer ok; ``D`` + n: send n bytes in 1 MiB frames."""
    payload = b""
    try:
        while True:
            f = await conn.recv()
            if f is None:
                return
            kind = bytes(f[:1])
            if kind == b"E":
                await conn.send(f)
            elif kind == b"U":
                left = int.from_bytes(f[1:9], "little")
                while left > 0:
                    g = await conn.recv()
                    if g is None:
                        return
                    left -= len(g)
                await conn.send(b"ok")
            elif kind == b"D":
                n = int.from_bytes(f[1:9], "little")
                if len(payload) < n:
                    payload = bytes(n)
                mv = memoryview(payload)
                for off in range(0, n, MiB):
                    await conn.send(mv[off:off + MiB])
    except Exception:  # noqa: BLE001 - the client went away
        return
    finally:
        try:
            await conn.close()
        except Exception:  # noqa: BLE001
            pass


async def _ws_echo_server() -> str | None:
    try:
        from websockets.asyncio.server import serve
    except ImportError:
        return None

    async def echo(ws: Any) -> None:
        async for msg in ws:
            await ws.send(msg)

    s = await serve(echo, "127.0.0.1", 0, compression=None, ping_interval=None, max_size=None)
    port = s.sockets[0].getsockname()[1]
    return f"ws://127.0.0.1:{port}"


def _rpyc_server() -> int | None:
    try:
        import rpyc  # noqa: F401
        from rpyc.utils.server import ThreadedServer
        from rpyc.core.service import SlaveService
    except ImportError:
        return None
    srv = ThreadedServer(SlaveService, hostname="127.0.0.1", port=0,
                         protocol_config={"allow_all_attrs": True, "allow_pickle": True})
    threading.Thread(target=srv.start, daemon=True).start()
    return srv.port


class ServerProcess:
    """The child process, started with ``python -m ember.bench --child``."""

    def __init__(self, core: int | None, iroh_on: bool, timeout: float = 60.0) -> None:
        cmd = [sys.executable, "-m", "ember.bench", "--child"]
        if core is not None:
            cmd += ["--core", str(core)]
        if not iroh_on:
            cmd += ["--no-iroh"]
        env = dict(os.environ, EMBER_OFFLINE="1")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.info: dict[str, Any] = {}
        box: list[str] = []
        t = threading.Thread(target=lambda: box.append(self.proc.stdout.readline() if self.proc.stdout else ""),
                             daemon=True)
        t.start()
        t.join(timeout)
        if not box or not box[0].strip():
            self.close()
            raise RuntimeError(f"the benchmark server did not start within {timeout:g} s")
        self.info = json.loads(box[0])

    def close(self) -> None:
        p = self.proc
        try:
            if p.stdin:
                p.stdin.close()
            p.wait(15)
        except Exception:  # noqa: BLE001
            p.kill()
            p.wait(5)


# ---- figures: Ember -------------------------------------------------------------------

def ember_pipelined(dev: Any, n: int) -> float:
    """ops/s of a chain of n elementwise ops on 16-element arrays, one read at the end."""
    import ember.array_api as xp
    a = xp.asarray(np.full(16, 0.25), device=dev)
    b = xp.asarray(np.full(16, 0.5), device=dev)
    a.to_numpy()
    t0 = time.perf_counter()
    x = a
    for _ in range(n // 2):
        x = x * b + a
    x.to_numpy()
    return n / (time.perf_counter() - t0)


def numpy_pipelined(n: int) -> float:
    a, b = np.full(16, 0.25), np.full(16, 0.5)
    t0 = time.perf_counter()
    x = a
    for _ in range(n // 2):
        x = x * b + a
    x.copy()
    return n / (time.perf_counter() - t0)


def ember_latency(dev: Any, n: int) -> list[float]:
    """Seconds per op + read of a 1-element array."""
    import ember.array_api as xp
    a = xp.asarray(np.ones(1), device=dev)
    for _ in range(max(20, n // 20)):
        (a + 1.0).to_numpy()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        (a + 1.0).to_numpy()
        out.append(time.perf_counter() - t0)
    return out


def ember_bandwidth(dev: Any, size: int) -> tuple[float, float]:
    """(upload MB/s, download MB/s) of one array of ``size`` bytes."""
    import ember.array_api as xp
    host = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
    dev.sync()
    t0 = time.perf_counter()
    x = xp.asarray(host, device=dev)
    dev.sync()
    t_up = time.perf_counter() - t0
    t0 = time.perf_counter()
    back = x.to_numpy()
    t_down = time.perf_counter() - t0
    if back.nbytes != size or back[-1] != host[-1]:
        raise AssertionError("bandwidth check: wrong bytes back")
    del x, back
    return size / t_up / 1e6, size / t_down / 1e6


def training_step(xp: Any, st: dict[str, Any], lr: float) -> Any:
    """One step of a two-layer net with momentum, weight decay and clipping: about 50 ops."""
    X, Y = st["X"], st["Y"]
    W1, b1, W2, b2, v1, v2 = st["W1"], st["b1"], st["W2"], st["b2"], st["v1"], st["v2"]
    n = X.shape[0]
    h = X @ W1 + b1
    a = xp.tanh(h)
    out = a @ W2 + b2
    err = out - Y
    loss = xp.mean(err * err)
    acc = xp.mean(xp.astype(xp.abs(err) < 0.5, xp.float64))
    g_out = err * (2.0 / n)
    g_W2 = xp.matrix_transpose(a) @ g_out
    g_b2 = xp.sum(g_out, axis=0)
    g_a = g_out @ xp.matrix_transpose(W2)
    g_h = g_a * (1.0 - a * a)
    g_W1 = xp.matrix_transpose(X) @ g_h
    g_b1 = xp.sum(g_h, axis=0)
    for name, g in (("g_W1", g_W1), ("g_W2", g_W2)):
        norm = xp.sqrt(xp.sum(g * g))
        st[name] = g * xp.minimum(1.0, 5.0 / (norm + 1e-6))
    v1 = 0.9 * v1 + st["g_W1"]
    v2 = 0.9 * v2 + st["g_W2"]
    st["W1"] = (W1 - lr * v1) * (1.0 - lr * 1e-4)
    st["W2"] = (W2 - lr * v2) * (1.0 - lr * 1e-4)
    st["b1"] = b1 - lr * g_b1
    st["b2"] = b2 - lr * g_b2
    st["v1"], st["v2"] = v1, v2
    del st["g_W1"], st["g_W2"]
    return loss, acc


def training_state(xp: Any, dev: Any) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    kw = {"device": dev} if dev is not None else {}

    def arr(a: np.ndarray) -> Any:
        return xp.asarray(a, **kw)

    return {"X": arr(rng.standard_normal((64, 32))), "Y": arr(rng.standard_normal((64, 8))),
            "W1": arr(rng.standard_normal((32, 64)) * 0.1), "b1": arr(np.zeros(64)),
            "W2": arr(rng.standard_normal((64, 8)) * 0.1), "b2": arr(np.zeros(8)),
            "v1": arr(np.zeros((32, 64))), "v2": arr(np.zeros((64, 8)))}


def ember_graph_steps(address: str, steps: int) -> dict[bool, dict[str, Any]]:
    """The training step ``steps`` times (one read each) on two sessions, graph caching on and off,
    alternating step by step so both see the same machine: bytes sent and wall time per step."""
    import ember
    import ember.array_api as xp
    devs = {g: ember.connect(address, graphs=g) for g in (True, False)}
    try:
        states = {g: training_state(xp, d) for g, d in devs.items()}
        for d in devs.values():
            d.sync()
        res: dict[bool, dict[str, Any]] = {g: {"bytes": [], "times": [], "losses": []} for g in devs}
        for i in range(steps):
            for g, d in devs.items():
                s, r = d.session, res[g]
                b0 = s.stats["bytes_sent"]
                t0 = time.perf_counter()
                loss, _acc = training_step(xp, states[g], 0.05 / (1 + 0.01 * i))
                r["losses"].append(float(loss))
                r["times"].append(time.perf_counter() - t0)
                r["bytes"].append(s.stats["bytes_sent"] - b0)
        for g, d in devs.items():
            st = d.session.stats
            res[g]["replays"] = st["replays"]
            res[g]["ops_per_step"] = st["replayed_ops"] // max(1, st["replays"]) if g else None
        return res
    finally:
        for d in devs.values():
            d.close()


# ---- baselines --------------------------------------------------------------------------

def tcp_latency(port: int, n: int) -> list[float]:
    async def go() -> list[float]:
        import socket
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        msg = b"E" + (32).to_bytes(8, "little") + b"x" * 32
        out = []
        for i in range(n + max(20, n // 20)):
            t0 = time.perf_counter()
            w.write(msg)
            await r.readexactly(32)
            out.append(time.perf_counter() - t0)
        w.close()
        return out[-n:]
    return asyncio.run(go())


def tcp_bandwidth(port: int, size: int) -> tuple[float, float]:
    async def go() -> tuple[float, float]:
        r, w = await asyncio.open_connection("127.0.0.1", port, limit=8 * MiB)
        data = memoryview(np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8).data.cast("B"))
        t0 = time.perf_counter()
        w.write(b"U" + size.to_bytes(8, "little"))
        for off in range(0, size, 4 * MiB):
            w.write(data[off:off + 4 * MiB])
            await w.drain()
        await r.readexactly(2)
        t_up = time.perf_counter() - t0
        t0 = time.perf_counter()
        w.write(b"D" + size.to_bytes(8, "little"))
        buf = bytearray(size)
        got = 0
        while got < size:
            chunk = await r.read(min(size - got, 4 * MiB))
            if not chunk:
                raise ConnectionError("baseline server closed")
            buf[got:got + len(chunk)] = chunk
            got += len(chunk)
        t_down = time.perf_counter() - t0
        w.close()
        return size / t_up / 1e6, size / t_down / 1e6
    return asyncio.run(go())


def ws_echo_latency(url: str, n: int) -> list[float]:
    from websockets.asyncio.client import connect

    async def go() -> list[float]:
        async with connect(url, compression=None, ping_interval=None, max_size=None) as ws:
            out = []
            for _ in range(n + max(20, n // 20)):
                t0 = time.perf_counter()
                await ws.send(b"x" * 32)
                await ws.recv()
                out.append(time.perf_counter() - t0)
            return out[-n:]
    return asyncio.run(go())


def iroh_frames(ticket: str, n: int, sizes: tuple[int, ...]) -> dict[str, Any]:
    """Round trips of a 32-byte frame and bulk frames over one raw iroh stream (no Ember session)."""
    from .transport.iroh import close_client, dial

    async def go() -> dict[str, Any]:
        conn = await dial(ticket, timeout=30.0)
        try:
            msg = b"E" + b"x" * 31
            lat = []
            for _ in range(n + max(20, n // 20)):
                t0 = time.perf_counter()
                await conn.send(msg)
                await conn.recv()
                lat.append(time.perf_counter() - t0)
            out: dict[str, Any] = {"lat": lat[-n:]}
            for size in sizes:
                data = memoryview(bytes(size))
                t0 = time.perf_counter()
                await conn.send(b"U" + size.to_bytes(8, "little"))
                for off in range(0, size, MiB):
                    await conn.send(data[off:off + MiB])
                await conn.recv()
                t_up = time.perf_counter() - t0
                t0 = time.perf_counter()
                await conn.send(b"D" + size.to_bytes(8, "little"))
                got = 0
                while got < size:
                    f = await conn.recv()
                    if f is None:
                        raise ConnectionError("baseline server closed")
                    got += len(f)
                t_down = time.perf_counter() - t0
                out[size] = (size / t_up / 1e6, size / t_down / 1e6)
            return out
        finally:
            await conn.close()
            await close_client()
    return asyncio.run(go())


def thread_hop_latency(n: int) -> list[float]:
    """User thread -> asyncio loop thread -> user thread: the floor of the in-memory link."""
    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    ev = threading.Event()
    out = []
    try:
        for _ in range(n + 20):
            ev.clear()
            t0 = time.perf_counter()
            loop.call_soon_threadsafe(ev.set)
            ev.wait(5)
            out.append(time.perf_counter() - t0)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        t.join(5)
        loop.close()
    return out[-n:]


def rpyc_calls(port: int, n: int) -> dict[str, float]:
    """rpyc driving NumPy on the peer, one call per op: seconds per call (p50) and chained ops/s."""
    import rpyc
    c = rpyc.classic.connect("127.0.0.1", port)
    try:
        rnp = c.modules.numpy
        x = rnp.ones(16)
        b = rnp.full(16, 0.5)
        for _ in range(10):
            x = rnp.add(x, b)
        lat = []
        for _ in range(n):
            t0 = time.perf_counter()
            y = rnp.add(x, 1.0)
            lat.append(time.perf_counter() - t0)
        del y
        t0 = time.perf_counter()
        x = rnp.full(16, 0.25)
        for _ in range(n // 2):
            x = rnp.add(rnp.multiply(x, b), 0.25)
        rpyc.classic.obtain(x)
        ops = (n // 2) * 2 / (time.perf_counter() - t0)
        return {"call_p50_s": _pct(lat, 0.5), "call_p99_s": _pct(lat, 0.99), "ops_s": ops}
    finally:
        c.close()


# ---- the suite ----------------------------------------------------------------------------

@dataclass
class Suite:
    cfg: Config
    transports: list[str]
    figures: list[str]
    pin: bool
    log: Callable[[str], None] = print
    results: dict[str, Any] = field(default_factory=dict)

    def put(self, key: str, column: str, value: Any) -> None:
        self.results.setdefault(key, {})[column] = value

    def run(self) -> dict[str, Any]:
        pin = self.pin and len(os.sched_getaffinity(0)) >= 2 and hasattr(os, "sched_setaffinity")
        cores = sorted(os.sched_getaffinity(0))
        server = ServerProcess(cores[1] if pin else None, "iroh" in self.transports)
        if pin:
            os.sched_setaffinity(0, {cores[0]})
        try:
            info = server.info
            addresses = {"memory": "local", "websocket": info.get("websocket"), "iroh": info.get("iroh")}
            skipped = {t: info.get("iroh_error", "not served") for t in self.transports if not addresses.get(t)}
            meta = self._meta(pin, cores, skipped)
            for t in self.transports:
                if t in skipped:
                    self.log(f"ember bench: skipping {t}: {skipped[t]}")
                    continue
                self._transport(t, addresses[t])
            self._baselines(info)
        finally:
            server.close()
        return {"meta": meta, "figures": self.results, "targets": self._verdicts()}

    def _meta(self, pin: bool, cores: list[int], skipped: dict[str, str]) -> dict[str, Any]:
        import ember
        return {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "ember": ember.__version__,
                "python": platform.python_version(), "numpy": np.__version__, "platform": platform.platform(),
                "cpus": os.cpu_count(), "pinned": ({"client": cores[0], "server": cores[1]} if pin else None),
                "quick": self.cfg.quick, "repeat": self.cfg.repeat, "chain": self.cfg.chain,
                "latency_samples": self.cfg.latency_samples, "sizes": list(self.cfg.sizes),
                "transports": self.transports, "skipped": skipped}

    def _transport(self, t: str, address: str) -> None:
        import ember
        cfg = self.cfg
        self.log(f"ember bench: {t} ({address if t != 'iroh' else address[:24] + '…'})")
        dev = ember.connect(address, timeout=30.0)
        try:
            if "pipelined" in self.figures:
                raw = ember.connect(address, timeout=30.0, graphs=False)
                try:
                    for d in (dev, raw):
                        ember_pipelined(d, min(cfg.chain, 2000))  # warm up
                    runs, raw_runs = [], []
                    for _ in range(cfg.repeat):  # alternate: both see the same machine
                        runs.append(ember_pipelined(dev, cfg.chain))
                        raw_runs.append(ember_pipelined(raw, cfg.chain))
                finally:
                    raw.close()
                self.put("pipelined_ops_s", t, _entry(runs, "ops/s"))
                self.put("pipelined_ops_s_nographs", t, _entry(raw_runs, "ops/s"))
            if "latency" in self.figures:
                p50, p99 = [], []
                for _ in range(cfg.repeat):
                    lat = ember_latency(dev, cfg.latency_samples)
                    p50.append(_pct(lat, 0.5) * 1e6)
                    p99.append(_pct(lat, 0.99) * 1e6)
                self.put("latency_p50_us", t, _entry(p50, "µs"))
                self.put("latency_p99_us", t, _entry(p99, "µs"))
            if "bandwidth" in self.figures:
                for size in cfg.sizes:
                    reps = cfg.repeat if size <= 16 * MiB else cfg.big_repeat
                    up, down = zip(*(ember_bandwidth(dev, size) for _ in range(reps)))
                    tag = f"{size // MiB}MiB"
                    self.put(f"upload_{tag}_MBps", t, _entry(list(up), "MB/s"))
                    self.put(f"download_{tag}_MBps", t, _entry(list(down), "MB/s"))
        finally:
            dev.close()
        if "graphs" in self.figures:
            both = ember_graph_steps(address, cfg.steps)
            on, off = both[True], both[False]
            if on["losses"] != off["losses"]:
                raise AssertionError(f"{t}: graph caching changed the results")
            first, replayed = on["bytes"][0], _median(on["bytes"][2:])
            self.put("graph_bytes_first", t, _entry([first], "bytes"))
            self.put("graph_bytes_replayed", t, _entry([replayed], "bytes"))
            self.put("graph_wire_ratio", t, _entry([first / replayed if replayed else float("inf")], "×"))
            warm = min(10, cfg.steps // 3)
            self.put("graph_step_off_us", t, _entry([_median(off["times"][warm:]) * 1e6], "µs"))
            self.put("graph_step_on_us", t, _entry([_median(on["times"][warm:]) * 1e6], "µs"))
            self.put("graph_ops_per_step", t, _entry([on["ops_per_step"] or 0], "ops"))

    def _baselines(self, info: dict[str, Any]) -> None:
        cfg = self.cfg
        self.log("ember bench: baselines")
        if "pipelined" in self.figures:
            self.put("pipelined_ops_s", "numpy", _entry([numpy_pipelined(cfg.chain) for _ in range(cfg.repeat)],
                                                         "ops/s"))
        if "latency" in self.figures:
            runs = [tcp_latency(info["tcp"], cfg.latency_samples) for _ in range(cfg.repeat)]
            self.put("latency_p50_us", "tcp", _entry([_pct(r, 0.5) * 1e6 for r in runs], "µs"))
            self.put("latency_p99_us", "tcp", _entry([_pct(r, 0.99) * 1e6 for r in runs], "µs"))
            if info.get("wsecho"):
                runs = [ws_echo_latency(info["wsecho"], cfg.latency_samples) for _ in range(cfg.repeat)]
                self.put("latency_p50_us", "ws_echo", _entry([_pct(r, 0.5) * 1e6 for r in runs], "µs"))
                self.put("latency_p99_us", "ws_echo", _entry([_pct(r, 0.99) * 1e6 for r in runs], "µs"))
            runs = [thread_hop_latency(cfg.latency_samples) for _ in range(cfg.repeat)]
            self.put("latency_p50_us", "thread_hop", _entry([_pct(r, 0.5) * 1e6 for r in runs], "µs"))
            self.put("latency_p99_us", "thread_hop", _entry([_pct(r, 0.99) * 1e6 for r in runs], "µs"))
        if "bandwidth" in self.figures:
            for size in cfg.sizes:
                reps = cfg.repeat if size <= 16 * MiB else cfg.big_repeat
                up, down = zip(*(tcp_bandwidth(info["tcp"], size) for _ in range(reps)))
                tag = f"{size // MiB}MiB"
                self.put(f"upload_{tag}_MBps", "tcp", _entry(list(up), "MB/s"))
                self.put(f"download_{tag}_MBps", "tcp", _entry(list(down), "MB/s"))
        if info.get("iroh_frames") and "iroh" in self.transports and (
                "latency" in self.figures or "bandwidth" in self.figures):
            sizes = self.cfg.sizes if "bandwidth" in self.figures else ()
            runs = [iroh_frames(info["iroh_frames"], cfg.latency_samples if "latency" in self.figures else 10, sizes)
                    for _ in range(cfg.repeat)]
            if "latency" in self.figures:
                self.put("latency_p50_us", "iroh_frames", _entry([_pct(r["lat"], 0.5) * 1e6 for r in runs], "µs"))
                self.put("latency_p99_us", "iroh_frames", _entry([_pct(r["lat"], 0.99) * 1e6 for r in runs], "µs"))
            for size in sizes:
                tag = f"{size // MiB}MiB"
                self.put(f"upload_{tag}_MBps", "iroh_frames", _entry([r[size][0] for r in runs], "MB/s"))
                self.put(f"download_{tag}_MBps", "iroh_frames", _entry([r[size][1] for r in runs], "MB/s"))
        if info.get("rpyc") and ("pipelined" in self.figures or "latency" in self.figures):
            runs = [rpyc_calls(info["rpyc"], cfg.rpyc_calls) for _ in range(cfg.repeat)]
            if "pipelined" in self.figures:
                self.put("pipelined_ops_s", "rpyc", _entry([r["ops_s"] for r in runs], "ops/s"))
            if "latency" in self.figures:
                self.put("latency_p50_us", "rpyc", _entry([r["call_p50_s"] * 1e6 for r in runs], "µs"))
                self.put("latency_p99_us", "rpyc", _entry([r["call_p99_s"] * 1e6 for r in runs], "µs"))

    def _verdicts(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, per in TARGETS.items():
            for t, (op, target) in per.items():
                e = self.results.get(key, {}).get(t)
                if e is None:
                    continue
                v = e["median"]
                out.setdefault(key, {})[t] = {"target": f"{op} {target:g}", "value": v,
                                              "met": v >= target if op == ">=" else v <= target}
        return out


# ---- output ---------------------------------------------------------------------------------

_ROWS = [
    ("pipelined_ops_s", "pipelined small ops (ops/s)", "{:,.0f}"),
    ("pipelined_ops_s_nographs", "  same, graph caching off", "{:,.0f}"),
    ("latency_p50_us", "op+read 1 elem p50 (µs)", "{:,.0f}"),
    ("latency_p99_us", "op+read 1 elem p99 (µs)", "{:,.0f}"),
    ("upload_1MiB_MBps", "upload 1 MiB (MB/s)", "{:,.0f}"),
    ("download_1MiB_MBps", "download 1 MiB (MB/s)", "{:,.0f}"),
    ("upload_4MiB_MBps", "upload 4 MiB (MB/s)", "{:,.0f}"),
    ("download_4MiB_MBps", "download 4 MiB (MB/s)", "{:,.0f}"),
    ("upload_16MiB_MBps", "upload 16 MiB (MB/s)", "{:,.0f}"),
    ("download_16MiB_MBps", "download 16 MiB (MB/s)", "{:,.0f}"),
    ("upload_256MiB_MBps", "upload 256 MiB (MB/s)", "{:,.0f}"),
    ("download_256MiB_MBps", "download 256 MiB (MB/s)", "{:,.0f}"),
    ("graph_ops_per_step", "training step: ops", "{:,.0f}"),
    ("graph_bytes_first", "step wire bytes, first", "{:,.0f}"),
    ("graph_bytes_replayed", "step wire bytes, replayed", "{:,.0f}"),
    ("graph_wire_ratio", "step bytes first/replayed (×)", "{:,.1f}"),
    ("graph_step_off_us", "step time, graphs off (µs)", "{:,.0f}"),
    ("graph_step_on_us", "step time, graphs on (µs)", "{:,.0f}"),
]
_BASE_COLS = ("numpy", "tcp", "ws_echo", "iroh_frames", "thread_hop", "rpyc")


def format_table(report: dict[str, Any]) -> str:
    figs, verdicts = report["figures"], report["targets"]
    cols = [t for t in TRANSPORTS if any(t in figs.get(k, {}) for k, _, _ in _ROWS)]
    bcols = [b for b in _BASE_COLS if any(b in figs.get(k, {}) for k, _, _ in _ROWS)]
    header = ["figure"] + cols + bcols + ["target (ws / iroh)"]
    lines = []
    for key, label, fmt in _ROWS:
        if key not in figs:
            continue
        row = [label]
        for c in cols + bcols:
            e = figs[key].get(c)
            cell = fmt.format(e["median"]) if e is not None else ""
            v = verdicts.get(key, {}).get(c)
            if v is not None:
                cell += " ✓" if v["met"] else " ✗"
            row.append(cell)
        tg = TARGETS.get(key)
        row.append(" / ".join(f"{tg[t][0]} {tg[t][1]:,g}" for t in ("websocket", "iroh")) if tg else "")
        lines.append(row)
    widths = [max(len(str(r[i])) for r in [header] + lines) for i in range(len(header))]
    out = ["  ".join(str(h).ljust(w) if i == 0 else str(h).rjust(w) for i, (h, w) in enumerate(zip(header, widths)))]
    out.append("  ".join("-" * w for w in widths))
    for r in lines:
        out.append("  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    m = report["meta"]
    pin = m["pinned"]
    out.append(f"medians of {m['repeat']} runs; client on core {pin['client']}, server process on core {pin['server']}"
               if pin else f"medians of {m['repeat']} runs; not pinned ({m['cpus']} CPUs)")
    out.append("baselines: numpy = the chain in local NumPy; tcp = raw asyncio TCP; ws_echo = websockets echo; "
               "iroh_frames = raw frames on one iroh stream (Ember's transport, no session); "
               "thread_hop = asyncio call_soon_threadsafe round trip; rpyc = rpyc driving remote NumPy, one call per op")
    for t, why in m.get("skipped", {}).items():
        out.append(f"skipped {t}: {why}")
    return "\n".join(out)


def write_chart(report: dict[str, Any], path: str) -> str | None:
    """A PNG of ops/s and MB/s by transport (None when matplotlib is not installed)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    figs = report["figures"]
    cols = [c for c in TRANSPORTS + _BASE_COLS if c in figs.get("pipelined_ops_s", {})]
    bw_keys = [k for k, _, _ in _ROWS if k.endswith("_MBps") and k in figs]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    if cols:
        axes[0].bar(cols, [figs["pipelined_ops_s"][c]["median"] for c in cols], color="#d2691e")
        axes[0].set_yscale("log")
        axes[0].set_title("pipelined small ops (ops/s, log)")
    bcols = [c for c in TRANSPORTS + ("tcp", "iroh_frames") if any(c in figs[k] for k in bw_keys)]
    width = 0.8 / max(1, len(bcols))
    for i, c in enumerate(bcols):
        xs = [j + i * width for j in range(len(bw_keys))]
        axes[1].bar(xs, [figs[k].get(c, {}).get("median", 0) for k in bw_keys], width, label=c)
    axes[1].set_xticks([j + 0.4 - width / 2 for j in range(len(bw_keys))])
    axes[1].set_xticklabels([k.replace("_MBps", "").replace("_", "\n") for k in bw_keys], fontsize=8)
    axes[1].set_title("bandwidth (MB/s)")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def run(argv: list[str] | None = None, out: Callable[[str], None] = print) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    return run_args(args, out)


def run_args(args: argparse.Namespace, out: Callable[[str], None] = print) -> dict[str, Any]:
    os.environ.setdefault("EMBER_OFFLINE", "1")  # loopback only: no relays, no discovery
    cfg = Config.make(args.quick, args.repeat)
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
                   help="comma-separated, from: memory, websocket, iroh (default: all)")
    p.add_argument("--only", default="", help=f"comma-separated figures, from: {', '.join(FIGURES)}")
    p.add_argument("--repeat", type=int, default=None, help="runs per figure (default 5, quick 2)")
    p.add_argument("--out", default=os.path.join("bench", "results"), help="directory for the JSON (and PNG)")
    p.add_argument("--no-pin", action="store_true", help="do not pin client and server to separate cores")
    p.add_argument("--no-chart", action="store_true", help="do not write the PNG chart")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--child":
        core = int(argv[argv.index("--core") + 1]) if "--core" in argv else None
        child_main(core, "--no-iroh" not in argv)
        return 0
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
