"""What ``ember bench`` measures: the Ember figures and the baseline clients they are compared to."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import numpy as np

from .common import MiB, _pct


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


def iroh_frames(ticket: str, n: int, sizes: tuple[int, ...], streams: int = 1) -> dict[str, Any]:
    """Round trips of a 32-byte frame and bulk frames over raw iroh streams (no Ember session): one
    stream, or ``streams`` bi-streams of the same QUIC connection, each moving its contiguous part of
    the bytes side by side (what Ember's lanes do, without a session)."""
    from ..transport.iroh import close_client, dial

    async def go() -> dict[str, Any]:
        conns = [await dial(ticket, timeout=30.0) for _ in range(streams)]
        conn = conns[0]
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
                parts = [(size * i // streams, size * (i + 1) // streams) for i in range(streams)]

                async def up(c: Any, lo: int, hi: int) -> None:
                    await c.send(b"U" + (hi - lo).to_bytes(8, "little"))
                    for off in range(lo, hi, MiB):
                        await c.send(data[off:min(hi, off + MiB)])
                    await c.recv()

                async def down(c: Any, lo: int, hi: int) -> None:
                    await c.send(b"D" + (hi - lo).to_bytes(8, "little"))
                    got = 0
                    while got < hi - lo:
                        f = await c.recv()
                        if f is None:
                            raise ConnectionError("baseline server closed")
                        got += len(f)
                t0 = time.perf_counter()
                await asyncio.gather(*(up(c, lo, hi) for c, (lo, hi) in zip(conns, parts)))
                t_up = time.perf_counter() - t0
                t0 = time.perf_counter()
                await asyncio.gather(*(down(c, lo, hi) for c, (lo, hi) in zip(conns, parts)))
                t_down = time.perf_counter() - t0
                out[size] = (size / t_up / 1e6, size / t_down / 1e6)
            return out
        finally:
            for c in conns:
                await c.close()
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
