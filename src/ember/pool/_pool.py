"""Leases of Ember peers on Ray: one actor per peer, a placement group per mesh."""

from __future__ import annotations

import secrets
import threading
import time
from typing import Any

from ..client.device import Device, connect
from ..errors import EmberError, SessionLost


class LeaseTimeout(EmberError, TimeoutError):
    """The cluster could not place the peer(s) within ``wait`` seconds (it stays full)."""


class LeaseLost(SessionLost):
    """The leased peer's actor died (killed, its node lost)."""


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise EmberError("ember.pool needs Ray", hint="pip install 'ember[ray]'") from None
    return ray


class _PeerActor:
    """Runs inside a Ray actor: one Ember peer admitting one token, gone when idle."""

    def __init__(self, devices: list[str], token: str, host: str, idle: float, collectives: bool) -> None:
        from ..server import Server
        from ..server.guard.auth import token_authorizer
        self.server = Server(devices, authorizer=token_authorizer(token.encode()), collectives=collectives,
                             dist_host=host)
        self.server.listen_tcp(host, 0)
        self.addresses = self.server.start_in_thread()
        if idle > 0:
            threading.Thread(target=self._watch, args=(idle,), daemon=True).start()

    def _watch(self, idle: float) -> None:
        import os
        quiet_since = time.monotonic()
        while True:
            time.sleep(min(1.0, idle / 4))
            if self.server.sessions:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since > idle:
                os._exit(0)  # the client went silent: the actor ends, Ray frees its resources

    def address(self) -> str:
        return self.addresses[0]

    def ping(self) -> bool:
        return True


class Lease:
    """One leased peer: ``device`` (an ember Device), :meth:`release`, :meth:`check`."""

    def __init__(self, pool: "Pool", actor: Any, address: str, token: str, pg: Any = None) -> None:
        self.pool, self.actor, self.address, self.token, self.pg = pool, actor, address, token, pg
        self.device: Device = connect(address, credential=token)
        self.released = False

    def check(self, timeout: float = 10.0) -> None:
        """Raise :class:`LeaseLost` if the peer's actor is gone."""
        ray = self.pool.ray
        try:
            ray.get(self.actor.ping.remote(), timeout=timeout)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
            raise LeaseLost(f"the leased peer {self.address} is gone: {type(e).__name__}",
                            hint="lease another peer") from None

    def release(self) -> None:
        """End the session and the actor (and its placement group)."""
        if self.released:
            return
        self.released = True
        try:
            self.device.close()
        except EmberError:
            pass
        self.pool.ray.kill(self.actor)
        if self.pg is not None:
            self.pool.ray.util.remove_placement_group(self.pg)


class MeshLease:
    """Peers placed as one unit (a placement group), formed into an ``ember.torch`` mesh."""

    def __init__(self, pool: "Pool", actors: list[Any], addresses: list[str], token: str, pg: Any,
                 backend: str, timeout: float) -> None:
        import ember.torch
        self.pool, self.actors, self.addresses, self.pg = pool, actors, addresses, pg
        self.devices = [connect(a, credential=token) for a in addresses]
        self.mesh = ember.torch.mesh(self.devices, backend=backend, timeout=timeout)
        self.released = False

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        try:
            self.mesh.close()
        except EmberError:
            pass
        for a in self.actors:
            self.pool.ray.kill(a)
        self.pool.ray.util.remove_placement_group(self.pg)


class Pool:
    """Leases peers on the Ray cluster ``ray.init`` reaches."""

    def __init__(self, address: str | None = None, **init: Any) -> None:
        ray = self.ray = _ray()
        if not ray.is_initialized():
            ray.init(address=address, **init)
        self._remote = ray.remote(_PeerActor)

    def _start(self, device: str, token: str, num_cpus: float, num_gpus: float, idle: float, host: str,
               collectives: bool, **options: Any) -> Any:
        return self._remote.options(num_cpus=num_cpus, num_gpus=num_gpus, **options).remote(
            [device], token, host, idle, collectives)

    def _addresses(self, actors: list[Any], wait: float) -> list[str]:
        ray = self.ray
        refs = [a.address.remote() for a in actors]
        try:
            return list(ray.get(refs, timeout=wait))
        except ray.exceptions.GetTimeoutError:
            for a in actors:
                ray.kill(a)
            raise LeaseTimeout(f"no room for {len(actors)} peer(s) on the cluster within {wait:g} s",
                               hint="release leases, or wait longer (wait=...)") from None

    def lease(self, device: str = "torch:cpu", *, num_cpus: float = 1, num_gpus: float = 0, wait: float = 600,
              idle: float = 300, host: str = "127.0.0.1", collectives: bool = False) -> Lease:
        """Start a peer in a Ray actor with these resources (queued while the cluster is full)."""
        token = secrets.token_hex(16)
        actor = self._start(device, token, num_cpus, num_gpus, idle, host, collectives)
        return Lease(self, actor, self._addresses([actor], wait)[0], token)

    def lease_mesh(self, n: int, device: str = "torch:cpu", *, num_cpus: float = 1, num_gpus: float = 0,
                   strategy: str = "PACK", wait: float = 600, idle: float = 300, host: str = "127.0.0.1",
                   backend: str = "gloo", timeout: float = 60.0) -> MeshLease:
        """``n`` peers placed all-or-nothing (a placement group, ``PACK`` or ``STRICT_SPREAD``), as a mesh."""
        ray = self.ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        bundle = {"CPU": num_cpus, **({"GPU": num_gpus} if num_gpus else {})}
        pg = ray.util.placement_group([bundle] * n, strategy=strategy)
        try:
            ray.get(pg.ready(), timeout=wait)
        except ray.exceptions.GetTimeoutError:
            ray.util.remove_placement_group(pg)
            raise LeaseTimeout(f"no room for a mesh of {n} on the cluster within {wait:g} s") from None
        token = secrets.token_hex(16)
        actors = [self._start(device, token, num_cpus, num_gpus, idle, host, True,
                              scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i))
                  for i in range(n)]
        try:
            return MeshLease(self, actors, self._addresses(actors, wait), token, pg, backend, timeout)
        except BaseException:
            for a in actors:
                ray.kill(a)
            ray.util.remove_placement_group(pg)
            raise


def pool(address: str | None = None, **init: Any) -> Pool:
    """A pool on the Ray cluster at ``address`` (``"ray://head:10001"``; None: ``ray.init``'s default, or
    the cluster already initialised)."""
    return Pool(address, **init)


__all__ = ["pool", "Pool", "Lease", "MeshLease", "LeaseLost", "LeaseTimeout"]
