"""Issue 22's attack probes against a live peer, each with the peer's RSS peak next to its budget.

Run it on the tree to measure (``PYTHONPATH=/path/to/src python bench/bench_attack.py``): the same
script measures "before" on an unfixed checkout and "after" on a fixed one. Each probe prints one
line: what it found (leaked values, refused or not, seconds the loop stalled) and the peer's RSS
growth while it ran (sampled every 20 ms), next to the 64 MiB device / 32 MiB session budget.
"""

from __future__ import annotations

import os
import threading
import time

import msgpack
import numpy as np
from websockets.sync.client import connect as ws_connect

import ember
import ember.array_api as xp
from ember.protocol import codec
from ember.protocol import messages as m
from ember.server import Server

MiB = 1 << 20


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Peak:
    """RSS growth of this process (the peer runs in it) while a probe runs."""

    def __enter__(self) -> "Peak":
        self.base, self.peak, self._stop = rss(), 0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, rss() - self.base)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, rss() - self.base)


def raw(addr: str, device: int = 0):
    ws = ws_connect(addr, max_size=None)
    ws.send(codec.encode_hello(session_id=os.urandom(16), device=device, features=[]))
    assert msgpack.unpackb(ws.recv(timeout=10))["type"] == "welcome"
    return ws


def ask(ws, batch: list, req: int, timeout: float = 60) -> list:
    ws.send(msgpack.packb(batch))
    deadline = time.monotonic() + timeout
    while True:
        for r in msgpack.unpackb(ws.recv(timeout=max(0.01, deadline - time.monotonic()))):
            if r[0] == req:
                return r


def verdict(r: list) -> str:
    return "accepted" if r[1] == m.OK else f"refused ({r[2]['kind']})"


def p1_freed(addr: str) -> str:
    out = []
    for dev in (0, 1):
        v = ember.connect(addr, device=dev)
        (xp.full((32768,), 1234.5678, device=v) * 1.0).to_numpy()
        v.close()
        w = ember.connect(addr, device=dev)
        out.append(int(np.sum(xp.empty((32768,), device=w).to_numpy() == 1234.5678)))
        w.close()
    ws = raw(addr)
    r = ask(ws, [[m.OP, "zeros", [], 0, [1], {"shape": [8], "dtype": "float64"}],
                 [m.OP, "add", [1, 1], 0, [2], {"where": False}], [m.READ, 5, 2]], 5)
    ws.close()
    return f"victim values read back by empty(): cpu {out[0]}, torch:cpu {out[1]}; add(where=False) {verdict(r)}"


def p2_objects(addr: str) -> str:
    ws = raw(addr)
    r = ask(ws, [[m.OP, "full", [], 0, [1], {"shape": [4], "fill_value": [None]}], [m.SHAPE, 2, 1]], 2)
    made = verdict(r)
    t = time.monotonic()
    r = ask(ws, [[m.OP, "full", [], 0, [3], {"shape": [64], "fill_value": [7]}], [m.OP, "astype", [3, "O"], 2, [6], None],
                 [m.OP, "pow", [6, 200000], 2, [4], None], [m.SHAPE, 5, 4]], 5)
    took = time.monotonic() - t
    ws.close()
    return f"object array from full(fill=[None]) {made}; pow(obj, 2e5) {verdict(r)} after {took:.2f} s"


def p3_sync_frame(addr: str) -> str:
    d = ember.connect(addr)
    d.sync()
    ws = raw(addr)
    worst, done = [0.0], threading.Event()

    def ping() -> None:
        while not done.is_set():
            t = time.monotonic()
            try:
                d.sync()
            except Exception:  # noqa: BLE001 - the session was lost: stalled past its heartbeat
                worst[0] = max(worst[0], time.monotonic() - t)
                return
            worst[0] = max(worst[0], time.monotonic() - t)
    th = threading.Thread(target=ping, daemon=True)
    th.start()
    ws.send(FRAMES["sync"])
    try:
        ws.recv(timeout=60)
    except Exception:  # noqa: BLE001 - the session may be ended
        pass
    done.set()
    th.join(30)
    d.close()
    return f"12 MB SYNC of 6 M arrays: another session's sync stalled up to {worst[0]:.2f} s"


def p5_graph_scalars(addr: str) -> str:
    ws = raw(addr)
    for frame in FRAMES["graphs"]:  # 8 x 32 MiB of Python lists against a 32 MiB session
        ws.send(frame)
    ask(ws, [[m.SYNC, 3]], 3)
    time.sleep(0.3)
    ws.close()
    return "8 graphs with a 4 M-element list literal each, never replayed"


def p8_broadcast(addr: str) -> str:
    res = []
    for name in ("fft.fftshift", "diff", "isin", "std", "linalg.vector_norm", "flip"):
        ws = raw(addr)
        args = [2, 1] if name == "isin" else [2]
        r = ask(ws, [[m.OP, "ones", [], 0, [1], {"shape": [1], "dtype": "float64"}],
                     [m.OP, "broadcast_to", [1], 0, [2], {"shape": [1 << 14, 1 << 13]}],
                     [m.OP, name, args, 0, [3], None], [m.SHAPE, 4, 3]], 4)
        res.append(f"{name} {verdict(r)}")
        ws.close()
    return "1 GiB broadcast view: " + ", ".join(res)


def p8_aten(addr: str) -> str:
    ws = raw(addr, device=1)
    lay = [[4], [1], 0, "float32"]
    r = ask(ws, [[m.OP, "torch.alloc", [], 0, [1], {"n": 16}],
                 [m.OP, "aten.add.Tensor", [[1], 1, 1], 1, [2],
                  {"a": [0, 0, 1], "l": [lay, lay], "o": [[0, [4], [1], 0, "float32", 1 << 30]]}],
                 [m.SHAPE, 5, 2]], 5)
    ws.close()
    return f"ATen add declaring a 1 GiB output storage: {verdict(r)}"


def p13_refused_read(addr: str) -> str:
    d = ember.connect(addr)
    base = rss()
    try:
        xp.ones((1 << 27,), device=d).to_numpy()
        what = "read"
    except Exception as e:  # noqa: BLE001
        what = type(e).__name__
    grew = (rss() - base) / MiB
    d.close()
    return f"1 GiB read the peer refuses: {what}, client RSS +{grew:.0f} MiB"


def p4_pre_auth(addr: str) -> str:
    import socket
    from ember.transport.tcp import PREAMBLE
    host, port = TCP[0][len("tcp://"):].rsplit(":", 1)
    socks = []
    for _ in range(30):  # 64 MiB length prefixes before any Hello
        s = socket.create_connection((host, int(port)))
        s.sendall(PREAMBLE + (64 << 20).to_bytes(4, "big"))
        socks.append(s)
    socks += [socket.create_connection((host, int(port))) for _ in range(300)]  # idle, never a Hello
    time.sleep(1.0)
    open_ = 0
    for s in socks:
        s.setblocking(False)
        try:
            open_ += s.recv(1) != b""
        except BlockingIOError:
            open_ += 1
        except OSError:
            pass
    for s in socks:
        s.close()
    return f"30 x 64 MiB length prefixes + 300 idle TCP connections before login: {open_} still open after 1 s"


def p11_orphans(addr: str) -> str:
    socks = []
    for _ in range(3):  # 3 sessions, each a batch of 16,000 matmuls of 300x300, then the client drops
        ws = raw(addr)
        ws.send(msgpack.packb([[m.OP, "ones", [], 0, [1], {"shape": [300, 300], "dtype": "float64"}]]
                              + [[m.OP, "matmul", [1, 1], 0, [2 + i % 4], None] for i in range(16000)]))
        socks.append(ws)
    time.sleep(0.5)
    for ws in socks:
        ws.close()
    t0 = time.monotonic()
    while SERVER[0].live and time.monotonic() - t0 < 60:
        time.sleep(0.05)
    left = len(SERVER[0].live)
    return f"3 dropped sessions with 16,000 queued matmuls: workers gone after {time.monotonic() - t0:.1f} s ({left} left)"


TCP: list = []
SERVER: list = []
PROBES = [("4 pre-auth memory", p4_pre_auth), ("1 freed data", p1_freed), ("2 object arrays", p2_objects), ("3 huge SYNC frame", p3_sync_frame),
          ("5 graph scalars", p5_graph_scalars), ("8 broadcast views", p8_broadcast), ("8 ATen outputs", p8_aten),
          ("11 orphaned work", p11_orphans), ("13 refused read", p13_refused_read)]


#: The attack frames, packed before any probe runs (the client shares the peer's process and RSS).
FRAMES: dict = {}


def main() -> None:
    FRAMES["sync"] = msgpack.packb([[m.SYNC, 1, [[0]] * 6_000_000]])  # 12 MB frame, 6 M arrays
    big = [0] * (4 * MiB)
    FRAMES["graphs"] = [msgpack.packb([[m.GRAPH, gid, 0, [big], [["add", [0, 0], 1, None]], [1], []]])
                        for gid in range(8)]
    del big
    srv = Server(["cpu", "torch:cpu"], memory_limit="64MiB", session_memory="32MiB", max_wait=5.0)
    srv.listen_websocket("127.0.0.1", 0)
    srv.listen_tcp("127.0.0.1", 0)
    addrs = srv.start_in_thread()
    addr = addrs[0]
    TCP[:] = [a for a in addrs if a.startswith("tcp://")]
    SERVER[:] = [srv]
    print(f"ember from {os.path.dirname(ember.__file__)}; budget: device 64 MiB, session 32 MiB")
    try:
        for label, probe in PROBES:
            with Peak() as p:
                try:
                    found = probe(addr)
                except Exception as e:  # noqa: BLE001 - a probe that breaks the peer says so
                    found = f"probe failed: {type(e).__name__}: {str(e)[:120]}"
            print(f"{label:20s} RSS peak +{p.peak / MiB:6.0f} MiB (budget 64)  {found}", flush=True)
    finally:
        srv.close()


if __name__ == "__main__":
    main()
