"""The session log: one line a person can read per session opened, closed or refused.

A subscriber of the probe's session events (``server/telemetry/probe.py``), logging to
``ember.server.sessions`` at INFO. Each record also carries the event's fields as
``record.ember`` (a dict), which ``ember serve --log-json`` writes as JSON keys. A closing line
says how long the session lasted, what it ran and moved, why it ended and, like Burn Remote's
logger, how many wire bytes op-graph caching saved.
"""

from __future__ import annotations

import logging
from typing import Any

from .figures import _fields
from .probe import Probe, SessionClosed, SessionOpened, SessionRefused, Subscription, consume, finish

log = logging.getLogger("ember.server.sessions")


def size(n: float) -> str:
    """Bytes as a person reads them: 812 B, 3.4 kB, 1.2 MB (powers of 1000)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def who(peer: str | None, remote: str, transport: str) -> str:
    return f"iroh peer {peer[:16]}…" if peer else f"{transport} {remote}"


def describe(ev: Any, devices: list[str]) -> str:
    """The log line of one session event."""
    if isinstance(ev, SessionRefused):
        return f"session refused ({ev.code}) for {ev.peer[:16] + '…' if ev.peer else ev.remote}: {ev.reason}"
    dev = f"device {ev.device} ({devices[ev.device]})" if 0 <= ev.device < len(devices) else f"device {ev.device}"
    kind = "admin session" if ev.admin else "session"
    if isinstance(ev, SessionOpened):
        return f"{kind} {ev.session[:8]} opened: {who(ev.peer, ev.remote, ev.transport)}, {dev}"
    f = ev.figures
    line = (f"{kind} {ev.session[:8]} ended after {ev.duration_s:.1f} s, {ev.why}: "
            f"{who(ev.peer, ev.remote, ev.transport)}, {dev}; {f['ops']:,} ops in {f['batches']:,} batches, "
            f"{size(f['bytes_in'])} in, {size(f['bytes_out'])} out")
    if f["graph_hits"] or f["graph_misses"]:
        line += (f"; graph caching saved {size(f['graph_saved_bytes'])} ({f['graph_hits']:,} replays, "
                 f"{f['graph_misses']} re-sent, {f['graph_evictions']} evicted)")
    return line


class SessionLog:
    """Subscribes to session open/close/refusal events and logs them."""

    def __init__(self, probe: Probe, devices: list[str]) -> None:
        self.probe = probe
        self.devices = devices
        self._sub: Subscription | None = None

    def start(self) -> None:
        if self._sub is None:
            self._sub = self.probe.subscribe({"SessionOpened", "SessionClosed", "SessionRefused"})
            consume(self._sub, self.handle, "log")

    def stop(self) -> None:
        """Handle what is still queued, then unsubscribe."""
        sub, self._sub = self._sub, None
        finish(sub, self.handle)

    def handle(self, ev: Any) -> None:
        if not log.isEnabledFor(logging.INFO):
            return
        fields = _fields(ev)
        fields["event"] = type(ev).__name__
        if isinstance(ev, SessionClosed):
            fields.update(fields.pop("figures"))
        log.info("%s", describe(ev, self.devices), extra={"ember": fields})
