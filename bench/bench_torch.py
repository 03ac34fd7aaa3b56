"""ember.torch benchmarks, every figure next to local CPU torch measured in the same run.

    python bench/bench_torch.py [--steps 100] [--repeat 3] [--transports memory,websocket,tcp,iroh]

* steps/s of an MLP classifier (AdamW) and a small causal transformer LM (AdamW), over the
  in-memory link (the embedded peer) and over WebSocket, TCP and iroh to an ``ember serve
  --device torch:cpu`` process, against the same loop on local CPU torch (alternating runs);
* ATen ops dispatched, messages sent, wire bytes per step (first step vs replayed steps);
* client CPU per dispatched ATen op (process CPU time over a training run on a remote peer, µs), and
  of one cached ``a + b`` alone (the dispatch path: target <= 30 µs);
* the same loops with the model under ``torch.compile(backend="ember")`` over TCP (``tcp+compile``);
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


def start_peer() -> tuple[subprocess.Popen, dict[str, str]]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "EMBER_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "ember.cli", "serve", "--device", "torch:cpu", "--websocket", "127.0.0.1:0",
           "--tcp", "127.0.0.1:0", "--offline", "--bind", "127.0.0.1:0"]
    if (os.cpu_count() or 1) >= 2:
        cmd = ["taskset", "-c", "1", *cmd]
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
BIG = dict(model=lambda: W.MLP(1024, 2048, 10), opt="SGD", opt_args={"lr": 1e-3},
           batch=lambda g: W.classification_batch(g, 512, (1024,), 10))


def step_time(kw: dict[str, Any], device: str, steps: int) -> float:
    """Seconds per step of a warm loop (the loss read every 10 steps, as a training loop logs)."""
    W.train(device=device, steps=3, **kw)
    t0 = time.perf_counter()
    W.train(device=device, steps=steps, read_every=10, **kw)
    return (time.perf_counter() - t0) / steps


def compiled_step_time(kw: dict[str, Any], steps: int, backend: str = "ember") -> float:
    """Seconds per step of W.train's loop with the model under ``torch.compile(backend=...)`` on the
    current Ember device (compiled and warmed before the clock starts; the loss read every 10 steps)."""
    torch.manual_seed(0)
    m = kw["model"]().to("ember")
    run = torch.compile(m, backend=backend)
    o = getattr(torch.optim, kw["opt"])(m.parameters(), **kw["opt_args"])
    g = torch.Generator().manual_seed(0)

    def step() -> Any:  # as W.train: a fresh batch uploaded every step
        x, y = kw["batch"](g)
        x, y = x.to("ember"), y.to("ember")
        out = run(x)
        loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        o.zero_grad(set_to_none=True)
        loss.backward()
        o.step()
        return loss
    for _ in range(3):
        step()
    step().item()
    t0 = time.perf_counter()
    for k in range(steps):
        loss = step()
        if k % 10 == 9:
            loss.item()
    loss.item()
    return (time.perf_counter() - t0) / steps


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
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    if (os.cpu_count() or 1) >= 2:
        os.sched_setaffinity(0, {0})
    proc, addrs = start_peer()
    report: dict[str, Any] = {"torch": torch.__version__, "steps": a.steps, "repeat": a.repeat, "figures": {}}
    try:
        devs = {"memory": ember.torch.current_device()}
        for t in a.transports.split(","):
            if t != "memory":
                devs[t] = ember.connect(addrs[t])
        for name, kw in (("mlp", MLP), ("transformer", LM)):
            fns: dict[str, Callable[[], float]] = {"local": lambda kw=kw: step_time(kw, "cpu", a.steps)}
            for t, d in devs.items():
                fns[t] = lambda kw=kw, d=d: _on(d, lambda: step_time(kw, "ember", a.steps))
            cd = devs.get("tcp") or devs.get("websocket")
            if cd is not None:  # torch.compile(backend="ember"): graphs replayed without per-op dispatch
                fns[f"{cd.address.split(':')[0]}+compile"] = lambda kw=kw, cd=cd: _on(
                    cd, lambda: compiled_step_time(kw, a.steps))
            times = alternate(fns, a.repeat)
            fig = {k: {"steps_per_s": round(1 / v, 1), "ms_per_step": round(v * 1e3, 3),
                       "vs_local": round(times["local"] / v, 3)} for k, v in times.items()}
            wd = devs.get("websocket", devs["memory"])
            fig["wire"] = _on(wd, lambda kw=kw, wd=wd: wire(kw, wd))
            report["figures"][name] = fig
        remote = devs.get("tcp") or devs.get("websocket") or devs["memory"]
        report["figures"]["client_cpu_us_per_op"] = {
            "mlp": round(_on(remote, lambda: client_cpu_per_op(MLP, a.steps)), 1),
            "transformer": round(_on(remote, lambda: client_cpu_per_op(LM, a.steps // 2)), 1),
            "a_plus_b": round(statistics.median(_on(remote, dispatch_cost) for _ in range(a.repeat)), 1),
            "a_plus_b_local": round(statistics.median(dispatch_cost(device="cpu") for _ in range(a.repeat)), 2)}
        big = alternate({"local": lambda: step_time(BIG, "cpu", 40),
                         "remote": lambda: _on(remote, lambda: step_time(BIG, "ember", 40))}, a.repeat)
        report["figures"]["big_model"] = {"local_ms": round(big["local"] * 1e3, 2),
                                          "remote_ms": round(big["remote"] * 1e3, 2),
                                          "remote_over_local": round(big["remote"] / big["local"], 3),
                                          "transport": remote.address.split(":")[0]}
    finally:
        proc.terminate()
        proc.wait(10)
    print(format_report(report))
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"torch-{time.strftime('%Y%m%d-%H%M%S')}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {path}")
    return report


def _on(dev: ember.Device, fn: Callable[[], Any]) -> Any:
    with dev:
        return fn()


def format_report(r: dict[str, Any]) -> str:
    lines = [f"ember.torch benchmarks (torch {r['torch']}, {r['steps']} steps, median of {r['repeat']})"]
    for name in ("mlp", "transformer"):
        fig = r["figures"][name]
        cols = [k for k in fig if k != "wire"]
        lines.append(f"  {name:12s} steps/s: " + ", ".join(
            f"{k} {fig[k]['steps_per_s']} ({fig[k]['vs_local']}x local)" for k in cols))
        w = fig["wire"]
        lines.append(f"  {'':12s} per step: {w['aten_ops']} ATen ops; messages {w['messages_first']} first, "
                     f"{w['messages_replayed']} replayed; bytes {w['bytes_first']} first, {w['bytes_replayed']} "
                     f"replayed ({w['ratio']}x)")
    c = r["figures"]["client_cpu_us_per_op"]
    lines.append(f"  client CPU per dispatched ATen op: MLP {c['mlp']} µs, transformer {c['transformer']} µs "
                 f"(training loops: autograd and optimizer included); a cached a + b: {c.get('a_plus_b')} µs "
                 f"(local CPU torch {c.get('a_plus_b_local')} µs)")
    b = r["figures"]["big_model"]
    lines.append(f"  >=5 ms model ({b['transport']}): local {b['local_ms']} ms/step, remote {b['remote_ms']} "
                 f"ms/step ({b['remote_over_local']}x local)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
