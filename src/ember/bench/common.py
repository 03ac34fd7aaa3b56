"""Shared pieces of ``ember bench``: sizes, transports, figures, targets, the run configuration and
the statistics helpers."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

MiB = 1 << 20
TRANSPORTS = ("memory", "websocket", "tcp", "iroh")
FIGURES = ("pipelined", "latency", "bandwidth", "graphs", "memory")

#: figure key -> transport -> (comparison, target). Values are in the units of the key.
TARGETS: dict[str, dict[str, tuple[str, float]]] = {
    "pipelined_ops_s": {"websocket": (">=", 100_000), "iroh": (">=", 50_000)},
    "latency_p50_us": {"websocket": ("<=", 100), "iroh": ("<=", 300)},
    "upload_16MiB_MBps": {"websocket": (">=", 1000), "iroh": (">=", 250)},
    "download_16MiB_MBps": {"websocket": (">=", 1000), "iroh": (">=", 250)},
    "upload_256MiB_MBps": {"websocket": (">=", 1000), "iroh": (">=", 250)},
    "download_256MiB_MBps": {"websocket": (">=", 1000), "iroh": (">=", 250)},
    # (>= 10 while a step replayed as one REPLAY; its loss read now splits it into two, the read between them:
    # ~35 more bytes a step, 1.3-1.4x faster steps, graph_step_on_us)
    "graph_wire_ratio": {"websocket": (">=", 5), "iroh": (">=", 5)},
    "upload_peak_memory_ratio": {"tcp": ("<=", 1.2), "websocket": ("<=", 1.2), "iroh": ("<=", 1.2)},
}

#: Ratio targets (issue 12): figure key -> (transport, baseline, comparison, target), judged on the
#: ratio of medians measured in the same run. ``rpc`` is torch.rpc with TensorPipe's own choice of
#: transport (shared memory on one host), ``rpc_uv`` its TCP transport.
RATIO_TARGETS: list[tuple[str, str, str, str, float]] = [
    *[(f"{d}_{s}_MBps", "tcp", b, ">=", v) for s in ("16MiB", "256MiB") for d in ("upload", "download")
      for b, v in (("rpc_uv", 1.0), ("rpc", 1.0), ("raw_tcp", 0.5))],
    *[(f"{d}_{s}_MBps", "iroh", base, ">=", 0.8) for s in ("16MiB", "256MiB")
      for d in ("upload", "download") for base in ("iroh_frames", "iroh_frames_n")],
    ("latency_p50_us", "websocket", "rpc_uv", "<=", 0.5), ("latency_p50_us", "websocket", "rpc", "<=", 0.5),
    ("latency_p50_us", "iroh", "rpc_uv", "<=", 1.0), ("latency_p50_us", "iroh", "rpc", "<=", 1.0),
]


@dataclass
class Config:
    quick: bool = False
    repeat: int = 5
    chain: int = 10_000
    latency_samples: int = 2000
    sizes: tuple[int, ...] = (16 * MiB, 256 * MiB)
    big_repeat: int = 3
    steps: int = 200
    rpyc_calls: int = 60
    memory_size: int = 1 << 30
    link_delays: tuple[float, ...] = ()
    link_steps: int = 50

    @classmethod
    def make(cls, quick: bool, repeat: int | None) -> "Config":
        if quick:
            c = cls(quick=True, repeat=2, chain=2000, latency_samples=200, sizes=(1 * MiB, 4 * MiB),
                    big_repeat=1, steps=12, rpyc_calls=10, memory_size=64 * MiB, link_steps=5)
        else:
            c = cls()
        if repeat:
            c.repeat = repeat
            c.big_repeat = min(c.big_repeat, repeat)
        return c


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def _entry(runs: list[float], unit: str) -> dict[str, Any]:
    return {"median": _median(runs), "runs": runs, "unit": unit}
