"""Prometheus ``/metrics`` through ``prometheus_client``: the peer's figures, read at scrape time.

``serve_metrics(server, host, port)`` starts prometheus_client's HTTP server on its own
registry with one collector. The collector reads ``server.figures`` (a subscriber of the
probe's events, with op events on: see ``server/telemetry/figures.py``) and a fresh snapshot of the live
state, so a scrape costs the sessions nothing and nothing is counted twice.

Names follow Prometheus' conventions: counters end in ``_total``, durations are ``_seconds``,
sizes ``_bytes``. Labels carry only values the peer controls (message kinds, op names it offers,
device specs, reasons), never a string a client chose, so a client cannot grow the label set.
"""

from __future__ import annotations

import errno
import platform
from typing import Any, Iterator

from ..._version import __version__
from ...errors import BindError
from ...protocol import messages as m


def _collector(server: Any) -> Any:
    from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily,
                                        InfoMetricFamily)
    from prometheus_client.registry import Collector

    def counter(name: str, doc: str, labels: list[str], items: Any) -> Any:
        c = CounterMetricFamily(name, doc, labels=labels)
        for key, v in items:
            c.add_metric(list(key) if isinstance(key, tuple) else ([key] if labels else []), v)
        return c

    def gauge(name: str, doc: str, labels: list[str], items: Any, unit: str = "") -> Any:
        g = GaugeMetricFamily(name, doc, labels=labels, unit=unit)
        for key, v in items:
            g.add_metric(list(key) if isinstance(key, tuple) else ([key] if labels else []), v)
        return g

    def histogram(name: str, doc: str, labels: list[str], items: Any) -> Any:
        h = HistogramMetricFamily(name, doc, labels=labels, unit="seconds")
        for key, (buckets, total) in items:
            h.add_metric(list(key) if isinstance(key, tuple) else ([key] if labels else []), buckets, total)
        return h

    class EmberCollector(Collector):
        def collect(self) -> Iterator[Any]:
            fig = server.figures
            snap = fig.snapshot("server")
            agg = fig.aggregates()
            tot = snap["totals"]
            devs = [(str(d["index"]), d["spec"]) for d in snap["devices"]]  # labels: device index and spec
            info = InfoMetricFamily("ember_build", "Ember's version, protocol and Python")
            info.add_metric([], {"version": __version__, "protocol": str(m.PROTOCOL_VERSION),
                                 "python": platform.python_version()})
            yield info
            yield gauge("ember_start_time_seconds", "When this peer started (Unix time)", [],
                        [((), fig.started)])
            yield gauge("ember_uptime_seconds", "Seconds since this peer started", [], [((), snap["uptime_s"])])
            # sessions
            open_by = {d: 0 for d in devs}
            for r in snap["sessions"]:
                open_by[devs[r["device"]]] += 1
            yield gauge("ember_sessions_open", "Sessions open now", ["device", "spec"], open_by.items())
            yield counter("ember_sessions_opened", "Sessions accepted", [], [((), tot["sessions_opened"])])
            yield counter("ember_sessions_refused", "Sessions refused at the handshake, by reason", ["reason"],
                          tot["sessions_refused"].items())
            yield counter("ember_sessions_closed", "Sessions ended, by why", ["reason"],
                          tot["sessions_closed"].items())
            # work
            yield counter("ember_messages", "Messages run, by kind", ["kind"], agg["messages"].items())
            yield counter("ember_ops", "Ops run, by kind and name (replay: the ops of replayed graphs)",
                          ["kind", "name"], agg["ops"].items())
            yield histogram("ember_op_duration", "Execution time of one message, by kind", ["kind"],
                            agg["seconds"].items())
            yield histogram("ember_queue_wait", "Time a batch waited between its arrival and its execution",
                            [], [((), agg["wait"])])
            yield counter("ember_batches", "Batches run, by who ran them", ["path"], agg["batches"].items())
            yield counter("ember_payload", "Tensor bytes read or uploaded", ["kind"], agg["payload"].items())
            by_t = tot["bytes_by_transport"]
            transports = sorted({k.split("/")[0] for k in by_t})
            yield counter("ember_received_bytes", "Frame bytes received from clients, by transport", ["transport"],
                          [(t, by_t.get(f"{t}/bytes_in", 0)) for t in transports])
            yield counter("ember_sent_bytes", "Frame bytes sent to clients, by transport", ["transport"],
                          [(t, by_t.get(f"{t}/bytes_out", 0)) for t in transports])
            # graphs, transfers, errors
            yield counter("ember_graph_hits", "Graph replays", [], [((), tot.get("graph_hits", 0))])
            yield counter("ember_graph_misses", "Replays of a graph the cache had lost (re-sent by the client)", [],
                          [((), tot.get("graph_misses", 0))])
            yield counter("ember_graph_evictions", "Graphs evicted from a session's cache", [],
                          [((), tot.get("graph_evictions", 0))])
            yield counter("ember_graph_saved_bytes", "Wire bytes graph replays saved", [],
                          [((), tot.get("graph_saved_bytes", 0))])
            yield counter("ember_transfers", "Tensor transfers, by scope and phase", ["scope", "phase"],
                          [(tuple(k.split("/", 1)), v) for k, v in tot["transfers"].items()])
            yield counter("ember_transferred_bytes", "Bytes of completed transfers, by scope", ["scope"],
                          tot["transferred_bytes"].items())
            yield counter("ember_errors", "Errors: poisoned ops and malformed messages, by kind", ["kind"],
                          tot["errors"].items())
            # memory
            yield gauge("ember_memory_held_bytes", "Bytes of tensors the sessions hold, by device",
                        ["device", "spec"], [(devs[d["index"]], d["bytes_held"]) for d in snap["devices"]])
            yield gauge("ember_tensors_held", "Tensors the sessions hold, by device", ["device", "spec"],
                        [(devs[d["index"]], d["tensors"]) for d in snap["devices"]])
            yield gauge("ember_device_memory_bytes", "A device's total memory, where the backend says",
                        ["device", "spec"], [(devs[d["index"]], d["memory"]) for d in snap["devices"] if d["memory"]])
            yield gauge("ember_session_memory_held_bytes", "Bytes of tensors one session holds",
                        ["session", "device"], [((r["id"][:8], str(r["device"])), r["bytes_held"])
                                                for r in snap["sessions"]])
            yield gauge("ember_memory_budget_bytes", "A device's memory budget (--memory-limit), shared by its "
                        "sessions", ["device", "spec"], [(devs[d["index"]], d["budget_bytes"])
                                                         for d in snap["devices"] if d.get("budget_bytes")])
            yield gauge("ember_memory_budget_used_ratio", "Bytes charged to a device's budget over its limit",
                        ["device", "spec"], [(devs[d["index"]], d["budget_held_bytes"] / d["budget_bytes"])
                                             for d in snap["devices"] if d.get("budget_bytes")])
            yield gauge("ember_session_memory_budget_used_ratio", "Bytes a session holds over its budget "
                        "(--session-memory)", ["session", "device"],
                        [((r["id"][:8], str(r["device"])), r["bytes_held"] / r["budget_bytes"])
                         for r in snap["sessions"] if r.get("budget_bytes")])
            yield counter("ember_memory_refusals", "Requests refused for memory (LimitExceeded), by device",
                          ["device", "spec"], [(devs[d["index"]], d.get("budget_refusals", 0))
                                               for d in snap["devices"]])
            yield counter("ember_telemetry_dropped_events", "Telemetry events dropped by slow subscribers", [],
                          [((), snap["telemetry"]["dropped"])])

    return EmberCollector()


def serve_metrics(server: Any, host: str = "127.0.0.1", port: int = 0) -> tuple[str, Any]:
    """Serve ``/metrics`` on ``host:port`` (0: a free port); return ``(url, close)``."""
    from prometheus_client import CollectorRegistry, start_http_server
    registry = CollectorRegistry(auto_describe=True)
    registry.register(_collector(server))
    try:
        httpd, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        cause = {errno.EADDRINUSE: "address_in_use", errno.EADDRNOTAVAIL: "address_not_available"}.get(
            e.errno or 0, "other")
        raise BindError(f"cannot serve metrics on {host}:{port}: {e.strerror or e}", cause=cause,
                        hint="choose another --metrics HOST:PORT (port 0 picks a free one)") from None
    bound_host, bound_port = httpd.server_address[:2]
    shown = f"[{bound_host}]" if ":" in str(bound_host) else bound_host
    url = f"http://{shown}:{bound_port}/metrics"

    def close() -> None:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)

    return url, close
