"""The client of a pool: leases of Ember peers granted by the broker (:mod:`.broker`) on Ray."""

from __future__ import annotations

import secrets
from typing import Any

from ..client.device import Device, connect
from ..errors import EmberError, SessionLost
from .broker import BROKER_NAME, NAMESPACE


class LeaseTimeout(EmberError, TimeoutError):
    """The cluster could not place the peer(s) within ``wait`` seconds (it stayed full)."""


class LeaseLost(SessionLost):
    """The leased peer's actor died (killed, its node lost) or ended itself (its holder went silent)."""


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise EmberError("ember.pool needs Ray", hint="pip install 'ember[ray]'") from None
    return ray


def get_broker(ray: Any, *, detached: bool = False, start: bool = True) -> Any:
    """The ``ember-pool`` broker actor: the running one, else (``start``) a new one -- ``detached``
    outlives this driver (``ember pool serve``), else it ends with it."""
    try:
        return ray.get_actor(BROKER_NAME, namespace=NAMESPACE)
    except ValueError:
        if not start:
            raise EmberError(f"no broker {BROKER_NAME!r} runs on this Ray cluster",
                             hint="start one with `ember pool serve --address ray://head:10001`") from None
    from .broker import Broker
    return ray.remote(Broker).options(name=BROKER_NAME, namespace=NAMESPACE, get_if_exists=True, num_cpus=0,
                                      lifetime="detached" if detached else None,
                                      max_concurrency=64).remote()


class LeasedDevice(Device):
    """A leased peer's device: once its lease has ended, new work raises :class:`LeaseLost` (the
    peer is gone for good: no reconnecting to it)."""

    lease: "Lease"

    @property
    def session(self) -> Any:  # type: ignore[override]
        s = self._session
        if s is not None and s.lost is None:
            return s
        if self.lease.lost is not None:
            raise self.lease.lost
        return Device.session.fget(self)  # type: ignore[attr-defined]


class Lease:
    """One leased peer: ``device`` (an ember Device connected to it), :meth:`check`, :meth:`release`."""

    def __init__(self, pool: "Pool", granted: dict[str, Any], credential: str) -> None:
        self.pool, self.id = pool, granted["id"]
        self.addresses: list[str] = granted["addresses"]
        self.actors: list[Any] = granted["actors"]
        self.actor, self.address = self.actors[0], self.addresses[0]
        self.released = False
        self.lost: LeaseLost | None = None  # set as soon as the broker says the lease ended without us
        pool.broker.ended.remote(self.id).future().add_done_callback(self._ended)
        try:
            self.devices: list[Device] = [connect(a, credential=credential) for a in self.addresses]
        except BaseException:
            self.release()
            raise
        for d in self.devices:
            d.__class__ = LeasedDevice
            d.lease = self  # type: ignore[attr-defined]
        self.device = self.devices[0]

    def _ended(self, fut: Any) -> None:
        """(A Ray thread) the broker's ``ended`` call returned: the lease is over."""
        try:
            why = fut.result()["why"]
        except Exception as e:  # noqa: BLE001 - the broker itself is gone
            why = f"the pool's broker is gone ({type(e).__name__})"
        if self.released:
            return
        self.lost = LeaseLost(f"the lease of {', '.join(self.addresses)} ended: {why}", hint="lease another peer")
        for d in getattr(self, "devices", ()):
            s = d._session
            if s is not None:
                s._fail_all(self.lost)  # work waiting on the peer fails now, not at the heartbeat's timeout

    def check(self, timeout: float = 10.0) -> None:
        """Raise :class:`LeaseLost` (why, naming the peer) if the lease ended without its holder."""
        if self.lost is not None:
            raise self.lost
        ray = self.pool.ray
        try:
            st = ray.get(self.pool.broker.state.remote(self.id), timeout=timeout)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
            raise LeaseLost(f"the pool's broker did not answer about {self.address}: {type(e).__name__}",
                            hint="is the broker running? `ember pool status`") from None
        if st["state"] != "active" and not self.released:
            raise LeaseLost(f"the lease of {', '.join(self.addresses)} ended: {st['why']}",
                            hint="lease another peer") from None

    def _close(self) -> None:
        for d in self.devices if hasattr(self, "devices") else ():
            try:
                d.close()
            except EmberError:
                pass

    def release(self) -> None:
        """End the sessions, then the actors (and the placement group) through the broker."""
        if self.released:
            return
        self.released = True
        self._close()
        ray = self.pool.ray
        try:
            ray.get(self.pool.broker.release.remote(self.id), timeout=60)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):  # the broker is gone: do it here
            for a in self.actors:
                ray.kill(a)

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


class MeshLease(Lease):
    """Peers placed as one unit (a placement group), formed into an ``ember.torch`` mesh (``.mesh``)."""

    def __init__(self, pool: "Pool", granted: dict[str, Any], credential: str, backend: str,
                 timeout: float) -> None:
        super().__init__(pool, granted, credential)
        import ember.torch
        try:
            self.mesh = ember.torch.mesh(self.devices, backend=backend, timeout=timeout)
        except BaseException:
            self.release()
            raise

    def _close(self) -> None:
        m = getattr(self, "mesh", None)
        if m is not None:
            try:
                m.close()
            except EmberError:
                pass
        super()._close()


class Pool:
    """Leases peers from the broker of the Ray cluster ``ray.init`` reaches."""

    def __init__(self, address: str | None = None, *, identity: bool = False, **init: Any) -> None:
        ray = self.ray = _ray()
        if not ray.is_initialized():
            ray.init(address=address, **init)
        self.broker = get_broker(ray)
        self.identity = identity

    def _grant(self, n: int, device: str, num_cpus: float, num_gpus: float, wait: float, idle: float,
               host: str | None,
               collectives: bool, strategy: str = "PACK") -> tuple[dict[str, Any], str]:
        ray = self.ray
        token, identity = secrets.token_hex(16), None
        if self.identity:  # the peer admits this client's iroh identity only (no token to leak)
            from ..transport.iroh import client_peer_id
            from ..client.io import run_sync
            identity, token = run_sync(client_peer_id(), 30, "binding this client's iroh identity"), ""
        spec = {"n": n, "device": device, "num_cpus": num_cpus, "num_gpus": num_gpus, "wait": wait, "idle": idle,
                "host": host, "collectives": collectives, "strategy": strategy, "token": token,
                "identity": identity, "client": identity or "token"}
        try:
            got = ray.get(self.broker.lease.remote(spec), timeout=wait + 60)
        except ray.exceptions.GetTimeoutError:
            raise LeaseTimeout(f"the broker granted no lease within {wait + 60:g} s") from None
        if "error" in got:
            if got["error"] == "timeout":
                raise LeaseTimeout(got["message"], hint="release leases, or wait longer (wait=...)")
            raise EmberError(got["message"], hint="check the device string and the cluster's resources")
        return got, token

    def lease(self, device: str = "torch:cpu", *, num_cpus: float = 1, num_gpus: float = 0, wait: float = 600,
              idle: float = 300, host: str | None = None, collectives: bool = False) -> Lease:
        """A peer started in a Ray actor with these resources (waits while the cluster is full). ``host``:
        the address it listens on (and binds collectives to); default: its node's address as Ray knows it."""
        got, token = self._grant(1, device, num_cpus, num_gpus, wait, idle, host, collectives)
        return Lease(self, got, token)

    def lease_mesh(self, n: int, device: str = "torch:cpu", *, num_cpus: float = 1, num_gpus: float = 0,
                   strategy: str = "PACK", wait: float = 600, idle: float = 300, host: str | None = None,
                   backend: str = "gloo", timeout: float = 60.0) -> MeshLease:
        """``n`` peers placed all-or-nothing (a placement group, ``PACK`` or ``STRICT_SPREAD``), as a mesh."""
        if strategy not in ("PACK", "STRICT_SPREAD", "SPREAD", "STRICT_PACK"):
            raise EmberError(f"placement strategy {strategy!r}", hint="PACK or STRICT_SPREAD")
        if n < 1:
            raise EmberError(f"a mesh of {n} peers", hint="n >= 1")
        got, token = self._grant(n, device, num_cpus, num_gpus, wait, idle, host, True, strategy)
        return MeshLease(self, got, token, backend, timeout)

    def status(self) -> dict[str, Any]:
        """The broker's leases (``ember pool status``)."""
        return self.ray.get(self.broker.status.remote(), timeout=30)


def pool(address: str | None = None, **options: Any) -> Pool:
    """A pool on the Ray cluster at ``address`` (``"ray://head:10001"``; None: ``ray.init``'s default, or
    the cluster already initialised). ``identity=True``: leased peers admit this client's iroh id."""
    return Pool(address, **options)


__all__ = ["pool", "Pool", "Lease", "LeasedDevice", "MeshLease", "LeaseLost", "LeaseTimeout", "get_broker"]
