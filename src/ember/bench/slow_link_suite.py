"""``ember bench --link-delay MS[,MS]``: the slow-link figure (see ``slow_link``), run by the suite."""

from __future__ import annotations

import time
from typing import Any

from .common import _entry
from .slow_link import ember_workload, start_proxies, torch_workload, via_proxy

WORKLOADS = ("lsq", "mlp", "torch")


def _round_trip(dev: Any) -> float:
    """The fastest of a few sync round trips (seconds)."""
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        dev.sync()
        best = min(best, time.perf_counter() - t0)
    return best


def slow_link(suite: Any, info: dict[str, Any]) -> None:
    """For each RTT: every workload over every transport through the proxy, and torch.rpc (modelled:
    loopback calls + one RTT per synchronous call). Figures are seconds per step; ``link_ratio``
    is torch.rpc's time over Ember's."""
    import ember
    cfg = suite.cfg
    transports = [t for t in suite.addresses if t != "memory"]
    rpc = suite.rpcs.get("rpc_uv") or suite.rpcs.get("rpc")
    for rtt in cfg.link_delays:
        suite.log(f"ember bench: slow link, {rtt:g} ms RTT")
        proxies = start_proxies(suite.addresses, transports, rtt, suite.cores[1])
        try:
            devs = {t: ember.connect(via_proxy(suite.addresses[t], p.port), timeout=60.0)
                    for t, p in proxies.items()}
            tdev = info.get("torch_device")
            tdevs = {t: ember.connect(via_proxy(suite.addresses[t], p.port), device=tdev, timeout=60.0)
                     for t, p in proxies.items()} if tdev is not None else {}
            try:
                for t in list(devs):
                    if _round_trip(devs[t]) < 0.8 * rtt / 1000.0:  # the link found a way around the proxy
                        suite.log(f"ember bench: slow link over {t} bypasses the proxy; not measured")
                        suite.results.setdefault("link_bypassed", {})[t] = _entry([rtt], "ms")
                        devs.pop(t).close()
                for kind in WORKLOADS:
                    if kind == "torch":
                        _torch_link(suite, {t: d for t, d in tdevs.items() if t in devs}, rtt)
                        continue
                    key = f"link_{kind}_{rtt:g}ms_s"
                    checks = {}
                    for t, d in devs.items():
                        ember_workload(d, kind, 2)  # warm up (graphs, connections)
                        runs = [ember_workload(d, kind, cfg.link_steps) for _ in range(max(1, cfg.repeat // 2))]
                        checks[t] = runs[0]["check"]
                        suite.put(key, t, _entry([r["s"] for r in runs], "s"))
                    if rpc is not None:
                        r = rpc.run("workload", kind=kind, steps=cfg.link_steps)
                        modelled = r["s"] + r["calls"] * rtt / 1000.0
                        suite.put(key, "rpc_model", _entry([modelled], "s"))
                        suite.put(f"link_{kind}_calls", "rpc_model", _entry([r["calls"]], "calls"))
                        for t in devs:
                            if abs(checks[t] - r["check"]) > 1e-6 * max(1.0, abs(r["check"])):
                                raise AssertionError(f"slow link {kind}: Ember over {t} and torch.rpc disagree")
                            suite.put(f"link_{kind}_{rtt:g}ms_ratio", t,
                                      _entry([modelled / suite.results[key][t]["median"]], "×"))
            finally:
                for d in [*devs.values(), *tdevs.values()]:
                    d.close()
        finally:
            for p in proxies.values():
                p.close()


def _torch_link(suite: Any, devs: dict[str, Any], rtt: float) -> None:
    """The ember.torch loop over each delayed transport; torch.rpc modelled as its local time plus one
    round trip per ATen op dispatched (what one synchronous call per op costs on that link)."""
    if not devs:
        return
    cfg = suite.cfg
    key = f"link_torch_{rtt:g}ms_s"
    local = torch_workload("cpu", cfg.link_steps)
    for t, d in devs.items():
        torch_workload(d, 2)  # warm up (meta cache, graphs, connections)
        runs = [torch_workload(d, cfg.link_steps) for _ in range(max(1, cfg.repeat // 2))]
        if runs[0]["check"] != local["check"]:
            raise AssertionError(f"slow link torch: Ember over {t} and local torch disagree")
        suite.put(key, t, _entry([r["s"] for r in runs], "s"))
        modelled = local["s"] + runs[0]["calls"] * rtt / 1000.0
        suite.put(key, "rpc_model", _entry([modelled], "s"))
        suite.put("link_torch_calls", "rpc_model", _entry([runs[0]["calls"]], "calls"))
        suite.put(f"link_torch_{rtt:g}ms_ratio", t, _entry([modelled / suite.results[key][t]["median"]], "×"))
