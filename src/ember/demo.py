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
