"""The torch.distributed.rpc baseline of ``ember bench``: the same work, one RPC per op.

Two processes of their own, like Ember's: a server (rank 0, pinned to the server's core,
hosting the rendezvous store) that only answers calls, and a client (rank 1, pinned to
the client's core) that the suite drives over its stdin/stdout with one JSON command a
line, so that its measurements alternate with Ember's in the same run.

TensorPipe is the backend. ``transport="default"`` lets it pick (on one host: shared
memory and cross-memory-attach channels, which is not a network); ``"uv"`` forces its TCP
transport and basic channel, the fair peer of Ember's TCP and WebSocket transports.

What each command measures (all tensors float64 or uint8 on the server, as Ember's):

* ``bandwidth``: upload = ``rpc_sync(put, (key, tensor))``; download = ``rpc_sync(get, (key,))``.
* ``latency``: ``rpc_sync(op_read, (key,))``: ``x + 1`` on a 1-element tensor held by the
  server, the result returned (op + read in one round trip, the cheapest form).
* ``pipelined``: the ``x * b + a`` chain as ``rpc.remote`` calls on RRefs (asynchronous, one
  call per op, chained by the owner), one ``to_here`` at the end.
* ``lsq`` / ``mlp``: the slow-link workloads (see ``bench.slow_link``), one ``rpc_sync`` per op.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any

_STORE: dict[Any, Any] = {}

SERVER, CLIENT = "ember-bench-rpc-server", "ember-bench-rpc-client"


# ---- functions the client calls on the server (module-level: rpc pickles them by name) ------

def put(key: Any, t: Any) -> None:
    _STORE[key] = t


def get(key: Any) -> Any:
    return _STORE[key]


def drop(*keys: Any) -> None:
    for k in keys:
        _STORE.pop(k, None)


def op_read(key: Any) -> Any:
    return _STORE[key] + 1.0


def op(name: str, out: Any, *args: Any) -> None:
    """``_STORE[out] = torch.<name>(*args)``; string args name stored tensors."""
    import torch
    vals = [_STORE[a] if isinstance(a, str) else a for a in args]
    fn = {"matmul": torch.matmul, "sub": torch.sub, "mul": torch.mul, "add": torch.add, "tanh": torch.tanh,
          "t": torch.t, "mean": torch.mean, "sum0": lambda x: torch.sum(x, 0)}[name]
    _STORE[out] = fn(*vals)


def rref_mul_add(x: Any, b: Any, a: Any) -> Any:
    """One op of the pipelined chain on RRef values (the owner waits for unfinished ones)."""
    return x.local_value() * b.local_value() + a.local_value()


def rref_value(x: Any) -> Any:
    return x.local_value()


# ---- the processes -----------------------------------------------------------------------

def _options(port: int, transport: str) -> Any:
    import torch.distributed.rpc as rpc
    kw: dict[str, Any] = {"init_method": f"tcp://127.0.0.1:{port}", "num_worker_threads": 8, "rpc_timeout": 300}
    if transport == "uv":
        kw.update(_transports=["uv"], _channels=["basic"])
    return rpc.TensorPipeRpcBackendOptions(**kw)


def _quiet() -> None:
    import warnings
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TP_SOCKET_IFNAME", "lo")  # TensorPipe's uv transport: loopback only


def server_main(port: int, core: int | None, transport: str) -> None:
    """Rank 0: host the store, answer calls until the client shuts down."""
    if core is not None:
        os.sched_setaffinity(0, {core})
    _quiet()
    import torch.distributed.rpc as rpc
    rpc.init_rpc(SERVER, rank=0, world_size=2, rpc_backend_options=_options(port, transport))
    rpc.shutdown()  # a barrier: serves until the client shuts down too


def client_main(port: int, core: int | None, transport: str) -> None:
    """Rank 1: run one JSON command a line from stdin, answer one JSON line each."""
    if core is not None:
        os.sched_setaffinity(0, {core})
    _quiet()
    import torch.distributed.rpc as rpc
    rpc.init_rpc(CLIENT, rank=1, world_size=2, rpc_backend_options=_options(port, transport))
    print(json.dumps({"ready": True}), flush=True)
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["op"] == "quit":
                break
            print(json.dumps(COMMANDS[cmd["op"]](**cmd.get("args", {}))), flush=True)
    finally:
        rpc.shutdown()


def _bandwidth(size: int) -> dict[str, float]:
    import torch
    import torch.distributed.rpc as rpc
    x = torch.randint(0, 255, (size,), dtype=torch.uint8)
    t0 = time.perf_counter()
    rpc.rpc_sync(SERVER, put, args=("bw", x))
    t1 = time.perf_counter()
    back = rpc.rpc_sync(SERVER, get, args=("bw",))
    t2 = time.perf_counter()
    if back.numel() != size or int(back[-1]) != int(x[-1]):
        raise AssertionError("torch.rpc bandwidth check: wrong bytes back")
    rpc.rpc_sync(SERVER, drop, args=("bw",))
    return {"up": size / (t1 - t0) / 1e6, "down": size / (t2 - t1) / 1e6}


def _latency(n: int) -> dict[str, list[float]]:
    import torch
    import torch.distributed.rpc as rpc
    rpc.rpc_sync(SERVER, put, args=("lat", torch.ones(1, dtype=torch.float64)))
    out = []
    for _ in range(n + max(20, n // 20)):
        t0 = time.perf_counter()
        rpc.rpc_sync(SERVER, op_read, args=("lat",))
        out.append(time.perf_counter() - t0)
    return {"lat": out[-n:]}


def _pipelined(n: int) -> dict[str, float]:
    import torch
    import torch.distributed.rpc as rpc
    a = rpc.remote(SERVER, torch.full, args=((16,), 0.25), kwargs={"dtype": torch.float64})
    b = rpc.remote(SERVER, torch.full, args=((16,), 0.5), kwargs={"dtype": torch.float64})
    a.to_here()
    b.to_here()
    t0 = time.perf_counter()
    x = a
    for _ in range(n // 2):  # one call per x * b + a (two ops), as fast as torch.rpc goes
        x = rpc.remote(SERVER, rref_mul_add, args=(x, b, a))
    x.to_here()
    return {"ops_s": n / (time.perf_counter() - t0)}


def _workload(kind: str, steps: int, seed: int = 0) -> dict[str, float]:
    from .slow_link import rpc_workload
    return rpc_workload(SERVER, kind, steps, seed)


COMMANDS = {"bandwidth": _bandwidth, "latency": _latency, "pipelined": _pipelined, "workload": _workload}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RpcBaseline:
    """A torch.rpc server process and a client process driven by commands (see module docstring)."""

    def __init__(self, cores: tuple[int | None, int | None], transport: str = "default",
                 timeout: float = 120.0, env: dict[str, str] | None = None) -> None:
        self.transport = transport
        port = _free_port()
        base = [sys.executable, "-m", "ember.bench"]

        def cmd(role: str, core: int | None) -> list[str]:
            c = base + [f"--rpc-{role}", "--port", str(port), "--rpc-transport", transport]
            return c + (["--core", str(core)] if core is not None else [])
        e = dict(os.environ, **(env or {}))
        self.server = subprocess.Popen(cmd("server", cores[1]), stdin=subprocess.DEVNULL,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=e)
        self.client = subprocess.Popen(cmd("client", cores[0]), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       stderr=subprocess.DEVNULL, text=True, env=e)
        try:
            self._read(timeout)
        except Exception:
            self.close()
            raise

    def _read(self, timeout: float) -> Any:
        box: list[str] = []
        assert self.client.stdout is not None
        t = threading.Thread(target=lambda: box.append(self.client.stdout.readline()), daemon=True)  # type: ignore
        t.start()
        t.join(timeout)
        if not box or not box[0].strip():
            raise RuntimeError(f"the torch.rpc baseline ({self.transport}) did not answer within {timeout:g} s")
        return json.loads(box[0])

    def run(self, op: str, timeout: float = 600.0, **args: Any) -> Any:
        assert self.client.stdin is not None
        self.client.stdin.write(json.dumps({"op": op, "args": args}) + "\n")
        self.client.stdin.flush()
        return self._read(timeout)

    def close(self) -> None:
        for p in (self.client, self.server):
            try:
                if p is self.client and p.stdin:
                    p.stdin.write(json.dumps({"op": "quit"}) + "\n")
                    p.stdin.close()
                p.wait(20)
            except Exception:  # noqa: BLE001
                p.kill()
                p.wait(5)


def available() -> str | None:
    """None when torch.distributed.rpc can run here, else why not."""
    try:
        import torch.distributed.rpc as rpc
    except ImportError as e:
        return f"torch is not installed ({e})"
    if not rpc.is_available():
        return "this torch build has no torch.distributed.rpc"
    return None
