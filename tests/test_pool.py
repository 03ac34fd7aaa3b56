"""ember.pool on a local Ray cluster, run in a network namespace of its own.

Ray binds and dials the machine's outward address (its GCS, raylet and runtime-env agent ignore
``_node_ip_address`` for some of their sockets); tests may only talk over loopback. So the cases in
``pool_cases.py`` run in a fresh network namespace whose only interface is ``lo``, where Ray's own
address detection finds 127.0.0.1. Skipped only where the optional extra ``ember[ray]`` is absent.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")
pytest.importorskip("torch")


@pytest.mark.timeout(660)
def test_the_pool_cases_pass_in_a_loopback_only_network_namespace() -> None:
    assert shutil.which("unshare") and shutil.which("ip"), "needs util-linux's unshare and iproute2's ip"
    cases = Path(__file__).with_name("pool_cases.py")
    cmd = f"ip link set lo up && exec {sys.executable} -m pytest -q -s -p no:cacheprovider -o addopts='' {cases}"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    r = subprocess.run(["unshare", "--net", "sh", "-c", cmd], env=env, cwd=cases.parent,
                       capture_output=True, text=True, timeout=640)
    print(r.stdout[-4000:], r.stderr[-2000:])
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "failed" not in r.stdout and "skipped" not in r.stdout
