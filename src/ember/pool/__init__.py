"""A pool of peers on a Ray cluster: ``ember.pool(...)`` leases peers Ray places and supervises.

>>> pool = ember.pool()                                     # doctest: +SKIP  (or "ray://head:10001")
>>> lease = pool.lease(device="torch:cpu", num_cpus=1)      # an ember Device on a peer Ray placed
>>> mesh_lease = pool.lease_mesh(2, device="torch:cpu")     # placed all-or-nothing (a placement group)
>>> lease.release(); mesh_lease.release()

Leases are granted by a broker, the named Ray actor ``ember-pool`` (``ember pool serve`` starts it
detached; without one, ``ember.pool()`` starts one that ends with this client). Each lease starts a
:class:`~ember.server.Server` inside a Ray actor with the resources asked for; the peer admits only the
lease's fresh token (or, with ``ember.pool(identity=True)``, only this client's iroh id) and ends itself
when no session has been open for ``idle`` seconds (a silent client). Ray stays off the op path: ops go
client -> peer directly. Needs the optional extra ``ember[ray]`` (Ray is imported on first use).

``ember.pool`` is this module and is callable: ``ember.pool(address, **options)`` is :func:`pool`.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from ._pool import Lease, LeaseLost, LeaseTimeout, MeshLease, Pool, get_broker, pool
from .broker import BROKER_NAME


class _CallableModule(types.ModuleType):
    def __call__(self, address: str | None = None, **options: Any) -> Pool:
        return pool(address, **options)


sys.modules[__name__].__class__ = _CallableModule

__all__ = ["pool", "Pool", "Lease", "MeshLease", "LeaseLost", "LeaseTimeout", "get_broker", "BROKER_NAME"]
