"""ember.torch benchmarks, every figure next to local CPU torch measured in the same run.

    python bench/bench_torch.py [--steps 100] [--repeat 3] [--transports memory,websocket,tcp,iroh]
                                [--only mlp,transformer,gpt,gptnan,gpt6,lstm,gru,cpu,big,roundtrip,generate]
                                [--modes eager,compile,capture]

* one round trip, p50 and p99 (µs): ``(a + 1).to_numpy()`` of a 1-element array and ``(a + 1).item()``
  of a 1-element torch tensor, on the embedded ``local:torch`` peer and over each transport, next to a
  raw TCP echo between two processes (pinned as the peer is; an asyncio client, and a blocking one as
  Ember's caller-thread round trip is) and an asyncio thread hop; each figure also as a multiple of the
  raw asyncio echo (issue 21's goal: <= 3x, <= 100 µs over TCP, <= 30 µs embedded);

* steps/s of an MLP classifier (AdamW) and a small causal transformer LM (AdamW), over the
  in-memory link (the embedded peer) and over WebSocket, TCP and iroh to an ``ember serve
  --device torch:cpu`` process, against the same loop on local CPU torch (alternating runs);
* ATen ops dispatched, messages sent, wire bytes per step (first step vs replayed steps);
* client CPU per dispatched ATen op (process CPU time over a training run on a remote peer, µs), and
  of one cached ``a + b`` alone (the dispatch path: target <= 30 µs);
* the same loops with the model under ``torch.compile(backend="ember")`` over TCP (``tcp+compile``), and, with
  the peer compiling the graphs it replays (``ember serve --compile``, ``connect(compile=True)``), the eager loop
  (``tcp+peer``) and the compiled one (``tcp+compile+peer``);
* a model whose step takes >= 5 ms of compute: remote step time over local step time.

Client and server are pinned to different cores when there are two (torch uses one thread on
each side, so local and remote compute get one core each). Writes JSON to bench/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

import torch

import ember
import ember.torch
from ember.torch import workloads as W

os.environ.setdefault("EMBER_OFFLINE", "1")


def start_peer(compile: bool = False) -> tuple[subprocess.Popen, dict[str, str]]:
    """An ``ember serve`` process on loopback (``compile``: with ``--compile``, for the +peer rows: a peer of their
    own, so that inductor's compile workers and what they leave behind share no process with the other rows')."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "EMBER_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "ember.cli", "serve", "--device", "torch:cpu", "--websocket", "127.0.0.1:0",
           "--tcp", "127.0.0.1:0", "--offline", "--bind", "127.0.0.1:0", *(["--compile"] if compile else [])]
    if (os.cpu_count() or 1) >= 2:  # the peer on a core of its own, as on a server: it polls hot as there
        cmd = ["taskset", "-c", "1", *cmd, "--spin-us", os.environ.get("EMBER_SPIN_US", "300")]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    addrs: dict[str, str] = {}
    deadline = time.monotonic() + 60
    assert p.stdout is not None
    while time.monotonic() < deadline and len(addrs) < 3:
        words = p.stdout.readline().split()
        if "ticket" in words:
            addrs["iroh"] = words[words.index("ticket") + 1]
        for w in words:
            if w.startswith("ws://"):
                addrs["websocket"] = w
            elif w.startswith("tcp://"):
                addrs["tcp"] = w
    return p, addrs


MLP = dict(model=lambda: W.MLP(64, 256, 10), opt="AdamW", opt_args={"lr": 1e-3},
           batch=lambda g: W.classification_batch(g, 128, (64,), 10))
LM = dict(model=W.TinyLM, opt="AdamW", opt_args={"lr": 3e-3}, batch=W.lm_batch(), lm=True)
#: nanoGPT-style (the issue's table): 2 layers, n_embd 64, block 64, batch 8; and 6 layers, n_embd 256.
GPT = dict(model=lambda: W.TinyLM(vocab=65, d=64, heads=4, layers=2, ctx=64), opt="AdamW", opt_args={"lr": 1e-3},
           batch=W.lm_batch(65, 8, 64), lm=True)
GPT6 = dict(model=lambda: W.TinyLM(vocab=65, d=256, heads=8, layers=6, ctx=64), opt="AdamW",
            opt_args={"lr": 1e-3}, batch=W.lm_batch(65, 8, 64), lm=True)


class RNNLM(torch.nn.Module):
    """word_language_model's shape, small: embedding, a 2-layer LSTM (or GRU), a linear decoder."""

    def __init__(self, vocab: int = 200, d: int = 64, cell: Any = torch.nn.LSTM) -> None:
        super().__init__()
        self.emb, self.rnn = torch.nn.Embedding(vocab, d), cell(d, d, 2, batch_first=True)
        self.dec = torch.nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.dec(self.rnn(self.emb(idx))[0])


LSTM = dict(model=RNNLM, opt="SGD", opt_args={"lr": 0.1}, batch=W.lm_batch(200, 8, 35), lm=True)
GRU = dict(LSTM, model=lambda: RNNLM(cell=torch.nn.GRU))
#: the GPT under Hugging Face's Trainer's NaN filter: isnan / isinf of the loss read after every backward
GPTNAN = dict(GPT, nan_filter=True)
WORKLOADS = {"mlp": MLP, "transformer": LM, "gpt": GPT, "gptnan": GPTNAN, "gpt6": GPT6, "lstm": LSTM, "gru": GRU}
BIG = dict(model=lambda: W.MLP(1024, 2048, 10), opt="SGD", opt_args={"lr": 1e-3},
           batch=lambda g: W.classification_batch(g, 512, (1024,), 10))


#: the timed loops read the loss every so many steps (``--read-every``; 10: as a training loop logs)
READ_EVERY = [10]


def step_time(kw: dict[str, Any], device: str, steps: int) -> float:
    """Seconds per step of a warm loop (the loss read every ``READ_EVERY`` steps, as a training loop logs)."""
    W.train(device=device, steps=3, **kw)
    t0 = time.perf_counter()
    W.train(device=device, steps=steps, read_every=READ_EVERY[0], **kw)
    return (time.perf_counter() - t0) / steps


def peer_compiled_step_time(kw: dict[str, Any], steps: int, timeout: float = 600.0) -> float:
    """``step_time`` of the unchanged eager loop on a session whose peer compiles the graphs it replays
    (``ember serve --compile``, ``connect(compile=True)``): warmed until the peer has compiled every graph the
    loop replays (the compile itself is not timed)."""
    dev = ember.torch.current_device()
    deadline = time.monotonic() + timeout
    for r in range(1000):
        W.train(device="ember", steps=2 * READ_EVERY[0], read_every=READ_EVERY[0], **kw)
        cg = dev.stats()["peer"]["session"].get("compiled_graphs") or {}
        if r >= 2 and not cg.get("pending") or time.monotonic() > deadline:
            break
        settle_peer_compiles(max(1.0, deadline - time.monotonic()))
    t = step_time(kw, "ember", steps)
    settle_peer_compiles()
    return t


def compiled_step_time(kw: dict[str, Any], steps: int, backend: str = "ember", device: str = "ember") -> float:
    """Seconds per step of W.train's loop with the model under ``torch.compile(backend=...)`` on ``device``
    (the current Ember device, or local CPU torch with inductor as the baseline; compiled and warmed before the
    clock starts; the loss read every ``READ_EVERY`` steps)."""
    torch.manual_seed(0)
    m = kw["model"]().to(device)
    run = torch.compile(m, backend=backend)
    o = getattr(torch.optim, kw["opt"])(m.parameters(), **kw["opt_args"])
    g = torch.Generator().manual_seed(0)

    def step() -> Any:  # as W.train: a fresh batch uploaded every step
        x, y = kw["batch"](g)
        x, y = x.to(device), y.to(device)
        out = run(x)
        loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        o.zero_grad(set_to_none=True)
        loss.backward()
        o.step()
        return loss
    for _ in range(3):
        step()
    step().item()
    if device == "ember" and ember.torch.current_device().session.compiled:
        wait_peer_compiles(step)
    t0 = time.perf_counter()
    for k in range(steps):
        loss = step()
        if k % READ_EVERY[0] == READ_EVERY[0] - 1:
            loss.item()
    loss.item()
    dt = (time.perf_counter() - t0) / steps
    if device == "ember" and ember.torch.current_device().session.compiled:
        settle_peer_compiles()  # (compiles asked for while timed: done here, not during the next row's clock)
    return dt


def settle_peer_compiles(timeout: float = 600.0) -> None:
    """Wait until the peer compiles nothing for this session (its compiles share the peer's CPU with every
    other row's steps)."""
    dev = ember.torch.current_device()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and (dev.stats()["peer"]["session"].get("compiled_graphs") or {}).get("pending"):
        time.sleep(0.2)


def wait_peer_compiles(step: Callable[[], Any], timeout: float = 600.0) -> None:
    """Run ``step`` until the peer has compiled every graph it was asked to (its session STATS say none is
    pending), so the clock times compiled replays; the compile itself is reported apart (not in steps/s). Steps
    go as in the timed loop, the loss read every ``READ_EVERY``: a step that reads it replays other graphs than
    one that does not (split at the read: client/grouping.py), and each is compiled apart."""
    dev = ember.torch.current_device()
    deadline = time.monotonic() + timeout
    last = -1

    def rounds() -> None:  # (the loss kept until the next step's, as there: that decides the graphs too)
        loss = None
        for _ in range(READ_EVERY[0]):
            loss = step()
        loss.item()
    while time.monotonic() < deadline:
        rounds()
        states = dev.stats()["peer"]["session"].get("compiled_graphs") or {}
        done = states.get("ready", 0) + states.get("failed", 0)
        if done and not states.get("pending", 0) and done == last:  # (and a whole step asked for no new one)
            break
        last = done
        time.sleep(0.5)
    rounds()


def captured_step_time(kw: dict[str, Any], steps: int, per_step: dict[str, float] | None = None) -> float:
    """Seconds per step of W.train's loop as one ``ember.torch.capture``d step (forward, backward and
    optimizer; Adam/AdamW with ``fused=True`` so the step count and bias corrections stay on the peer), the batch
    uploaded every step outside it, the loss read every ``READ_EVERY`` steps; captured before the clock starts."""
    torch.manual_seed(0)
    m = kw["model"]().to("ember")
    extra = {"fused": True} if kw["opt"] in ("Adam", "AdamW") else {}
    o = getattr(torch.optim, kw["opt"])(m.parameters(), **kw["opt_args"], **extra)
    g = torch.Generator().manual_seed(0)

    @ember.torch.capture
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        o.zero_grad(set_to_none=True)
        out = m(x)
        loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        loss.backward()
        o.step()
        return loss

    def step() -> Any:
        x, y = kw["batch"](g)
        return train_step(x.to("ember"), y.to("ember"))
    for _ in range(4):
        step()
    step().item()
    s = ember.torch.current_device().session
    m0, r0 = s.stats["ops"], ember.torch.capture_stats["replays"]
    t0, c0 = time.perf_counter(), time.process_time()
    for k in range(steps):
        loss = step()
        if k % READ_EVERY[0] == READ_EVERY[0] - 1:
            loss.item()
    loss.item()
    dt = (time.perf_counter() - t0) / steps
    if per_step is not None:  # client CPU (all threads) and messages per step, uploads and reads included
        per_step["client_cpu_us"] = round((time.process_time() - c0) / steps * 1e6, 1)
        per_step["messages"] = round((s.stats["ops"] - m0) / steps, 2)
        per_step["replayed"] = round((ember.torch.capture_stats["replays"] - r0) / steps, 2)
        x, y = kw["batch"](g)
        x, y = x.to("ember"), y.to("ember")
        train_step(x, y).item()
        c0, t0 = time.process_time(), time.thread_time()
        for _ in range(steps):  # the replay alone: same batch, no upload
            loss = train_step(x, y)
        t1 = time.thread_time()
        s.flush()
        per_step["replay_call_us"] = round((t1 - t0) / steps * 1e6, 1)  # the calling thread, per call
        per_step["replay_cpu_us"] = round((time.process_time() - c0) / steps * 1e6, 1)  # all threads, sent
        loss.item()
    return dt


def wire(kw: dict[str, Any], dev: ember.Device, steps: int = 6) -> dict[str, Any]:
    """Per step: ATen ops, messages and bytes sent, first step vs replayed (the loss read each step)."""
    s = dev.session
    torch.manual_seed(0)
    m = kw["model"]().to("ember")
    o = getattr(torch.optim, kw["opt"])(m.parameters(), **kw["opt_args"])
    g = torch.Generator().manual_seed(0)
    x, y = kw["batch"](g)
    x, y = x.to("ember"), y.to("ember")  # one batch: what remains on the wire is the step's op stream
    dev.sync()  # the model's and the batch's uploads are not part of a step
    rows = []
    for _ in range(steps):
        b0, ops0, msg0 = s.stats["bytes_sent"], ember.torch.counters["ops"], s.stats["ops"]
        out = m(x)
        loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        o.zero_grad(set_to_none=True)
        loss.backward()
        o.step()
        loss.item()
        rows.append((s.stats["bytes_sent"] - b0, ember.torch.counters["ops"] - ops0, s.stats["ops"] - msg0))
    return {"aten_ops": rows[-1][1], "messages_first": rows[0][2], "messages_replayed": rows[-1][2],
            "bytes_first": rows[0][0], "bytes_replayed": rows[-1][0],
            "ratio": round(rows[0][0] / max(rows[-1][0], 1), 1)}


def client_cpu_per_op(kw: dict[str, Any], steps: int) -> float:
    """Client process CPU (all threads) per dispatched ATen op, on a remote peer, in µs."""
    W.train(device="ember", steps=3, **kw)
    ops0, c0 = ember.torch.counters["ops"], time.process_time()
    W.train(device="ember", steps=steps, read_every=10, **kw)
    return (time.process_time() - c0) / (ember.torch.counters["ops"] - ops0) * 1e6


def _cpu_seconds(pid: int) -> float | None:
    """CPU seconds (user + system, all threads) process ``pid`` has used; None off Linux."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def cpu_per_step(kw: dict[str, Any], dev: ember.Device, peer_pid: int, steps: int) -> dict[str, Any]:
    """Where a remote eager step's time goes: CPU milliseconds per step of the client process and of the
    peer process (``ember serve``), next to local CPU torch's for the same loop. The slower side bounds
    the remote step; a side far below its wall time per step waits for the other."""
    def per_step(device: str, pid: int | None) -> tuple[float, float | None]:
        W.train(device=device, steps=3, **kw)
        c0, p0 = time.process_time(), _cpu_seconds(pid) if pid else None
        W.train(device=device, steps=steps, read_every=10, **kw)
        p1 = _cpu_seconds(pid) if pid else None
        peer = None if p0 is None or p1 is None else (p1 - p0) / steps * 1e3
        return (time.process_time() - c0) / steps * 1e3, peer

    local, _ = per_step("cpu", None)
    client, peer = _on(dev, lambda: per_step("ember", peer_pid))
    return {"local_ms": round(local, 3), "client_ms": round(client, 3),
            "peer_ms": None if peer is None else round(peer, 3), "transport": dev.address.split(":")[0]}


def dispatch_cost(n: int = 20000, device: str = "ember") -> float:
    """Client CPU (all threads) per cached ``a + b`` on 4x4 tensors of the current Ember device, µs:
    the dispatch itself (plan cache hit, one OP message recorded, batched, sent), without autograd."""
    a, b = torch.randn(4, 4, device=device), torch.randn(4, 4, device=device)
    for _ in range(200):  # warm the plan cache and the batching path
        c = a + b
    c.cpu()
    c0 = time.process_time()
    for _ in range(n):
        c = a + b
    c.cpu()  # every op sent and run
    return (time.process_time() - c0) / n * 1e6


ECHO = """import asyncio
from ember.bench.server_process import _tcp_baseline
async def main():
    s = await asyncio.start_server(_tcp_baseline, "127.0.0.1", 0)
    print(s.sockets[0].getsockname()[1], flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""


def start_echo() -> tuple[subprocess.Popen, int]:
    """A raw asyncio TCP echo process, pinned as the peer is: the wire's own round trip."""
    cmd = [sys.executable, "-c", ECHO]
    if (os.cpu_count() or 1) >= 2:
        cmd = ["taskset", "-c", "1", *cmd]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    return p, int(p.stdout.readline())


def torch_round_trip(dev: ember.Device, n: int) -> list[float]:
    """Seconds per ``(a + 1).item()`` of a 1-element tensor on ``dev`` (a torch peer)."""
    with dev:
        a = torch.ones(1, device="ember")
        for _ in range(max(20, n // 20)):
            (a + 1).item()
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            (a + 1).item()
            out.append(time.perf_counter() - t0)
    return out


def blocking_tcp_latency(port: int, n: int) -> list[float]:
    """Seconds per 32-byte echo from a blocking socket (the client side of an Ember TCP round trip is one)."""
    import socket
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    msg = b"E" + (32).to_bytes(8, "little") + b"x" * 32
    out = []
    try:
        for _ in range(n + max(20, n // 20)):
            t0 = time.perf_counter()
            s.sendall(msg)
            got = 0
            while got < 32:
                got += len(s.recv(64))
            out.append(time.perf_counter() - t0)
    finally:
        s.close()
    return out[-n:]


def round_trips(devs: dict[str, ember.Device], n: int) -> dict[str, Any]:
    """p50 / p99 in µs of one round trip per device, a raw TCP echo (asyncio client, and a blocking one) and a
    thread hop, in this run; ``x_raw_tcp``: each device's p50 over the raw asyncio echo's; ``on_caller_thread``:
    the ``to_numpy`` round trips (of about 1.05 x n) answered on the caller's thread (``client/exchange.py``)."""
    from ember.bench.figures import ember_latency, tcp_latency, thread_hop_latency

    def pct(v: list[float]) -> dict[str, float]:
        v = sorted(v)
        return {"p50_us": round(v[len(v) // 2] * 1e6, 1), "p90_us": round(v[int(0.9 * (len(v) - 1))] * 1e6, 1),
                "p99_us": round(v[int(0.99 * (len(v) - 1))] * 1e6, 1)}
    echo, port = start_echo()
    try:
        out = {"raw_tcp": pct(tcp_latency(port, n)), "raw_tcp_blocking": pct(blocking_tcp_latency(port, n)),
               "thread_hop": pct(thread_hop_latency(n))}
        for t, d in devs.items():
            before = d.session.stats.get("exchanges", 0)
            out[f"{t} to_numpy"] = pct(ember_latency(d, n))
            out[f"{t} to_numpy"]["on_caller_thread"] = d.session.stats.get("exchanges", 0) - before
            out[f"{t} item"] = pct(torch_round_trip(d, n))
        raw = out["raw_tcp"]["p50_us"]
        for k, v in out.items():
            if " " in k:
                v["x_raw_tcp"] = round(v["p50_us"] / raw, 2)
    finally:
        echo.terminate()
        echo.wait(10)
    return out


def alternate(fns: dict[str, Callable[[], float]], repeat: int) -> dict[str, float]:
    runs: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeat):
        for k, f in fns.items():
            runs[k].append(f())
    return {k: statistics.median(v) for k, v in runs.items()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--transports", default="memory,websocket,tcp,iroh")
    ap.add_argument("--only", default="mlp,transformer,cpu,big,roundtrip",
                    help="comma-separated figures: " + ",".join([*WORKLOADS, "cpu", "big", "roundtrip", "generate"]))
    ap.add_argument("--samples", type=int, default=2000, help="round trips per latency figure")
    ap.add_argument("--read-every", type=int, default=10,
                    help="the timed training loops read the loss every N steps (1: every step)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--modes", default="eager,compile,peercompile,capture",
                    help="remote step modes besides eager on every transport: compile (torch.compile(backend="
                         "'ember') over TCP), peercompile (the same, the peer compiling the graphs with inductor: "
                         "a session that asks, connect(compile=True), of a peer started with --compile; timed once "
                         "the peer's compiles are done), capture (ember.torch.capture over TCP)")
    a = ap.parse_args(argv)
    READ_EVERY[0] = max(1, a.read_every)
    modes = set(a.modes.split(","))
    only = set(a.only.split(","))
    torch.set_num_threads(1)
    if (os.cpu_count() or 1) >= 2:
        os.sched_setaffinity(0, {0})
    proc, addrs = start_peer()
    cproc = None  # the +peer rows' peer
    report: dict[str, Any] = {"torch": torch.__version__, "steps": a.steps, "repeat": a.repeat,
                              "read_every": READ_EVERY[0], "figures": {}}
    try:
        devs = {"memory": ember.torch.current_device()}
        for t in a.transports.split(","):
            if t != "memory":
                devs[t] = ember.connect(addrs[t])
        pd = None  # torch.compile(backend="ember") with the peer compiling the graphs: a session that asks
        wire_t = [t for t in ("tcp", "websocket") if t in a.transports.split(",") and t in addrs]
        if "peercompile" in modes and wire_t:
            cproc, caddrs = start_peer(compile=True)
            pd = ember.connect(caddrs[wire_t[0]], compile=True)
        if "roundtrip" in only:
            report["figures"]["round_trip"] = round_trips(devs, a.samples)
        for name, kw in WORKLOADS.items():
            if name not in only:
                continue
            fns: dict[str, Callable[[], float]] = {"local": lambda kw=kw: step_time(kw, "cpu", a.steps)}
            for t, d in devs.items():
                fns[t] = lambda kw=kw, d=d: _on(d, lambda: step_time(kw, "ember", a.steps))
            cd = devs.get("tcp") or devs.get("websocket")
            pw = pd
            if kw.get("nan_filter"):  # (its compiled and captured loops would be the GPT's: eager only)
                cd = pw = None
            if "compile" in modes and not kw.get("nan_filter"):  # the local baseline compiled: inductor on CPU
                fns["local+inductor"] = lambda kw=kw: compiled_step_time(kw, a.steps, "inductor", "cpu")
            if cd is not None and "compile" in modes:  # torch.compile(backend="ember"): graphs replayed without per-op dispatch
                fns[f"{cd.address.split(':')[0]}+compile"] = lambda kw=kw, cd=cd: _on(
                    cd, lambda: compiled_step_time(kw, a.steps))
            if pd is not None and "peercompile" in modes and not kw.get("nan_filter"):  # the eager loop, unchanged,
                # the peer compiling its graphs (not the NaN filter's: a compiled chunk runs whole, and the filter's
                # second read then waits for the backward's, as before reads ran between a replay's steps)
                fns[f"{pd.address.split(':')[0]}+peer"] = lambda kw=kw, pd=pd: _on(
                    pd, lambda: peer_compiled_step_time(kw, a.steps))
            if pw is not None:  # the same, the peer replaying the graphs compiled by inductor (ember serve --compile)
                fns[f"{pw.address.split(':')[0]}+compile+peer"] = lambda kw=kw, pw=pw: _on(
                    pw, lambda: compiled_step_time(kw, a.steps))
            if cd is not None and "capture" in modes:  # ember.torch.capture: the whole step, one REPLAY
                fns[f"{cd.address.split(':')[0]}+capture"] = lambda kw=kw, cd=cd: _on(
                    cd, lambda: captured_step_time(kw, a.steps))
            times = alternate(fns, a.repeat)
            fig = {k: {"steps_per_s": round(1 / v, 1), "ms_per_step": round(v * 1e3, 3),
                       "vs_local": round(times["local"] / v, 3)} for k, v in times.items()}
            if cd is not None and "capture" in modes:
                per: dict[str, float] = {}
                _on(cd, lambda kw=kw, per=per: captured_step_time(kw, a.steps, per))
                fig["capture_per_step"] = per
            if "tcp" in devs:
                fig["cpu_per_step"] = cpu_per_step(kw, devs["tcp"], proc.pid, a.steps)
            wd = devs.get("websocket", devs["memory"])
            fig["wire"] = _on(wd, lambda kw=kw, wd=wd: wire(kw, wd))
            report["figures"][name] = fig
        if "generate" in only:
            report["figures"]["generate"] = generate_figure(devs, a.repeat)
        remote = devs.get("tcp") or devs.get("websocket") or devs["memory"]
        if "cpu" in only:
            report["figures"]["client_cpu_us_per_op"] = {
                "mlp": round(_on(remote, lambda: client_cpu_per_op(MLP, a.steps)), 1),
                "transformer": round(_on(remote, lambda: client_cpu_per_op(LM, a.steps // 2)), 1),
                "a_plus_b": round(statistics.median(_on(remote, dispatch_cost) for _ in range(a.repeat)), 1),
                "a_plus_b_local": round(statistics.median(dispatch_cost(device="cpu") for _ in range(a.repeat)), 2)}
        if "big" in only:
            big = alternate({"local": lambda: step_time(BIG, "cpu", 40),
                             "remote": lambda: _on(remote, lambda: step_time(BIG, "ember", 40))}, a.repeat)
            report["figures"]["big_model"] = {"local_ms": round(big["local"] * 1e3, 2),
                                              "remote_ms": round(big["remote"] * 1e3, 2),
                                              "remote_over_local": round(big["remote"] / big["local"], 3),
                                              "transport": remote.address.split(":")[0]}
    finally:
        for p in (proc, cproc):
            if p is not None:
                p.terminate()
                p.wait(10)
    print(format_report(report))
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"torch-{time.strftime('%Y%m%d-%H%M%S')}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {path}")
    return report


def decode_time(device: str, how: str, tokens: int = 48) -> float:
    """Seconds per generated token of a tiny HF GPT-2 (2 layers, n_embd 64), greedy, after a warm-up: ``how`` is
    "generate" (plain ``model.generate``), "static" (a StaticCache decode step, eager) or "capture" (that step
    under ``ember.torch.capture``: one REPLAY and one read per token)."""
    import transformers as tf
    tf.utils.logging.set_verbosity_error()
    cfg = tf.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100, n_positions=128, bos_token_id=0,
                        eos_token_id=0)
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(cfg).eval().to(device)
    prompt = torch.randint(0, 100, (1, 8))
    with torch.no_grad():
        if how == "generate":
            kw = dict(do_sample=False, pad_token_id=0, max_new_tokens=tokens, min_new_tokens=tokens)
            model.generate(prompt.to(device), **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})
            t0 = time.perf_counter()
            model.generate(prompt.to(device), **kw)
            return (time.perf_counter() - t0) / tokens
        cache = tf.StaticCache(config=cfg, max_cache_len=8 + tokens + 8)

        def decode(tok: Any, pos: Any) -> Any:
            return model(input_ids=tok, cache=cache, cache_position=pos, use_cache=True).logits[:, -1:].argmax(-1)
        step = ember.torch.capture(decode) if how == "capture" else decode
        tok = model(input_ids=prompt.to(device), cache=cache, cache_position=torch.arange(8).to(device),
                    use_cache=True).logits[:, -1:].argmax(-1)
        for i in range(4 + tokens):  # (the first 4 warm up; capture records there)
            if i == 4:
                t0 = time.perf_counter()
            tok = step(tok, torch.tensor([8 + i]).to(device))
            tok.cpu()  # the token read back, as a decode loop does
        return (time.perf_counter() - t0) / tokens


def generate_figure(devs: dict[str, ember.Device], repeat: int) -> dict[str, Any]:
    fns: dict[str, Callable[[], float]] = {"local generate": lambda: decode_time("cpu", "generate"),
                                           "local static": lambda: decode_time("cpu", "static")}
    for t, d in devs.items():
        fns[f"{t} generate"] = lambda d=d: _on(d, lambda: decode_time("ember", "generate"))
        fns[f"{t} static+capture"] = lambda d=d: _on(d, lambda: decode_time("ember", "capture"))
    times = alternate(fns, repeat)
    return {k: {"ms_per_token": round(v * 1e3, 3),
                "vs_local": round(times["local generate" if k.endswith("generate") else "local static"] / v, 3)}
            for k, v in times.items()}


def _on(dev: ember.Device, fn: Callable[[], Any]) -> Any:
    with dev:
        return fn()


def format_report(r: dict[str, Any]) -> str:
    lines = [f"ember.torch benchmarks (torch {r['torch']}, {r['steps']} steps, median of {r['repeat']})"]
    rt = r["figures"].get("round_trip")
    if rt:
        lines.append("  one round trip (µs, p50 / p90 / p99): " + ", ".join(
            f"{k} {v['p50_us']} / {v.get('p90_us')} / {v['p99_us']}" + (f" ({v['x_raw_tcp']}x raw TCP)" if "x_raw_tcp" in v else "")
            for k, v in rt.items()))
    for name in WORKLOADS:
        if name not in r["figures"]:
            continue
        fig = r["figures"][name]
        cols = [k for k in fig if k not in ("wire", "capture_per_step", "cpu_per_step")]
        lines.append(f"  {name:12s} steps/s: " + ", ".join(
            f"{k} {fig[k]['steps_per_s']} ({fig[k]['vs_local']}x local)" for k in cols))
        cp = fig.get("capture_per_step")
        if cp:
            every = r.get("read_every", 10)
            lines.append(f"  {'':12s} captured step: {cp['messages']} messages, {cp['client_cpu_us']} µs client CPU "
                         f"(batch upload and loss read every {every} steps included; the replay alone "
                         f"{cp.get('replay_call_us')} µs in the calling thread, {cp.get('replay_cpu_us')} µs "
                         f"with the I/O thread's send), {cp['replayed']} replays per step")
        c = fig.get("cpu_per_step")
        if c:
            lines.append(f"  {'':12s} CPU per eager step: local {c['local_ms']} ms; over {c['transport']}: client "
                         f"{c['client_ms']} ms, peer {c['peer_ms']} ms (the larger bounds the step)")
        w = fig["wire"]
        lines.append(f"  {'':12s} per step: {w['aten_ops']} ATen ops; messages {w['messages_first']} first, "
                     f"{w['messages_replayed']} replayed; bytes {w['bytes_first']} first, {w['bytes_replayed']} "
                     f"replayed ({w['ratio']}x)")
    g = r["figures"].get("generate")
    if g:
        lines.append("  generate, tiny GPT-2 (ms/token; plain generate() vs local generate(), a StaticCache decode step vs "
                     "the same step local): " + ", ".join(f"{k} {v['ms_per_token']} ({v['vs_local']}x)" for k, v in g.items()))
    c = r["figures"].get("client_cpu_us_per_op")
    if c:
        lines.append(f"  client CPU per dispatched ATen op: MLP {c['mlp']} µs, transformer {c['transformer']} µs "
                     f"(training loops: autograd and optimizer included); a cached a + b: {c.get('a_plus_b')} µs "
                     f"(local CPU torch {c.get('a_plus_b_local')} µs)")
    b = r["figures"].get("big_model")
    if b:
        lines.append(f"  >=5 ms model ({b['transport']}): local {b['local_ms']} ms/step, remote {b['remote_ms']} "
                     f"ms/step ({b['remote_over_local']}x local)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
