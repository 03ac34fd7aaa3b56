"""(Run by test_pool.py inside a loopback-only network namespace.) ember.pool on a local Ray cluster (2 logical CPUs) with torch:cpu peers: leases, a lease queuing
until another is released, a mesh placed as one unit, a killed peer actor, nothing left behind.
Ray is the optional extra ``ember[ray]``: without it these tests are skipped."""

from __future__ import annotations

import os
import threading
import time

import pytest

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")

import ember  # noqa: E402
import ember.torch  # noqa: E402
from ember.errors import AuthorizationError, EmberError  # noqa: E402
from ember.pool import LeaseLost, LeaseTimeout, pool  # noqa: E402


@pytest.fixture(scope="module")
def cluster():
    # (run by test_pool.py in a network namespace with only loopback; no usage report home)
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    p = pool(num_cpus=2, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    yield p
    ray.shutdown()


def alive_actors() -> int:
    from ray._private.state import actors
    return sum(a["State"] != "DEAD" for a in actors().values())


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
    a, b = cluster.lease("cpu", num_cpus=1), cluster.lease("cpu", num_cpus=1)  # NumPy peers: quick to start
    assert float(xp.sum(xp.arange(4, device=a.device))) == 6
    with pytest.raises(AuthorizationError):  # the peer admits only the lease's token
        ember.connect(a.address)
    got: list = []
    third = threading.Thread(target=lambda: got.append(cluster.lease("cpu", num_cpus=1, wait=90)))
    third.start()
    third.join(1.0)
    assert not got  # no room: queued
    a.release()
    third.join(90)
    assert got, "the queued lease never started after a release"
    assert float(xp.sum(xp.ones(2, device=got[0].device))) == 2
    b.release()
    got[0].release()
    assert wait_until(lambda: alive_actors() == 0, 30)


@pytest.mark.timeout(60)
def test_a_lease_the_cluster_cannot_place_times_out(cluster):
    with pytest.raises(LeaseTimeout):
        cluster.lease(num_cpus=64, wait=2)
    assert wait_until(lambda: alive_actors() == 0, 30)


@pytest.mark.timeout(120)
def test_a_killed_peer_actor_surfaces_on_the_lease(cluster):
    lease = cluster.lease(num_cpus=1)
    lease.check()
    ray.kill(lease.actor)
    with pytest.raises(LeaseLost, match=lease.address):
        assert wait_until(lambda: lease.check(2.0) and False, 20)

    def device_fails() -> bool:  # (Ray reports the actor dead a moment before its process has gone)
        try:
            with lease.device:
                torch.ones(1, device="ember").sum().item()
        except EmberError:
            return True
        return False
    assert wait_until(device_fails, 30)
    lease.release()


@pytest.mark.timeout(120)
def test_a_mesh_is_placed_as_one_unit_and_freed(cluster):
    from ray.util import placement_group_table
    ml = cluster.lease_mesh(2, num_cpus=1, timeout=30)
    assert [v["state"] for v in placement_group_table().values()].count("CREATED") == 1
    with ml.mesh:
        x = ml.mesh.shard(torch.tensor([1.0, 2.0]))
        ml.mesh.all_reduce(x)
        assert x.cpu().tolist() == [3.0]
    ml.release()
    assert wait_until(lambda: alive_actors() == 0, 30)
    assert all(v["state"] == "REMOVED" for v in placement_group_table().values())
