"""A leased peer: ``ember serve`` inside a Ray actor (started by the broker, :mod:`.broker`).

The actor runs a :class:`~ember.server.Server` for one leaseholder: it admits only the leasing
client's iroh identity (``identity=<peer id>``: the peer listens on iroh) or the lease's fresh
token (over TCP). It ends its own process once no session has been open for ``idle`` seconds (the
client went silent), which frees its resources in Ray; the broker sees the actor end.
"""

from __future__ import annotations

import os
import threading
import time


class PeerActor:
    """Runs inside a Ray actor (threaded: ``ended`` blocks while the other calls are answered)."""

    def __init__(self, devices: list[str], *, token: str | None, identity: str | None, host: str | None,
                 idle: float, collectives: bool, offline: bool = True) -> None:
        from ..server import Server
        from ..server.guard.auth import identity_authorizer, token_authorizer
        if not host:  # the address of this actor's node as Ray knows it (each peer of a mesh its own)
            import ray
            host = ray.util.get_node_ip_address()
        from ..errors import EmberError
        auth = identity_authorizer(identity) if identity else token_authorizer((token or "").encode())
        self._end = threading.Event()
        self.error = ""  # why the peer could not start (the broker tells the client)
        try:
            self.server = Server(devices, authorizer=auth, collectives=collectives, dist_host=host)
            if identity:
                self.server.listen_iroh(offline=offline, bind=[f"{host}:0"])
            else:
                self.server.listen_tcp(host, 0)
            self.addresses = self.server.start_in_thread()
        except (EmberError, ValueError, OSError, RuntimeError) as e:
            self.error = f"{type(e).__name__}: {getattr(e, 'message', None) or e}"
            return
        if idle > 0:
            threading.Thread(target=self._watch, args=(idle,), daemon=True).start()

    def _watch(self, idle: float) -> None:
        quiet_since = time.monotonic()
        while True:
            time.sleep(min(1.0, idle / 4))
            if self.server.sessions:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since > idle:
                self._end.set()  # tell the broker why (its ``ended`` call returns), then end:
                time.sleep(1.0)  # the leaseholder went silent, the actor ends, Ray frees its resources
                os._exit(0)

    def address(self) -> str | dict[str, str]:
        """The peer's address, or ``{"error": why}`` when it could not start."""
        return {"error": self.error} if self.error else self.addresses[0]

    def ping(self) -> bool:
        return True

    def ended(self) -> str:
        """Returns only when the peer ends itself ("idle"); the broker waits on it, and a death (killed,
        node lost) fails it: either way the broker learns without polling."""
        self._end.wait()
        return "idle"


__all__ = ["PeerActor"]
