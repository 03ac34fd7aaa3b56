"""The broker: a named Ray actor (``ember-pool``) that grants leases of Ember peers.

``ember pool serve`` starts it detached (it outlives the command, one per cluster); ``ember.pool()``
finds it by name, or starts one owned by the client's driver when none runs. A lease asks for a device
and resources; the broker starts a :class:`~.peer.PeerActor` with them (one placement group, ``PACK`` or
``STRICT_SPREAD``, for a mesh: all of its peers or none) and answers with the peers' addresses. While
the cluster is full Ray keeps the actor (or group) pending: the lease waits, up to its ``wait``.

A lease ends on release, when its peer ends itself (no session for ``idle`` seconds: the client went
silent) and when an actor dies (killed, its node lost): the broker waits on every peer's ``ended``
call, so it learns of a death without polling, then kills the lease's other actors and removes its
placement group. Ended leases are remembered (the last :data:`KEEP_ENDED`) so that the client's
:meth:`~ember.pool.Lease.check` can say why; a holder keeps an :meth:`Broker.ended` call pending
and so learns of the end at once. The broker owns its peers' actors: they share its fate (Ray
ends an actor whose owner died), so a broker that dies or is stopped leaves no peer behind.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any

BROKER_NAME = "ember-pool"
NAMESPACE = "ember"
KEEP_ENDED = 256


class _Held:
    __slots__ = ("id", "spec", "actors", "pg", "addresses", "state", "why", "since", "watch", "done")

    def __init__(self, lid: str, spec: dict[str, Any]) -> None:
        self.id, self.spec = lid, spec
        self.actors: list[Any] = []
        self.pg: Any = None
        self.addresses: list[str] = []
        self.state, self.why, self.since = "pending", "", time.time()
        self.watch: asyncio.Task[None] | None = None
        self.done = asyncio.Event()  # set when the lease ends (its holder's watch returns)


def _wrapped(ref: Any) -> "asyncio.Future[Any]":
    return asyncio.wrap_future(ref.future())


class Broker:
    """Runs inside the ``ember-pool`` actor (async: leases wait concurrently)."""

    def __init__(self) -> None:
        import ray
        from .peer import PeerActor
        self.ray = ray
        self.peer = ray.remote(PeerActor)
        self.leases: dict[str, _Held] = {}
        self.ended: dict[str, _Held] = {}
        self.started = time.time()
        self.granted = 0

    # ---- leasing ------------------------------------------------------------------------
    async def lease(self, spec: dict[str, Any]) -> dict[str, Any]:
        """Place ``spec["n"]`` peers; ``{"id", "addresses", "actors"}`` or ``{"error", "message"}``."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        ray = self.ray
        n, wait = int(spec.get("n", 1)), float(spec.get("wait", 600))
        h = _Held(secrets.token_hex(8), spec)
        self.leases[h.id] = h
        t0 = time.monotonic()
        try:
            options: list[dict[str, Any]] = [{}] * n
            if n > 1:
                bundle = {"CPU": spec["num_cpus"], **({"GPU": spec["num_gpus"]} if spec["num_gpus"] else {})}
                h.pg = ray.util.placement_group([bundle] * n, strategy=spec.get("strategy", "PACK"))
                try:
                    await asyncio.wait_for(_wrapped(h.pg.ready()), wait)
                except asyncio.TimeoutError:
                    return self._fail(h, "timeout", f"no room for a mesh of {n} on the cluster within {wait:g} s")
                options = [{"scheduling_strategy": PlacementGroupSchedulingStrategy(h.pg, placement_group_bundle_index=i)}
                           for i in range(n)]
            for o in options:
                h.actors.append(self.peer.options(num_cpus=spec["num_cpus"], num_gpus=spec["num_gpus"],
                                                  max_concurrency=4, **o).remote(
                    [spec["device"]], token=spec.get("token"), identity=spec.get("identity"), host=spec["host"],
                    idle=float(spec["idle"]), collectives=bool(spec.get("collectives") or n > 1),
                    offline=bool(spec.get("offline", True))))
            left = max(0.1, wait - (time.monotonic() - t0))
            try:
                h.addresses = list(await asyncio.wait_for(asyncio.gather(*(_wrapped(a.address.remote())
                                                                           for a in h.actors)), left))
            except asyncio.TimeoutError:
                return self._fail(h, "timeout", f"no room for {n} peer(s) on the cluster within {wait:g} s")
            except Exception as e:  # noqa: BLE001 - the actor failed to start (a bad device, ...)
                return self._fail(h, "failed", f"the peer ({spec['device']}) could not start: {type(e).__name__}")
            bad = [a["error"] for a in h.addresses if isinstance(a, dict)]
            if bad:
                return self._fail(h, "failed", f"the peer ({spec['device']}) could not start: {bad[0][:400]}")
        except BaseException:
            self._free(h)
            self.leases.pop(h.id, None)
            raise
        h.state, h.since = "active", time.time()
        self.granted += 1
        h.watch = asyncio.ensure_future(self._watch(h))
        return {"id": h.id, "addresses": h.addresses, "actors": h.actors}

    def _fail(self, h: _Held, error: str, message: str) -> dict[str, Any]:
        self._free(h)
        self.leases.pop(h.id, None)
        return {"error": error, "message": message}

    async def _watch(self, h: _Held) -> None:
        """Wait on every peer's ``ended``: the first to resolve (an actor died) ends the lease."""
        futs = [_wrapped(a.ended.remote()) for a in h.actors]
        done, _ = await asyncio.wait(futs, return_when=asyncio.FIRST_COMPLETED)
        if h.state != "active":
            return
        i = futs.index(next(iter(done)))
        err = next(iter(done)).exception()
        if err is None:
            self._end(h, "idle", f"the peer {h.addresses[i]} had no session for {float(h.spec['idle']):g} s "
                                 "(its holder went silent)")
        else:
            self._end(h, "lost", f"the peer {h.addresses[i]}'s actor died ({type(err).__name__})")

    def _end(self, h: _Held, state: str, why: str) -> None:
        h.state, h.why, h.since = state, why, time.time()
        h.done.set()
        self._free(h)
        self.leases.pop(h.id, None)
        self.ended[h.id] = h
        while len(self.ended) > KEEP_ENDED:
            self.ended.pop(next(iter(self.ended)))

    def _free(self, h: _Held) -> None:
        ray = self.ray
        for a in h.actors:
            try:
                ray.kill(a)
            except Exception:  # noqa: BLE001 - gone already
                pass
        if h.pg is not None:
            try:
                ray.util.remove_placement_group(h.pg)
            except Exception:  # noqa: BLE001
                pass
            h.pg = None

    async def release(self, lid: str, why: str = "released by its holder") -> bool:
        h = self.leases.get(lid)
        if h is None:
            return False
        if h.watch is not None:
            h.watch.cancel()
        self._end(h, "released", why)
        return True

    async def state(self, lid: str) -> dict[str, Any]:
        h = self.leases.get(lid) or self.ended.get(lid)
        if h is None:
            return {"state": "unknown", "why": "this broker never granted the lease (or it forgot it)"}
        return {"state": h.state, "why": h.why}

    async def ended(self, lid: str) -> dict[str, Any]:
        """Returns when the lease ends (its holder keeps this call pending: it learns at once)."""
        h = self.leases.get(lid)
        if h is not None:
            await h.done.wait()
        return await self.state(lid)

    async def status(self) -> dict[str, Any]:
        now = time.time()
        return {"broker": BROKER_NAME, "up_s": round(now - self.started, 1), "granted": self.granted,
                "leases": [{"id": h.id, "state": h.state, "device": h.spec["device"], "n": len(h.actors) or
                            int(h.spec.get("n", 1)), "addresses": h.addresses, "client": h.spec.get("client", ""),
                            "age_s": round(now - h.since, 1)} for h in self.leases.values()]}

    async def stop(self) -> int:
        """Release every lease (actors killed, groups removed); the caller then kills this actor."""
        n = 0
        for lid in list(self.leases):
            n += await self.release(lid, "the broker was stopped (ember pool stop)")
        return n


__all__ = ["Broker", "BROKER_NAME", "NAMESPACE"]
