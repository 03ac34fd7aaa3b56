"""The suite: start the server process, measure each figure per transport and the baselines, judge targets."""

from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .common import MiB, TARGETS, Config, _entry, _median, _pct
from .figures import (ember_bandwidth, ember_graph_steps, ember_latency, ember_pipelined, iroh_frames,
                      numpy_pipelined, rpyc_calls, tcp_bandwidth, tcp_latency, thread_hop_latency, ws_echo_latency)
from .server_process import ServerProcess


@dataclass
class Suite:
    cfg: Config
    transports: list[str]
    figures: list[str]
    pin: bool
    log: Callable[[str], None] = print
    results: dict[str, Any] = field(default_factory=dict)

    def put(self, key: str, column: str, value: Any) -> None:
        self.results.setdefault(key, {})[column] = value

    def run(self) -> dict[str, Any]:
        pin = self.pin and len(os.sched_getaffinity(0)) >= 2 and hasattr(os, "sched_setaffinity")
        cores = sorted(os.sched_getaffinity(0))
        server = ServerProcess(cores[1] if pin else None, "iroh" in self.transports)
        if pin:
            os.sched_setaffinity(0, {cores[0]})
        try:
            info = server.info
            addresses = {"memory": "local", "websocket": info.get("websocket"), "iroh": info.get("iroh")}
            skipped = {t: info.get("iroh_error", "not served") for t in self.transports if not addresses.get(t)}
            meta = self._meta(pin, cores, skipped)
            for t in self.transports:
                if t in skipped:
                    self.log(f"ember bench: skipping {t}: {skipped[t]}")
                    continue
                self._transport(t, addresses[t])
            self._baselines(info)
        finally:
            server.close()
        return {"meta": meta, "figures": self.results, "targets": self._verdicts()}

    def _meta(self, pin: bool, cores: list[int], skipped: dict[str, str]) -> dict[str, Any]:
        import ember
        return {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "ember": ember.__version__,
                "python": platform.python_version(), "numpy": np.__version__, "platform": platform.platform(),
                "cpus": os.cpu_count(), "pinned": ({"client": cores[0], "server": cores[1]} if pin else None),
                "quick": self.cfg.quick, "repeat": self.cfg.repeat, "chain": self.cfg.chain,
                "latency_samples": self.cfg.latency_samples, "sizes": list(self.cfg.sizes),
                "transports": self.transports, "skipped": skipped}

    def _transport(self, t: str, address: str) -> None:
        import ember
        cfg = self.cfg
        self.log(f"ember bench: {t} ({address if t != 'iroh' else address[:24] + '…'})")
        dev = ember.connect(address, timeout=30.0)
        try:
            if "pipelined" in self.figures:
                raw = ember.connect(address, timeout=30.0, graphs=False)
                try:
                    for d in (dev, raw):
                        ember_pipelined(d, min(cfg.chain, 2000))  # warm up
                    runs, raw_runs = [], []
                    for _ in range(cfg.repeat):  # alternate: both see the same machine
                        runs.append(ember_pipelined(dev, cfg.chain))
                        raw_runs.append(ember_pipelined(raw, cfg.chain))
                finally:
                    raw.close()
                self.put("pipelined_ops_s", t, _entry(runs, "ops/s"))
                self.put("pipelined_ops_s_nographs", t, _entry(raw_runs, "ops/s"))
            if "latency" in self.figures:
                p50, p99 = [], []
                for _ in range(cfg.repeat):
                    lat = ember_latency(dev, cfg.latency_samples)
                    p50.append(_pct(lat, 0.5) * 1e6)
                    p99.append(_pct(lat, 0.99) * 1e6)
                self.put("latency_p50_us", t, _entry(p50, "µs"))
                self.put("latency_p99_us", t, _entry(p99, "µs"))
            if "bandwidth" in self.figures:
                for size in cfg.sizes:
                    reps = cfg.repeat if size <= 16 * MiB else cfg.big_repeat
                    up, down = zip(*(ember_bandwidth(dev, size) for _ in range(reps)))
                    tag = f"{size // MiB}MiB"
                    self.put(f"upload_{tag}_MBps", t, _entry(list(up), "MB/s"))
                    self.put(f"download_{tag}_MBps", t, _entry(list(down), "MB/s"))
        finally:
            dev.close()
        if "graphs" in self.figures:
            both = ember_graph_steps(address, cfg.steps)
            on, off = both[True], both[False]
            if on["losses"] != off["losses"]:
                raise AssertionError(f"{t}: graph caching changed the results")
            first, replayed = on["bytes"][0], _median(on["bytes"][2:])
            self.put("graph_bytes_first", t, _entry([first], "bytes"))
            self.put("graph_bytes_replayed", t, _entry([replayed], "bytes"))
            self.put("graph_wire_ratio", t, _entry([first / replayed if replayed else float("inf")], "×"))
            warm = min(10, cfg.steps // 3)
            self.put("graph_step_off_us", t, _entry([_median(off["times"][warm:]) * 1e6], "µs"))
            self.put("graph_step_on_us", t, _entry([_median(on["times"][warm:]) * 1e6], "µs"))
            self.put("graph_ops_per_step", t, _entry([on["ops_per_step"] or 0], "ops"))

    def _baselines(self, info: dict[str, Any]) -> None:
        cfg = self.cfg
        self.log("ember bench: baselines")
        if "pipelined" in self.figures:
            self.put("pipelined_ops_s", "numpy", _entry([numpy_pipelined(cfg.chain) for _ in range(cfg.repeat)],
                                                         "ops/s"))
        if "latency" in self.figures:
            runs = [tcp_latency(info["tcp"], cfg.latency_samples) for _ in range(cfg.repeat)]
            self.put("latency_p50_us", "tcp", _entry([_pct(r, 0.5) * 1e6 for r in runs], "µs"))
            self.put("latency_p99_us", "tcp", _entry([_pct(r, 0.99) * 1e6 for r in runs], "µs"))
            if info.get("wsecho"):
                runs = [ws_echo_latency(info["wsecho"], cfg.latency_samples) for _ in range(cfg.repeat)]
                self.put("latency_p50_us", "ws_echo", _entry([_pct(r, 0.5) * 1e6 for r in runs], "µs"))
                self.put("latency_p99_us", "ws_echo", _entry([_pct(r, 0.99) * 1e6 for r in runs], "µs"))
            runs = [thread_hop_latency(cfg.latency_samples) for _ in range(cfg.repeat)]
            self.put("latency_p50_us", "thread_hop", _entry([_pct(r, 0.5) * 1e6 for r in runs], "µs"))
            self.put("latency_p99_us", "thread_hop", _entry([_pct(r, 0.99) * 1e6 for r in runs], "µs"))
        if "bandwidth" in self.figures:
            for size in cfg.sizes:
                reps = cfg.repeat if size <= 16 * MiB else cfg.big_repeat
                up, down = zip(*(tcp_bandwidth(info["tcp"], size) for _ in range(reps)))
                tag = f"{size // MiB}MiB"
                self.put(f"upload_{tag}_MBps", "tcp", _entry(list(up), "MB/s"))
                self.put(f"download_{tag}_MBps", "tcp", _entry(list(down), "MB/s"))
        if info.get("iroh_frames") and "iroh" in self.transports and (
                "latency" in self.figures or "bandwidth" in self.figures):
            sizes = self.cfg.sizes if "bandwidth" in self.figures else ()
            runs = [iroh_frames(info["iroh_frames"], cfg.latency_samples if "latency" in self.figures else 10, sizes)
                    for _ in range(cfg.repeat)]
            if "latency" in self.figures:
                self.put("latency_p50_us", "iroh_frames", _entry([_pct(r["lat"], 0.5) * 1e6 for r in runs], "µs"))
                self.put("latency_p99_us", "iroh_frames", _entry([_pct(r["lat"], 0.99) * 1e6 for r in runs], "µs"))
            for size in sizes:
                tag = f"{size // MiB}MiB"
                self.put(f"upload_{tag}_MBps", "iroh_frames", _entry([r[size][0] for r in runs], "MB/s"))
                self.put(f"download_{tag}_MBps", "iroh_frames", _entry([r[size][1] for r in runs], "MB/s"))
        if info.get("rpyc") and ("pipelined" in self.figures or "latency" in self.figures):
            runs = [rpyc_calls(info["rpyc"], cfg.rpyc_calls) for _ in range(cfg.repeat)]
            if "pipelined" in self.figures:
                self.put("pipelined_ops_s", "rpyc", _entry([r["ops_s"] for r in runs], "ops/s"))
            if "latency" in self.figures:
                self.put("latency_p50_us", "rpyc", _entry([r["call_p50_s"] * 1e6 for r in runs], "µs"))
                self.put("latency_p99_us", "rpyc", _entry([r["call_p99_s"] * 1e6 for r in runs], "µs"))

    def _verdicts(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, per in TARGETS.items():
            for t, (op, target) in per.items():
                e = self.results.get(key, {}).get(t)
                if e is None:
                    continue
                v = e["median"]
                out.setdefault(key, {})[t] = {"target": f"{op} {target:g}", "value": v,
                                              "met": v >= target if op == ">=" else v <= target}
        return out
