"""A word_language_model-style LSTM training loop on Ember next to local CPU torch, in short alternating rounds.

    python bench/bench_lstm.py [--rounds 15] [--steps 10] [--cells]

pytorch/examples ``word_language_model``'s step (embedding, a 2-layer ``nn.LSTM``, a linear decoder tied or
not, truncated BPTT with the hidden state carried and detached, ``clip_grad_norm_``, SGD; the loss read every
10 steps) at the bench's LSTM size (vocab 200, d 64, batch 8, bptt 35): local CPU, eager on the embedded peer
and over TCP to ``ember serve --device torch:cpu``, and the step under ``ember.torch.capture`` on both.

Each round runs every mode for ``--steps`` steps, one after the other, so each ratio is taken against a local
run seconds apart (the box may be shared). Printed per mode: the median and range of the per-round
wall-clock ratios local/mode, and CPU time per step on each side (this process's, all threads; and the TCP
peer's, read from /proc): the CPU figures move less with other load. ``--cells`` switches oneDNN off
(``torch.backends.mkldnn``) for the Ember runs only: their LSTM takes the per-time-step cells, as it did
before ``ember/torch/_rnn.py``; local CPU keeps its oneDNN layers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

import ember
import ember.torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_torch import start_peer  # noqa: E402

VOCAB, D, BATCH, BPTT = 200, 64, 8, 35


class RNNModel(torch.nn.Module):
    def __init__(self, tie: bool) -> None:
        super().__init__()
        self.encoder, self.rnn = torch.nn.Embedding(VOCAB, D), torch.nn.LSTM(D, D, 2)
        self.decoder = torch.nn.Linear(D, VOCAB)
        if tie:
            self.decoder.weight = self.encoder.weight

    def forward(self, idx: torch.Tensor, hidden: Any) -> Any:
        out, hidden = self.rnn(self.encoder(idx), hidden)
        return self.decoder(out), hidden


class Loop:
    """One training run on ``device``; :meth:`run` trains ``n`` more steps and returns the last loss."""

    def __init__(self, device: str, tie: bool, capture: bool) -> None:
        torch.manual_seed(0)
        self.device, self.model = device, RNNModel(tie).to(device)
        self.g = torch.Generator().manual_seed(1)
        self.hidden = tuple(torch.zeros(2, BATCH, D, device=device) for _ in range(2))
        self.k = 0
        self.step: Callable[..., Any] = ember.torch.capture(self._step) if capture else self._step

    def _step(self, x: torch.Tensor, y: torch.Tensor, h: torch.Tensor, c: torch.Tensor) -> Any:
        self.model.zero_grad()
        out, (h, c) = self.model(x, (h, c))
        loss = F.cross_entropy(out.view(-1, VOCAB), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 0.25)
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(p.grad, alpha=-0.5)
        return loss, h.detach(), c.detach()

    def run(self, n: int) -> float:
        for _ in range(n):
            seq = torch.randint(0, VOCAB, (BPTT + 1, BATCH), generator=self.g)
            loss, *self.hidden = self.step(seq[:-1].to(self.device), seq[1:].to(self.device), *self.hidden)
            self.k += 1
            if self.k % 10 == 0:
                loss.item()
        return float(loss.item())


def peer_cpu(pid: int) -> float:
    """Seconds of CPU process ``pid``'s live threads have run (``/proc/PID/task/*/schedstat``, ns resolution)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):  # a thread that ended meanwhile
            continue
    return total / 1e9


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--tie", action="store_true", help="tie the decoder's weight to the embedding's")
    ap.add_argument("--cells", action="store_true", help="oneDNN off on Ember: torch's per-time-step cells")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    if (os.cpu_count() or 1) >= 2:
        os.sched_setaffinity(0, {0})
    proc, addrs = start_peer()
    try:
        tcp = ember.connect(addrs["tcp"])
        embedded = ember.torch.current_device()
        modes: dict[str, tuple[Any, Loop]] = {"local": (None, Loop("cpu", a.tie, False))}
        for name, dev in (("embedded", embedded), ("tcp", tcp)):
            for cap in (False, True):
                with dev:
                    modes[name + ("+capture" if cap else "")] = (dev, Loop("ember", a.tie, cap))
        wall: dict[str, list[float]] = {k: [] for k in modes}
        cpu: dict[str, list[float]] = {k: [] for k in modes}
        peer: dict[str, list[float]] = {k: [] for k in modes}
        for k, (dev, loop) in modes.items():  # warm: plans, captures, graphs
            with dev or _Null(), torch.backends.mkldnn.flags(enabled=not (a.cells and dev is not None)):
                loop.run(5)
        for _ in range(a.rounds):
            for k, (dev, loop) in modes.items():
                p0, c0, t0 = peer_cpu(proc.pid), time.process_time(), time.perf_counter()
                with dev or _Null(), torch.backends.mkldnn.flags(enabled=not (a.cells and dev is not None)):
                    loop.run(a.steps)
                wall[k].append((time.perf_counter() - t0) / a.steps)
                cpu[k].append((time.process_time() - c0) / a.steps)
                peer[k].append((peer_cpu(proc.pid) - p0) / a.steps)
        print(f"word_language_model LSTM (vocab {VOCAB}, d {D}, batch {BATCH}, bptt {BPTT}, tie={a.tie}, "
              f"{'cells' if a.cells else 'oneDNN layers'}), {a.rounds} rounds of {a.steps} steps")
        for k in modes:
            ratios = [lw / w for lw, w in zip(wall["local"], wall[k])]
            print(f"  {k:18s} {statistics.median(wall[k]) * 1e3:7.2f} ms/step  "
                  f"vs local x{statistics.median(ratios):.2f} "
                  f"(range {min(ratios):.2f}-{max(ratios):.2f})  CPU/step: this process "
                  f"{statistics.median(cpu[k]) * 1e3:.2f} ms, TCP peer {statistics.median(peer[k]) * 1e3:.2f} ms")
    finally:
        proc.terminate()
        proc.wait(15)


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


if __name__ == "__main__":
    main()
