"""The peer's figures: what ``ember status`` / ``ember top`` show and ``/metrics`` exports.

``Figures`` is a subscriber of the server's probe (``server/telemetry/probe.py``). From session events
it keeps the recent transfers, errors and closed sessions and each live session's last error;
once ``start(ops=True)`` (Prometheus) asked for op events too, it also aggregates messages by
kind, ops by name, execution-time and queue-wait histograms, batches and payload bytes.

``snapshot()`` adds what is state, read on demand: the live sessions with their counters and
the memory they hold (what their memory budgets are charged, ``server.memory``, read when asked),
and the same per device. STATS is answered by ``answer()``: scope ``session`` (one's own
session; anyone may ask) or ``server`` (the whole peer; admin sessions only).
"""

from __future__ import annotations

import platform
import struct
import threading
import time
from bisect import bisect_left
from collections import Counter, defaultdict, deque
from typing import Any

import numpy as np

from ..._version import __version__
from ...errors import ProtocolError
from ...protocol import messages as m
from .events import kind_name
from .probe import SESSION_EVENTS, Batch, Error, SessionClosed, SessionOpened, Subscription, \
    Transfer, consume, counters, finish

#: Upper bounds (seconds) of the execution-time and queue-wait histograms.
BUCKETS = (1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025,
           0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_EDGES = np.asarray(BUCKETS)
_DOUBLE = struct.Struct("d")
_OP_KINDS = frozenset({m.OP, m.CUSTOM, m.ATEN})
_READ, _UPLOAD, _REPLAY = m.READ, m.UPLOAD, m.REPLAY


class Histogram:
    """Counts per bucket (``BUCKETS`` then +Inf), their sum and count."""

    __slots__ = ("counts", "sum", "count")

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.counts[bisect_left(BUCKETS, v)] += 1
        self.sum += v
        self.count += 1

    def add(self, values: np.ndarray) -> None:
        """Observe every value of ``values`` (one pass, in NumPy)."""
        for i, c in enumerate(np.bincount(np.searchsorted(_EDGES, values), minlength=len(self.counts)).tolist()):
            self.counts[i] += c
        self.sum += float(values.sum())
        self.count += len(values)

    def cumulative(self) -> list[tuple[str, int]]:
        """``[(upper bound, cumulative count), ...]`` ending with ``+Inf`` (Prometheus' form)."""
        out, n = [], 0
        for le, c in zip([*(repr(b) for b in BUCKETS), "+Inf"], self.counts):
            n += c
            out.append((le, n))
        return out


def _fields(ev: Any) -> dict[str, Any]:
    return {f: getattr(ev, f) for f in ev.__slots__}


class Figures:
    """Recent events and aggregates from the probe, plus on-demand snapshots of the live state."""

    def __init__(self, server: Any, ring: int = 32) -> None:
        self.server = server
        self.probe = server.telemetry
        self.started = time.time()
        self._t0 = time.monotonic()
        self._lock = threading.Lock()
        self.transfers: deque[dict[str, Any]] = deque(maxlen=ring)
        self.errors: deque[dict[str, Any]] = deque(maxlen=ring)
        self.closed: deque[dict[str, Any]] = deque(maxlen=ring)
        self.last_error: dict[str, str] = {}           # live session -> its latest error
        self.transferred: Counter[str] = Counter()     # scope -> bytes moved by completed transfers
        # op events (only with ops=True)
        self.ops_on = False
        self.messages: Counter[str] = Counter()        # message kind -> count
        self.ops: Counter[tuple[str, str]] = Counter()  # (kind, name) -> ops run
        self.seconds: defaultdict[str, Histogram] = defaultdict(Histogram)  # message kind -> execution time
        self.wait = Histogram()                        # per batch: arrival -> start
        self.batches: Counter[str] = Counter()         # inline | worker
        self.payload: Counter[str] = Counter()         # read | upload -> bytes
        self._sub: Subscription | None = None
        self._pending: list[bytes] = []  # op durations not binned yet: packed batch starts and ends
        self._skip: list[int] = []       # their positions that are not op messages
        self._pending_n = 0
        self._known = frozenset().union(*server.tables)  # op names this peer offers
        self._torch = any(b.kind == "torch" for b in server.backends)
        self._vetted: dict[str, bool] = {}

    # ---- subscribing ------------------------------------------------------------------
    def start(self, ops: bool = False) -> None:
        """Subscribe (session events; op events too with ``ops``) and consume on a thread."""
        if self._sub is not None:
            return
        self.ops_on = ops
        self._sub = self.probe.subscribe(SESSION_EVENTS | ({"Batch"} if ops else set()), capacity=16384)
        consume(self._sub, self.handle, "figures")

    def stop(self) -> None:
        """Handle what is still queued, then unsubscribe."""
        sub, self._sub = self._sub, None
        finish(sub, self.handle)

    def handle(self, ev: Any) -> None:
        t = type(ev)
        with self._lock:
            if t is Batch:
                self._batch(ev)
            elif t is Error:
                self.errors.append(_fields(ev))
                if ev.session:
                    self.last_error.pop(ev.session, None)
                    self.last_error[ev.session] = ev.message
                    if len(self.last_error) > 4096:  # sessions whose close was never seen (events dropped)
                        self.last_error.pop(next(iter(self.last_error)))
            elif t is Transfer:
                self.transfers.append(_fields(ev))
                if ev.phase == "completed":
                    self.transferred[ev.scope] += ev.nbytes
            elif t is SessionClosed:
                self.last_error.pop(ev.session, None)
                d = _fields(ev)
                d.update(d.pop("figures"))
                self.closed.append(d)
            elif t is SessionOpened:
                self.last_error.pop(ev.session, None)

    def _batch(self, b: Batch) -> None:
        self.batches["inline" if b.inline else "worker"] += 1
        self.wait.observe(b.wait_s)
        names, extras = b.names, b.extras
        n = len(names)
        if not n:
            return
        ops = self.ops
        n_ops = n - len(extras)
        if n_ops:  # op durations: kept packed, binned in bulk by _flush (NumPy once per ~32k ops)
            base = self._pending_n
            self._pending.append(_DOUBLE.pack(b.start))
            self._pending.append(b.times)
            skip = self._skip
            skip.append(base)  # the batch's start is not a message
            for x in extras:
                skip.append(base + 1 + x[0])
            self._pending_n = base + n + 1
            if self._pending_n >= 32768:
                self._flush()
            self.messages["op"] += n_ops
            try:
                by_name = Counter(names)
            except TypeError:  # an unhashable name (a malformed OP): count it as "other"
                by_name = Counter(x if isinstance(x, str) else "other" for x in names)
            by_name.pop(None, None)
            for name, k in by_name.items():
                ops["op", self.label(name)] += k
        if not extras:
            return
        ends, seconds, payload = b.ends(), self.seconds, self.payload
        for i, kind, name, nbytes, n_run, _saved in extras:
            k = kind_name(kind)
            self.messages[k] += 1
            seconds[k].observe(ends[i] - (ends[i - 1] if i else b.start))
            if kind in _OP_KINDS:
                ops[k, self.label(name)] += 1
            elif kind == _REPLAY:
                ops["replay", ""] += n_run
            elif nbytes and (kind == _READ or kind == _UPLOAD):
                payload[k] += nbytes

    def _flush(self) -> None:
        """Bin the pending op durations (under the lock)."""
        if not self._pending_n:
            return
        t = np.frombuffer(b"".join(self._pending), dtype=np.float64)
        d = np.empty_like(t)
        d[0] = 0.0
        np.subtract(t[1:], t[:-1], out=d[1:])
        keep = np.ones(len(t), dtype=bool)
        keep[self._skip] = False
        self.seconds["op"].add(d[keep])
        self._pending, self._skip, self._pending_n = [], [], 0

    def label(self, name: Any) -> str:
        """``name`` as a metric label when this peer offers such an op, else ``"other"``: a client may
        send any name, and must not grow the label set (ATen names: vetted overloads only)."""
        if type(name) is not str:
            return "other"
        if name in self._known or name in self.server.custom_ops:
            return name
        ok = self._vetted.get(name)
        if ok is None:
            ok = self._torch and name.startswith("aten.") and self.server.vetted_aten(name)
            if len(self._vetted) < 8192:
                self._vetted[name] = ok
        return name if ok else "other"

    def aggregates(self) -> dict[str, Any]:
        """Copies of the op-event aggregates (histograms as ``(cumulative buckets, sum)``)."""
        with self._lock:
            self._flush()
            return {"messages": dict(self.messages), "ops": dict(self.ops), "batches": dict(self.batches),
                    "payload": dict(self.payload), "wait": (self.wait.cumulative(), self.wait.sum),
                    "seconds": {k: (h.cumulative(), h.sum) for k, h in self.seconds.items()}}

    # ---- snapshots ---------------------------------------------------------------------
    def session_row(self, s: Any, now: float) -> dict[str, Any]:
        it, mem = s.interp, s.mem.stats()  # (what the budget holds: the tensors are never summed here)
        return {"id": s.label, "peer": s.peer_id, "remote": s.conn.remote, "transport": s.transport,
                "device": s.device_index, "admin": s.admin, "age_s": now - s.opened, **counters(s),
                "graphs_cached": len(it.graphs), "tensors": len(it.tensors), "poisoned": len(it.poison),
                "bytes_held": mem["held"], "budget_bytes": mem["limit"],
                "budget_peak_bytes": mem["peak"], "budget_refusals": mem["refusals"],
                "last_error": self.last_error.get(s.label),
                # (a session that agreed on compiled graphs: its graphs' compiled prefixes, by state)
                "compiled_graphs": it.graphs.compiled_states() if it.compiler is not None else None}

    def _server_info(self) -> dict[str, Any]:
        srv = self.server
        return {"version": __version__, "protocol": m.PROTOCOL_VERSION, "python": platform.python_version(),
                "peer_id": srv.peer_id, "instance": srv.instance, "addresses": list(srv.addresses),
                "metrics": getattr(srv, "metrics_address", None), "max_sessions": srv.max_sessions,
                "started": self.started}

    def snapshot(self, scope: str = "server", session: Any = None) -> dict[str, Any]:
        """The figures as plain data (MessagePack- and JSON-friendly).

        ``scope="server"``: every session, device, total and recent event; ``scope="session"``:
        ``session``'s own row and its device, nothing about other sessions.
        """
        now = time.monotonic()
        probe, srv = self.probe, self.server
        base = {"time": time.time(), "uptime_s": now - self._t0, "scope": scope}
        if scope == "session":
            b = srv.backends[session.device_index]
            with self._lock:
                row = self.session_row(session, now)
            return {**base, "server": {"version": __version__, "peer_id": srv.peer_id},
                    "device": {"index": session.device_index, "spec": b.spec, "kind": b.kind, "name": b.name,
                               "memory": b.memory}, "session": row}
        with probe.lock:
            live = list(probe.sessions)
            totals: Counter[str] = Counter(probe.closed_totals)
            extra = {"sessions_opened": probe.opened, "sessions_refused": dict(probe.refused),
                     "sessions_closed": dict(probe.closed), "errors": dict(probe.errors),
                     "transfers": dict(probe.transfers)}
        with self._lock:
            rows = [self.session_row(s, now) for s in live]
            recent = {"transfers": list(self.transfers), "errors": list(self.errors), "closed": list(self.closed)}
            transferred = dict(self.transferred)
        by_transport: Counter[str] = Counter({k: v for k, v in totals.items() if "/" in k})
        for r in rows:
            for k in ("messages", "ops", "batches", "bytes_in", "bytes_out", "graph_hits", "graph_misses",
                      "graph_evictions", "graph_saved_bytes"):
                totals[k] += r[k]
            by_transport[f"{r['transport']}/bytes_in"] += r["bytes_in"]
            by_transport[f"{r['transport']}/bytes_out"] += r["bytes_out"]
        devices = []
        budgets = getattr(srv, "budgets", None)
        for i, b in enumerate(srv.backends):
            mine = [r for r in rows if r["device"] == i]
            budget = budgets[i].stats() if budgets else {}
            devices.append({"index": i, "spec": b.spec, "kind": b.kind, "name": b.name, "memory": b.memory,
                            "sessions": len(mine), "tensors": sum(r["tensors"] for r in mine),
                            "bytes_held": sum(r["bytes_held"] for r in mine),
                            "budget": budget.get("budget"), "budget_bytes": budget.get("limit"),
                            "budget_held_bytes": budget.get("held"), "budget_peak_bytes": budget.get("peak"),
                            "budget_refusals": budget.get("refusals", 0)})
        plain = {k: v for k, v in totals.items() if "/" not in k}
        return {**base, "server": self._server_info(), "devices": devices, "sessions": rows,
                "totals": {"sessions_open": len(rows), **plain, **extra, "bytes_by_transport": dict(by_transport),
                           "transferred_bytes": transferred},
                "recent": recent,
                "telemetry": {"subscribers": len(probe.subscribers), "dropped": probe.dropped,
                              "op_events": probe.active}}

    def answer(self, session: Any, msg: list[Any]) -> list[Any] | None:
        """The response to ``[STATS, req, scope]`` (None without a request id: nothing to answer)."""
        req = msg[1] if len(msg) > 1 and type(msg[1]) is int and not isinstance(msg[1], bool) else 0
        if not req:
            return None
        scope = msg[2] if len(msg) > 2 else "session"
        if scope == "server":
            if not session.admin:
                return [req, m.ERROR, {"kind": "AuthorizationError", "op": None, "message":
                        "figures of the whole peer need an admin session: connect with admin=True and the "
                        "peer's admin token (ember status/top --token), or from an allowlisted admin peer"}]
            return [req, m.OK, self.snapshot("server")]
        if scope == "session":
            return [req, m.OK, self.snapshot("session", session)]
        err = ProtocolError(f"unknown STATS scope {str(scope)[:40]!r}: expected 'session' or 'server'")
        return [req, m.ERROR, {"kind": "ProtocolError", "op": None, "message": err.message}]
