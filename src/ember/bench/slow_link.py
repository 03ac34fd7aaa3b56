"""The slow-link figure of ``ember bench --link-delay``: the work Ember exists for, at 10-50 ms RTT.

The peer sits behind a loopback proxy of its own process that delays every byte (TCP, for
WebSocket and TCP) or every datagram (UDP, for iroh) by half the round-trip time in each
direction; bandwidth is not limited. Through it the suite runs:

* ``lsq``: the ``ember demo`` least-squares fit (512 x 16, ``steps`` gradient steps, one read
  at the end);
* ``mlp``: a training loop of ``steps`` steps of the two-layer net of the ``graphs`` figure
  (about 50 ops a step; the loss is read every step, the worst case for Ember);
* ``torch``: the same kind of loop in unchanged PyTorch through ``ember.torch`` (an MLP
  classifier with AdamW, ``ember.torch.workloads``; the loss read every step) on the peer's
  torch:cpu device. Its torch.rpc figure is modelled from the ATen ops the loop dispatches
  (one call each, as an RPC-per-op system would make) and the same loop's time on local torch.

The same work done by torch.distributed.rpc, one ``rpc_sync`` per op (``RpcNamespace``), is
the baseline. TensorPipe dials the address its peer advertises through the rendezvous store,
so no proxy can be put in its path; its time is *modelled*: the calls measured on loopback
plus one round trip per call, which is exactly what a synchronous call costs on a link with
that RTT and ample bandwidth (it leaves out TCP slow start, so it flatters the baseline).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections import deque
from typing import Any

import numpy as np

# ---- the delaying proxy (its own process) --------------------------------------------------


async def _pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter, delay: float) -> None:
    """Forward r -> w, each chunk written ``delay`` s after it was read."""
    q: deque[tuple[float, bytes]] = deque()
    ready = asyncio.Event()
    loop = asyncio.get_running_loop()

    async def writer() -> None:
        while True:
            while not q:
                ready.clear()
                await ready.wait()
            t, data = q.popleft()
            if not data:
                w.close()
                return
            dt = t - loop.time()
            if dt > 0:
                await asyncio.sleep(dt)
            w.write(data)
            await w.drain()

    task = loop.create_task(writer())
    try:
        while True:
            data = await r.read(1 << 18)
            q.append((loop.time() + delay, data))
            ready.set()
            if not data:
                break
        await task
    except (ConnectionError, OSError):
        task.cancel()
        w.close()


async def _tcp_proxy(upstream: tuple[str, int], delay: float) -> None:
    async def on_client(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            ur, uw = await asyncio.open_connection(*upstream)
        except OSError:
            cw.close()
            return
        for wr in (cw, uw):
            s = wr.get_extra_info("socket")
            if s is not None:
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            await asyncio.gather(_pipe(cr, uw, delay), _pipe(ur, cw, delay), return_exceptions=True)
        except asyncio.CancelledError:  # the proxy is stopping
            pass

    srv = await asyncio.start_server(on_client, "127.0.0.1", 0, limit=1 << 20)
    print(json.dumps({"port": srv.sockets[0].getsockname()[1]}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


async def _udp_proxy(upstream: tuple[str, int], delay: float) -> None:
    loop = asyncio.get_running_loop()
    peers: dict[Any, asyncio.DatagramTransport] = {}

    class Down(asyncio.DatagramProtocol):  # server -> client, one socket per client address
        def __init__(self, client: Any) -> None:
            self.client = client

        def datagram_received(self, data: bytes, addr: Any) -> None:
            loop.call_later(delay, front.sendto, data, self.client)

    class Front(asyncio.DatagramProtocol):  # client -> server
        def datagram_received(self, data: bytes, addr: Any) -> None:
            loop.create_task(self.forward(data, addr))

        async def forward(self, data: bytes, addr: Any) -> None:
            t = peers.get(addr)
            if t is None:
                t, _ = await loop.create_datagram_endpoint(lambda: Down(addr), local_addr=("127.0.0.1", 0),
                                                           remote_addr=upstream)
                peers[addr] = t
            loop.call_later(delay, t.sendto, data)

    front, _ = await loop.create_datagram_endpoint(Front, local_addr=("127.0.0.1", 0))
    print(json.dumps({"port": front.get_extra_info("sockname")[1]}), flush=True)
    await loop.run_in_executor(None, sys.stdin.read)


def proxy_main(kind: str, upstream: str, delay_ms: float, core: int | None) -> None:
    if core is not None:
        os.sched_setaffinity(0, {core})
    host, _, port = upstream.rpartition(":")
    up = (host.strip("[]"), int(port))
    d = delay_ms / 2000.0  # one way
    asyncio.run(_tcp_proxy(up, d) if kind == "tcp" else _udp_proxy(up, d))


class DelayProxy:
    """A proxy process to ``upstream`` (``HOST:PORT``) adding ``rtt_ms`` of round trip."""

    def __init__(self, kind: str, upstream: str, rtt_ms: float, core: int | None = None) -> None:
        cmd = [sys.executable, "-m", "ember.bench", "--proxy", kind, "--upstream", upstream,
               "--delay-ms", str(rtt_ms)] + (["--core", str(core)] if core is not None else [])
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the delaying proxy did not start")
        self.port = int(json.loads(line)["port"])

    def close(self) -> None:
        try:
            if self.proc.stdin:
                self.proc.stdin.close()
            self.proc.wait(10)
        except Exception:  # noqa: BLE001
            self.proc.kill()
            self.proc.wait(5)


def via_proxy(address: str, port: int) -> str:
    """``address`` (ws://, tcp:// or an iroh ticket) with the proxy's port in place of the peer's."""
    if address.startswith(("ws://", "tcp://")):
        scheme = address.split("://")[0]
        return f"{scheme}://127.0.0.1:{port}"
    import iroh
    addr = iroh.EndpointTicket.from_string(address).endpoint_addr()
    return str(iroh.EndpointTicket.from_addr(iroh.EndpointAddr(addr.id(), None, [f"127.0.0.1:{port}"])))


def upstream_of(address: str) -> str:
    """``HOST:PORT`` the proxy forwards to."""
    if address.startswith(("ws://", "tcp://")):
        return address.split("://")[1]
    import iroh
    addrs = list(iroh.EndpointTicket.from_string(address).endpoint_addr().direct_addresses())
    return next(a for a in addrs if a.startswith("127.0.0.1:"))


# ---- the workloads -----------------------------------------------------------------------

LSQ_SHAPE = (512, 16)


def lsq_data(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    A = rng.standard_normal(LSQ_SHAPE)
    b = A @ rng.standard_normal(LSQ_SHAPE[1]) + 0.01 * rng.standard_normal(LSQ_SHAPE[0])
    return A, b


def torch_workload(dev: Any, steps: int, seed: int = 0) -> dict[str, float]:
    """The ``torch`` workload on ``dev`` ("cpu": local torch): seconds, ATen ops dispatched, last loss."""
    import ember.torch
    from ember.torch import workloads as W
    kw = dict(model=lambda: W.MLP(16, 64, 4), opt="AdamW", opt_args={"lr": 3e-3}, steps=steps, seed=seed,
              batch=lambda g: W.classification_batch(g, 64, (16,), 4))
    if dev == "cpu":
        t0 = time.perf_counter()
        losses, _ = W.train(device="cpu", **kw)
        return {"s": time.perf_counter() - t0, "check": losses[-1]}
    ops0 = ember.torch.counters["ops"]
    dev.sync()
    t0 = time.perf_counter()
    with dev:
        losses, _ = W.train(device="ember", **kw)
    return {"s": time.perf_counter() - t0, "check": losses[-1], "calls": ember.torch.counters["ops"] - ops0}


def ember_workload(dev: Any, kind: str, steps: int, seed: int = 0) -> dict[str, float]:
    """Seconds for the workload on ``dev`` (data upload included), and its result for checking."""
    if kind == "torch":
        return torch_workload(dev, steps, seed)
    import ember.array_api as xp
    from ..demo import least_squares
    from .figures import training_state, training_step
    dev.sync()
    t0 = time.perf_counter()
    if kind == "lsq":
        A, b = lsq_data(seed)
        w = least_squares(xp, xp.asarray(A, device=dev), xp.asarray(b, device=dev), steps, lr=0.1).to_numpy()
        check = float(np.sum(w))
    else:
        st = training_state(xp, dev)
        check = 0.0
        for i in range(steps):
            loss, _acc = training_step(xp, st, 0.05 / (1 + 0.01 * i))
            check = float(loss)
    return {"s": time.perf_counter() - t0, "check": check}


class RArr:
    """A tensor held by the torch.rpc server: every op on it is one ``rpc_sync``."""

    __array_priority__ = 1000

    def __init__(self, ns: "RpcNamespace", key: str, shape: tuple[int, ...] | None = None) -> None:
        self.ns, self.key, self.shape = ns, key, shape
        self.dtype, self.device = "float64", None

    def _bin(self, name: str, other: Any, swap: bool = False) -> "RArr":
        a, b = (other, self) if swap else (self, other)
        return self.ns.call(name, a, b)

    def __matmul__(self, o: Any) -> "RArr": return self._bin("matmul", o)
    def __add__(self, o: Any) -> "RArr": return self._bin("add", o)
    def __radd__(self, o: Any) -> "RArr": return self._bin("add", o, True)
    def __sub__(self, o: Any) -> "RArr": return self._bin("subtract", o)
    def __rsub__(self, o: Any) -> "RArr": return self._bin("subtract", o, True)
    def __mul__(self, o: Any) -> "RArr": return self._bin("multiply", o)
    def __rmul__(self, o: Any) -> "RArr": return self._bin("multiply", o, True)
    def __truediv__(self, o: Any) -> "RArr": return self._bin("divide", o)
    def __rtruediv__(self, o: Any) -> "RArr": return self._bin("divide", o, True)
    def __lt__(self, o: Any) -> "RArr": return self._bin("less", o)

    @property
    def T(self) -> "RArr":
        return self.ns.call("matrix_transpose", self)

    def __float__(self) -> float:
        self.ns.calls += 1
        return float(self.ns.rpc.rpc_sync(self.ns.server, _get_item, args=(self.key,)))

    def to_numpy(self) -> np.ndarray:
        self.ns.calls += 1
        return self.ns.rpc.rpc_sync(self.ns.server, _get_numpy, args=(self.key,))

    def __del__(self) -> None:
        try:  # asynchronous: no round trip to wait for, so not counted in the model
            self.ns.rpc.rpc_async(self.ns.server, _drop, args=(self.key,))
        except Exception:  # noqa: BLE001 - shutting down
            pass


class RpcNamespace:
    """Array API functions as one torch.rpc call each, run by the server on its array_api_compat.torch."""

    float64 = "float64"

    def __init__(self, server: str) -> None:
        import torch.distributed.rpc as rpc
        self.rpc, self.server = rpc, server
        self.calls = 0
        self._n = 0

    def _key(self) -> str:
        self._n += 1
        return f"r{self._n}"

    def call(self, name: str, *args: Any, **kw: Any) -> RArr:
        out = self._key()
        wire = [("@", a.key) if isinstance(a, RArr) else a for a in args]
        self.calls += 1
        self.rpc.rpc_sync(self.server, _apply, args=(name, out, wire, kw))
        return RArr(self, out)

    def asarray(self, a: Any, **_: Any) -> RArr:
        import torch
        key = self._key()
        self.calls += 1
        self.rpc.rpc_sync(self.server, _put, args=(key, torch.from_numpy(np.ascontiguousarray(a))))
        return RArr(self, key, tuple(np.shape(a)))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *a, **k: self.call(name, *a, **k)


_VALUES: dict[str, Any] = {}


def _put(key: str, t: Any) -> None:
    _VALUES[key] = t


def _apply(name: str, out: str, args: list[Any], kw: dict[str, Any]) -> None:
    import array_api_compat.torch as xp
    vals = [_VALUES[a[1]] if isinstance(a, tuple) and len(a) == 2 and a[0] == "@" else a for a in args]
    if "dtype" in kw:
        kw["dtype"] = getattr(xp, kw["dtype"])
    if name == "astype":
        vals[1] = getattr(xp, vals[1]) if isinstance(vals[1], str) else vals[1]
    if name == "zeros":
        kw.pop("device", None)
    if name in ("minimum", "maximum", "divide", "subtract", "add", "multiply"):
        import torch
        vals = [torch.tensor(v, dtype=torch.float64) if isinstance(v, float) else v for v in vals]
    _VALUES[out] = getattr(xp, name)(*vals, **kw)


def _get_item(key: str) -> float:
    return float(_VALUES[key])


def _get_numpy(key: str) -> Any:
    return _VALUES[key].numpy()


def _drop(key: str) -> None:
    _VALUES.pop(key, None)


def rpc_workload(server: str, kind: str, steps: int, seed: int = 0) -> dict[str, float]:
    """The workload through torch.rpc to worker ``server``, one call per op (runs in the rpc client)."""
    from ..demo import least_squares
    from .figures import training_state, training_step
    ns = RpcNamespace(server)
    t0 = time.perf_counter()
    if kind == "lsq":
        A, b = lsq_data(seed)
        rA, rb = ns.asarray(A), ns.asarray(b)
        rA.dtype = "float64"
        w = least_squares(ns, rA, rb, steps, lr=0.1).to_numpy()
        check = float(np.sum(w))
    else:
        st = training_state(ns, None)
        check = 0.0
        for i in range(steps):
            loss, _acc = training_step(ns, st, 0.05 / (1 + 0.01 * i))
            check = float(loss)
    return {"s": time.perf_counter() - t0, "calls": ns.calls, "check": check}


def start_proxies(info: dict[str, str], transports: list[str], rtt_ms: float,
                  core: int | None) -> dict[str, DelayProxy]:
    out = {}
    for t in transports:
        addr = info.get(t)
        if addr:
            out[t] = DelayProxy("udp" if t == "iroh" else "tcp", upstream_of(addr), rtt_ms, core)
    return out


__all__ = ["DelayProxy", "via_proxy", "upstream_of", "ember_workload", "rpc_workload", "proxy_main",
           "start_proxies", "RpcNamespace"]
