"""ember.pool on a local Ray cluster, run in a network namespace of its own.

Ray binds and dials the machine's outward address (its GCS, raylet and runtime-env agent ignore
``_node_ip_address`` for some of their sockets); tests may only talk over loopback. So the cases in
``pool_cases.py`` run in a fresh network namespace whose only interface is ``lo``, where Ray's own
address detection finds 127.0.0.1. Skipped only where the optional extra ``ember[ray]`` is absent.
The admission of a leased peer (its holder's iroh id only) needs no Ray and runs here directly.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import ember
from ember.errors import AuthorizationError
from ember.server import Server
from ember.server.guard.auth import identity_authorizer

LOOPBACK = ["127.0.0.1:0", "[::1]:0"]


@pytest.mark.timeout(60)
def test_a_leased_peer_admits_its_leaseholders_iroh_id_only() -> None:
    from ember.client.io import run_sync
    from ember.keys import new_key, peer_id_of
    from ember.transport.iroh import client_peer_id
    me = run_sync(client_peer_id(), 30)
    for holder, admitted in ((me, True), (peer_id_of(new_key()), False)):
        srv = Server(["cpu"], authorizer=identity_authorizer(holder))
        srv.listen_iroh(offline=True, bind=LOOPBACK)
        srv.listen_tcp("127.0.0.1", 0)
        ticket, tcp = sorted(srv.start_in_thread(), key=lambda a: a.startswith("tcp://"))
        try:
            with pytest.raises(AuthorizationError, match="only its leaseholder's iroh identity"):
                ember.connect(tcp, credential=b"anything")  # no identity over TCP: refused whatever it says
            if admitted:
                dev = ember.connect(ticket)
                assert dev.info["backend"] == "numpy"
                dev.close()
            else:
                with pytest.raises(AuthorizationError, match="not this peer's leaseholder"):
                    ember.connect(ticket)
        finally:
            srv.close()


@pytest.mark.timeout(660)
def test_the_pool_cases_pass_in_a_loopback_only_network_namespace() -> None:
    pytest.importorskip("ray")
    pytest.importorskip("torch")
    assert shutil.which("unshare") and shutil.which("ip"), "needs util-linux's unshare and iproute2's ip"
    cases = Path(__file__).with_name("pool_cases.py")
    cmd = f"ip link set lo up && exec {sys.executable} -m pytest -q -s -p no:cacheprovider -o addopts='' {cases}"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    r = subprocess.run(["unshare", "--net", "sh", "-c", cmd], env=env, cwd=cases.parent,
                       capture_output=True, text=True, timeout=640)
    print(r.stdout[-4000:], r.stderr[-2000:])
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and "failed" not in r.stdout and "skipped" not in r.stdout
