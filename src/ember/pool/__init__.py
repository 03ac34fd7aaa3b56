"""A pool of peers on a Ray cluster: ``ember.pool(...)`` leases peers Ray places and supervises.

>>> pool = ember.pool()                                     # doctest: +SKIP  (or ray://head:10001)
>>> lease = pool.lease(device="torch:cpu", num_cpus=1)      # an ember Device on a peer Ray placed
>>> mesh_lease = pool.lease_mesh(2, device="torch:cpu")     # placed all-or-nothing (a placement group)
>>> lease.release(); mesh_lease.release()

Each lease starts a :class:`~ember.server.Server` inside a Ray actor with the resources asked for; the
peer admits only the fresh token the lease was given, and ends itself when no session has been open
for ``idle`` seconds (a silent client). Ray stays off the op path: ops go client -> peer over TCP.
Needs the optional extra ``ember[ray]``.
"""

from ._pool import Lease, LeaseLost, LeaseTimeout, MeshLease, Pool, pool

__all__ = ["pool", "Pool", "Lease", "MeshLease", "LeaseLost", "LeaseTimeout"]
