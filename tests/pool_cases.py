"""(Run by test_pool.py inside a loopback-only network namespace.) ember.pool on a local Ray cluster
(2 logical CPUs) with torch:cpu peers, leased through the broker actor: leases, a lease queuing until
another is released, a mesh placed as one unit, a killed peer actor, an idle peer, a lease admitting
only the client's iroh id, the `ember pool serve|status|stop` commands, nothing left behind.
Ray is the optional extra ``ember[ray]``: without it these tests are skipped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")

import ember  # noqa: E402
import ember.torch  # noqa: E402
from ember.errors import AuthorizationError, EmberError  # noqa: E402
from ember.pool import LeaseLost, LeaseTimeout  # noqa: E402

TIMES: dict[str, float] = {}  # measured here, printed at the end (test_pool.py shows them)


@pytest.fixture(scope="module")
def cluster():
    # (run by test_pool.py in a network namespace with only loopback; no usage report home)
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    t0 = time.perf_counter()
    p = ember.pool(num_cpus=2, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    TIMES["ray.init + broker"] = time.perf_counter() - t0
    yield p
    print("\nPOOL TIMES " + json.dumps({k: round(v, 2) for k, v in TIMES.items()}))
    ray.shutdown()


def alive_actors() -> int:
    """Peer actors not dead (the broker is not counted)."""
    from ray._private.state import actors
    return sum(a["State"] != "DEAD" and "PeerActor" in a.get("ActorClassName", "") for a in actors().values())


def wait_until(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return cond()


@pytest.mark.timeout(120)
def test_leases_queue_while_the_cluster_is_full_and_leave_nothing(cluster):
    import ember.array_api as xp
    t0 = time.perf_counter()
    a = cluster.lease("cpu", num_cpus=1)  # NumPy peers: quick to start
    TIMES["lease (cpu peer)"] = time.perf_counter() - t0
    b = cluster.lease("cpu", num_cpus=1)
    assert {x["id"] for x in cluster.status()["leases"]} == {a.id, b.id}
    assert float(xp.sum(xp.arange(4, device=a.device))) == 6
    with pytest.raises(AuthorizationError):  # the peer admits only the lease's token
        ember.connect(a.address)
    got: list = []
    third = threading.Thread(target=lambda: got.append(cluster.lease("cpu", num_cpus=1, wait=90)))
    third.start()
    third.join(1.0)
    assert not got  # no room: queued
    assert wait_until(lambda: [x["state"] for x in cluster.status()["leases"]].count("pending") == 1, 10)
    a.release()
    third.join(90)
    assert got, "the queued lease never started after a release"
    assert float(xp.sum(xp.ones(2, device=got[0].device))) == 2
    b.release()
    got[0].release()
    assert wait_until(lambda: alive_actors() == 0, 30)


@pytest.mark.timeout(60)
def test_a_lease_the_cluster_cannot_place_times_out(cluster):
    from ray.util import placement_group_table
    with pytest.raises(LeaseTimeout):
        cluster.lease(num_cpus=64, wait=2)
    with pytest.raises(LeaseTimeout, match="mesh of 2"):  # one node: two peers on two nodes cannot be placed
        cluster.lease_mesh(2, num_cpus=1, strategy="STRICT_SPREAD", wait=2)
    assert wait_until(lambda: alive_actors() == 0, 30)
    assert all(v["state"] == "REMOVED" for v in placement_group_table().values())
    assert cluster.status()["leases"] == []
    with pytest.raises(EmberError, match=r"torch:cuda:7\) could not start: .*not available"):  # no such device
        cluster.lease("torch:cuda:7", num_cpus=1, wait=60)
    assert wait_until(lambda: alive_actors() == 0, 30)


@pytest.mark.timeout(120)
def test_a_killed_peer_actor_surfaces_on_the_lease(cluster):
    t0 = time.perf_counter()
    lease = cluster.lease(num_cpus=1)
    TIMES["lease (torch:cpu peer)"] = time.perf_counter() - t0
    lease.check()
    ray.kill(lease.actor)
    assert wait_until(lambda: lease.lost is not None, 20)  # the broker told this client, unasked
    with pytest.raises(LeaseLost, match=lease.address):
        lease.check()

    with pytest.raises(LeaseLost, match="actor died"):  # new work on the device: typed, no reconnecting
        with lease.device:
            torch.ones(1, device="ember").sum().item()
    lease.release()


@pytest.mark.timeout(120)
def test_a_mesh_is_placed_as_one_unit_and_freed(cluster):
    from ray.util import placement_group_table
    t0 = time.perf_counter()
    ml = cluster.lease_mesh(2, num_cpus=1, timeout=30)
    TIMES["2-peer mesh lease + form"] = time.perf_counter() - t0
    assert [v["state"] for v in placement_group_table().values()].count("CREATED") == 1
    with ml.mesh:
        x = ml.mesh.shard(torch.tensor([1.0, 2.0]))
        ml.mesh.all_reduce(x)
        assert x.cpu().tolist() == [3.0]
    ml.release()
    assert wait_until(lambda: alive_actors() == 0, 30)
    assert all(v["state"] == "REMOVED" for v in placement_group_table().values())


@pytest.mark.timeout(90)
def test_a_silent_holder_loses_its_lease_and_the_peer_ends(cluster):
    lease = cluster.lease("cpu", num_cpus=1, idle=2)
    lease.device.close()  # no session left: after idle seconds the peer ends itself
    with pytest.raises(LeaseLost, match="no session for 2 s"):
        assert wait_until(lambda: lease.check(2.0) and False, 30)
    assert wait_until(lambda: alive_actors() == 0, 30)
    lease.release()


@pytest.mark.timeout(90)
def test_a_lease_by_identity_admits_only_this_clients_iroh_id(cluster):
    import ember.array_api as xp
    p = ember.pool(identity=True)
    lease = p.lease("cpu", num_cpus=1)
    try:
        assert not lease.address.startswith("tcp://")  # an iroh ticket: the peer has no TCP listener
        assert float(xp.sum(xp.ones(3, device=lease.device))) == 3
        held = ray.get(p.broker.status.remote())["leases"]
        assert [len(x["client"]) for x in held] == [64]  # leased to this client's iroh id, no token
    finally:
        lease.release()
    assert wait_until(lambda: alive_actors() == 0, 30)


@pytest.mark.timeout(150)
def test_the_broker_commands_status_stop_and_serve_a_detached_broker(cluster):
    from ray._private.state import actors
    gcs = ray.get_runtime_context().gcs_address
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}

    def cli(*args: str) -> str:
        r = subprocess.run([sys.executable, "-m", "ember.cli.main", "pool", *args, "--address", gcs], env=env,
                           capture_output=True, text=True, timeout=90)
        assert r.returncode == 0, r.stderr[-2000:]
        return r.stdout

    def brokers() -> int:
        return sum(a["State"] != "DEAD" and "Broker" in a.get("ActorClassName", "") for a in actors().values())
    held = cluster.lease("cpu", num_cpus=1)
    st = json.loads(cli("status", "--json"))
    assert [x["id"] for x in st["leases"]] == [held.id] and st["leases"][0]["state"] == "active"
    assert "1 lease released" in cli("stop")
    with pytest.raises(LeaseLost, match="broker was stopped|broker is gone"):
        assert wait_until(lambda: held.check(2.0) and False, 10)  # told at once, or the broker is gone
    assert wait_until(lambda: alive_actors() == 0 and brokers() == 0, 30)
    assert "broker 'ember-pool' runs" in cli("serve")
    assert brokers() == 1  # detached: it outlived the command
    assert "0 leases released" in cli("stop")
    assert wait_until(lambda: brokers() == 0, 30)
