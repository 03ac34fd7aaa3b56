"""A nanoGPT-style GPT (tied embeddings, causal SDPA, AdamW decay groups) for N iterations on local CPU,
the embedded peer and a WebSocket peer: bit-equality of every loss and parameter, and steps/s.

    python bench/bench_torch_real_training.py [--steps 200] [--threads 1]

The model and loop are tests/test_torch_real_training.py's (batches drawn with CPU torch.randint).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import ember  # noqa: E402
from ember.server import Server  # noqa: E402
from test_torch_real_training import train  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    srv = Server(["torch:cpu"])
    srv.listen_websocket("127.0.0.1", 0)
    ws = srv.start_in_thread()[0]
    try:
        results = {}
        for name in ("cpu", "embedded", "websocket"):
            t0 = time.perf_counter()
            if name == "websocket":
                with ember.connect(ws):
                    results[name] = train("ember", a.steps)
            else:
                results[name] = train("cpu" if name == "cpu" else "ember", a.steps)
            dt = time.perf_counter() - t0
            cpu = results["cpu"]
            same = results[name][0] == cpu[0] and all(torch.equal(x, y) for x, y in zip(results[name][1], cpu[1]))
            print(f"{name:10s} {a.steps} steps  {a.steps / dt:7.1f} steps/s  final loss {results[name][0][-1]:.6f}  "
                  f"bit-equal to cpu: {same}", flush=True)
    finally:
        srv.close()


if __name__ == "__main__":
    main()
