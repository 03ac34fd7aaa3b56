"""The output of ``ember bench``: the table on stdout and the PNG chart."""

from __future__ import annotations

from typing import Any

from .common import TARGETS, TRANSPORTS


_ROWS = [
    ("pipelined_ops_s", "pipelined small ops (ops/s)", "{:,.0f}"),
    ("pipelined_ops_s_nographs", "  same, graph caching off", "{:,.0f}"),
    ("latency_p50_us", "op+read 1 elem p50 (µs)", "{:,.0f}"),
    ("latency_p99_us", "op+read 1 elem p99 (µs)", "{:,.0f}"),
    ("upload_1MiB_MBps", "upload 1 MiB (MB/s)", "{:,.0f}"),
    ("download_1MiB_MBps", "download 1 MiB (MB/s)", "{:,.0f}"),
    ("upload_4MiB_MBps", "upload 4 MiB (MB/s)", "{:,.0f}"),
    ("download_4MiB_MBps", "download 4 MiB (MB/s)", "{:,.0f}"),
    ("upload_16MiB_MBps", "upload 16 MiB (MB/s)", "{:,.0f}"),
    ("download_16MiB_MBps", "download 16 MiB (MB/s)", "{:,.0f}"),
    ("upload_256MiB_MBps", "upload 256 MiB (MB/s)", "{:,.0f}"),
    ("download_256MiB_MBps", "download 256 MiB (MB/s)", "{:,.0f}"),
    ("graph_ops_per_step", "training step: ops", "{:,.0f}"),
    ("graph_bytes_first", "step wire bytes, first", "{:,.0f}"),
    ("graph_bytes_replayed", "step wire bytes, replayed", "{:,.0f}"),
    ("graph_wire_ratio", "step bytes first/replayed (×)", "{:,.1f}"),
    ("graph_step_off_us", "step time, graphs off (µs)", "{:,.0f}"),
    ("graph_step_on_us", "step time, graphs on (µs)", "{:,.0f}"),
    ("upload_peak_memory_ratio", "1 GiB upload: peak memory / array", "{:,.2f}"),
    ("upload_peak_memory_MBps", "1 GiB upload (MB/s)", "{:,.0f}"),
    *[(f"link_{w}_{ms}ms_{u}", f"{label}, {ms} ms RTT ({unit})", fmt)
      for ms in ("10", "50") for w, label in (("lsq", "slow link: lsq fit"), ("mlp", "slow link: 50-step MLP"),
                                              ("torch", "slow link: 50-step ember.torch MLP"))
      for u, unit, fmt in (("s", "s", "{:,.3f}"), ("ratio", "torch.rpc / Ember", "{:,.1f}"))],
]
_BASE_COLS = ("numpy", "raw_tcp", "ws_echo", "iroh_frames", "iroh_frames_n", "thread_hop", "rpc", "rpc_uv",
              "rpc_model", "rpyc")


def format_table(report: dict[str, Any]) -> str:
    figs, verdicts = report["figures"], report["targets"]
    cols = [t for t in TRANSPORTS if any(t in figs.get(k, {}) for k, _, _ in _ROWS)]
    bcols = [b for b in _BASE_COLS if any(b in figs.get(k, {}) for k, _, _ in _ROWS)]
    header = ["figure"] + cols + bcols + ["target (ws / iroh)"]
    lines = []
    for key, label, fmt in _ROWS:
        if key not in figs:
            continue
        row = [label]
        for c in cols + bcols:
            e = figs[key].get(c)
            cell = fmt.format(e["median"]) if e is not None else ""
            v = verdicts.get(key, {}).get(c)
            if v is not None:
                cell += " ✓" if v["met"] else " ✗"
            row.append(cell)
        tg = TARGETS.get(key)
        row.append(" / ".join(f"{tg[t][0]} {tg[t][1]:,g}" for t in ("websocket", "iroh")) if tg else "")
        lines.append(row)
    widths = [max(len(str(r[i])) for r in [header] + lines) for i in range(len(header))]
    out = ["  ".join(str(h).ljust(w) if i == 0 else str(h).rjust(w) for i, (h, w) in enumerate(zip(header, widths)))]
    out.append("  ".join("-" * w for w in widths))
    for r in lines:
        out.append("  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    m = report["meta"]
    pin = m["pinned"]
    out.append(f"medians of {m['repeat']} runs; client on core {pin['client']}, server process on core {pin['server']}"
               if pin else f"medians of {m['repeat']} runs; not pinned ({m['cpus']} CPUs)")
    out.append("baselines: numpy = the chain in local NumPy; raw_tcp = raw asyncio TCP between the two processes; ws_echo = websockets echo; "
               "iroh_frames = raw frames on one iroh stream (Ember's transport, no session); "
               "iroh_frames_n = the same bytes split over as many streams of one connection as Ember's lanes; "
               "thread_hop = asyncio call_soon_threadsafe round trip; rpyc = rpyc driving remote NumPy, one call per op; "
               "rpc = torch.distributed.rpc (TensorPipe, its own choice of transport: shared memory on one host), "
               "rpc_uv = the same over TensorPipe's TCP transport; rpc_model = rpc_uv on loopback + one RTT per call")
    for t, why in m.get("skipped", {}).items():
        out.append(f"skipped {t}: {why}")
    return "\n".join(out)


def format_ratios(report: dict[str, Any]) -> str:
    """The issue's ratio targets: Ember over a baseline, medians of this run."""
    rows = report.get("ratios") or []
    if not rows:
        return ""
    out = ["ratios (Ember / baseline, same run):"]
    for r in rows:
        out.append(f"  {r['figure']:<22} {r['ember']:<9} / {r['baseline']:<11} = {r['ratio']:6.2f}  "
                   f"target {r['target']:<6} {'✓' if r['met'] else '✗'}")
    return "\n".join(out)


def write_chart(report: dict[str, Any], path: str) -> str | None:
    """A PNG of ops/s and MB/s by transport (None when matplotlib is not installed)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    figs = report["figures"]
    cols = [c for c in TRANSPORTS + _BASE_COLS if c in figs.get("pipelined_ops_s", {})]
    bw_keys = [k for k, _, _ in _ROWS if k.endswith("_MBps") and k in figs]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    if cols:
        axes[0].bar(cols, [figs["pipelined_ops_s"][c]["median"] for c in cols], color="#d2691e")
        axes[0].set_yscale("log")
        axes[0].set_title("pipelined small ops (ops/s, log)")
    bcols = [c for c in TRANSPORTS + ("raw_tcp", "iroh_frames", "iroh_frames_n") if any(c in figs[k] for k in bw_keys)]
    width = 0.8 / max(1, len(bcols))
    for i, c in enumerate(bcols):
        xs = [j + i * width for j in range(len(bw_keys))]
        axes[1].bar(xs, [figs[k].get(c, {}).get("median", 0) for k in bw_keys], width, label=c)
    axes[1].set_xticks([j + 0.4 - width / 2 for j in range(len(bw_keys))])
    axes[1].set_xticklabels([k.replace("_MBps", "").replace("_", "\n") for k in bw_keys], fontsize=8)
    axes[1].set_title("bandwidth (MB/s)")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
