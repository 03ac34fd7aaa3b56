"""The benchmark suite runs end to end (``ember bench --quick``) and writes its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(120)
def test_quick_suite_prints_a_table_and_writes_json(tmp_path: Path) -> None:
    env = dict(os.environ, EMBER_OFFLINE="1")
    p = subprocess.run([sys.executable, "-m", "ember.cli.main", "bench", "--quick", "--no-chart",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=110, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "pipelined small ops (ops/s)" in p.stdout and "op+read 1 elem p50" in p.stdout, p.stdout
    files = list(tmp_path.glob("bench-quick-*.json"))
    assert len(files) == 1
    report = json.loads(files[0].read_text())
    figs = report["figures"]
    for t in ("memory", "websocket"):
        assert figs["pipelined_ops_s"][t]["median"] > 0
        assert figs["latency_p50_us"][t]["median"] > 0
        assert figs["upload_4MiB_MBps"][t]["median"] > 0
        # replayed steps: 10x fewer bytes as one REPLAY, 5x and more as two (the loss read splits the step)
        assert figs["graph_wire_ratio"][t]["median"] >= 5
    assert figs["pipelined_ops_s"]["numpy"]["median"] > 0
    assert figs["latency_p50_us"]["raw_tcp"]["median"] > 0
    assert report["targets"]["graph_wire_ratio"]["websocket"]["met"]
    if "iroh" not in report["meta"]["skipped"]:
        assert figs["pipelined_ops_s"]["iroh"]["median"] > 0


def test_bench_scripts_are_thin_entry_points() -> None:
    for name in ("run_suite.py", "bench_small_ops.py"):
        src = (ROOT / "bench" / name).read_text()
        assert "from ember.bench import main" in src


@pytest.mark.timeout(120)
def test_client_overhead_bench_runs_with_the_batch_never_sent_mid_run() -> None:
    """``bench_client_overhead.py`` checks that no timed run sends its batch; it failed that check for
    months (the peer's ``max_messages`` caps the batch) and nothing noticed: run it, quickly."""
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_client_overhead.py"), "--quick", "--repeat",
                        "1", "--json"], capture_output=True, text=True, timeout=110, cwd=ROOT,
                       env=dict(os.environ, EMBER_OFFLINE="1"))
    assert p.returncode == 0, p.stderr[-3000:]
    results = json.loads(p.stdout)["results"]
    assert all(us > 0 for col in results.values() for us in col.values())
    assert "a + b" in results["graph capture on (default)"]
