"""``ember demo``: a compute peer on loopback (iroh, offline), a least-squares fit run on it, checked against NumPy."""

from __future__ import annotations

import time
from typing import Any

import numpy as np


def least_squares(xp: Any, A: Any, b: Any, steps: int, lr: float) -> Any:
    """Plain gradient descent on ||A w - b||^2 / n, written against any Array API namespace."""
    n, k = A.shape
    w = xp.zeros((k,), dtype=A.dtype, device=A.device) if hasattr(A, "device") else xp.zeros((k,), dtype=A.dtype)
    for _ in range(steps):
        grad = A.T @ (A @ w - b) * (2.0 / n)
        w = w - lr * grad
    return w


def run(address: str | None = None, *, steps: int = 300, n: int = 512, k: int = 16, seed: int = 0,
        out: Any = print) -> bool:
    """Run the demo against ``address`` (default: a fresh loopback peer). Returns success."""
    import ember
    import ember.array_api as xp
    from ember.server import Server

    server = None
    if address is None:
        from .transport.iroh import configure_client
        configure_client(offline=True)  # a loopback demo needs no relays and no discovery
        server = Server(["cpu"])
        server.listen_iroh(offline=True, bind=["127.0.0.1:0", "[::1]:0"])
        address = server.start_in_thread()[0]
        out(f"ember demo: started a compute peer at {address}")
    try:
        rng = np.random.default_rng(seed)
        A_np = rng.standard_normal((n, k))
        w_true = rng.standard_normal(k)
        b_np = A_np @ w_true + 0.01 * rng.standard_normal(n)
        t0 = time.perf_counter()
        dev = ember.connect(address)
        t_connect = time.perf_counter() - t0
        out(f"ember demo: connected to {address} device {dev.index} ({dev.info['name']}) in {t_connect * 1e3:.1f} ms")
        t0 = time.perf_counter()
        A, b = xp.asarray(A_np, device=dev), xp.asarray(b_np, device=dev)
        w = least_squares(xp, A, b, steps, lr=0.1).to_numpy()
        wall = time.perf_counter() - t0
        t0 = time.perf_counter()
        w_local = least_squares(np, A_np, b_np, steps, lr=0.1)
        wall_np = time.perf_counter() - t0
        err = float(np.max(np.abs(w - w_local)))
        resid = float(np.linalg.norm(A_np @ w - b_np) / np.sqrt(n))
        st = dev.stats()
        out(f"ember demo: least squares, {n}x{k}, {steps} gradient steps")
        out(f"  ops sent       {st['ops']}")
        out(f"  batches        {st['batches']}")
        out(f"  bytes sent     {st['bytes_sent']}")
        out(f"  bytes received {st['bytes_received']}")
        out(f"  wall time      {wall * 1e3:.1f} ms remote, {wall_np * 1e3:.1f} ms local NumPy")
        out(f"  rms residual   {resid:.5f}; max |w - w_numpy| = {err:.2e}")
        ok = err < 1e-9
        out("ember demo: OK, the remote result equals NumPy's" if ok else "ember demo: MISMATCH against NumPy")
        dev.close()
        return ok
    finally:
        if server is not None:
            server.close()


def run_torch(address: str | None = None, *, steps: int = 200, out: Any = print) -> bool:
    """``ember demo --torch``: train an MLP classifier on a torch peer, unchanged PyTorch code, and check
    every loss against the same loop on local CPU torch. ``address``: a peer serving ``--device torch:cpu``
    (default: the embedded in-process torch:cpu peer)."""
    import torch

    import ember
    import ember.torch
    from ember.torch import workloads as W

    dev = ember.connect(address) if address else ember.torch.current_device()
    out(f"ember demo --torch: training on {dev.address} device {dev.index} ({dev.info['name']})")
    g = torch.Generator().manual_seed(0)
    teacher = torch.randn(16, 4, generator=g)
    data = torch.randn(4096, 16, generator=g)
    labels = (data @ teacher).argmax(1)
    loader_g = torch.Generator().manual_seed(1)

    def batches(gen: torch.Generator) -> Any:
        idx = torch.randint(0, len(data), (64,), generator=loader_g)
        return data[idx], labels[idx]

    kw = dict(model=lambda: W.MLP(16, 64, 4), steps=steps, opt="AdamW", opt_args={"lr": 3e-3}, batch=batches,
              read_every=20)
    with dev:  # warm up both sides (first-call costs: kernels, the meta cache, the graph cache)
        for device in ("cpu", "ember"):
            W.train(device=device, **{**kw, "steps": 5, "read_every": 5})
    loader_g.manual_seed(1)
    t0 = time.perf_counter()
    local_losses, _ = W.train(device="cpu", **kw)
    t_local = time.perf_counter() - t0
    loader_g.manual_seed(1)
    s = dev.session
    before = dict(s.stats)
    ops0 = ember.torch.counters["ops"]
    t0 = time.perf_counter()
    with dev:
        remote_losses, params = W.train(device="ember", **kw)
    t_remote = time.perf_counter() - t0
    st = {k: s.stats[k] - before.get(k, 0) for k in s.stats}
    aten_ops = ember.torch.counters["ops"] - ops0
    with torch.no_grad():
        w1, b1, w2, b2 = params
        acc = float(((torch.relu(data @ w1.T + b1) @ w2.T + b2).argmax(1) == labels).float().mean())
    for k, (a, b) in enumerate(zip(local_losses, remote_losses)):
        out(f"  step {20 * (k + 1):4d}  loss {b:.6f}  (local CPU torch {a:.6f})")
    out(f"  steps/s        {steps / t_remote:.0f} remote, {steps / t_local:.0f} local CPU torch")
    out(f"  per step       {aten_ops / steps:.0f} ATen ops, {st['ops'] / steps:.1f} messages, "
        f"{st['bytes_sent'] / steps:.0f} bytes sent, {st['bytes_received'] / steps:.0f} bytes received")
    out(f"  graph cache    {st['replays']} replayed steps of {st['replayed_ops'] // max(st['replays'], 1)} ops")
    out(f"  accuracy       {acc:.3f} on the training set")
    ok = local_losses == remote_losses
    out("ember demo --torch: OK, every loss equals local CPU torch's" if ok else
        "ember demo --torch: MISMATCH against local CPU torch")
    if address:
        dev.close()
    return ok
