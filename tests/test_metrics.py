"""Prometheus /metrics: `ember serve --metrics`, scraped over real HTTP, parsed by prometheus_client."""

from __future__ import annotations

import re
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import ember
import ember.array_api as xp
from ember.errors import BindError
from ember.server import Server

from test_core_cli import ENV


def scrape(url: str) -> dict[str, object]:
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(families, metric: str, sample: str | None = None, **labels) -> float:
    """The value of ``metric``'s sample (its first one, or the one named ``sample``) with ``labels``."""
    assert metric in families, f"no metric {metric}"
    fam = families[metric]
    for s in fam.samples:
        if s.name.endswith(("_bucket", "_created")) or (sample is not None and s.name != sample):
            continue
        if all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise AssertionError(f"no sample of {metric} with {labels}: {fam.samples}")


def eventually(fn, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            return fn()
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@pytest.mark.timeout(60)
def test_serve_metrics_reports_sessions_ops_bytes_memory_and_errors():
    p = subprocess.Popen([sys.executable, "-m", "ember.cli.main", "serve", "--no-iroh", "--websocket",
                          "127.0.0.1:0", "--metrics", "127.0.0.1:0", "--token", "tok", "--memory-limit", "1GiB",
                          "--session-memory", "64MiB"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        ws = url = None
        while ws is None or url is None:  # readiness: the printed addresses
            line = p.stdout.readline()
            assert line, p.stderr.read()
            ws = ws or (re.search(r"listening on (ws://\S+)", line) or [None, None])[1]
            url = url or (re.search(r"metrics on (http://\S+)", line) or [None, None])[1]
        assert url.endswith("/metrics")
        with pytest.raises(ember.errors.AuthorizationError):
            ember.connect(ws, credential="wrong")
        d = ember.connect(ws, credential="tok", graphs=False)
        x = xp.asarray(np.ones(1000), device=d)
        y = x
        for _ in range(50):
            y = y * 1.0 + 1.0
        assert y.to_numpy()[0] == 51.0
        bad = ember.custom_op("no_such_op", x, outputs=[((1000,), xp.float64)])
        with pytest.raises(ember.errors.RemoteExecutionError):
            bad.to_numpy()

        def check():
            f = scrape(url)
            assert value(f, "ember_build_info", version=ember.__version__) == 1
            assert value(f, "ember_sessions_open", device="0", spec="cpu") == 1
            assert value(f, "ember_sessions_opened") == 1
            assert value(f, "ember_sessions_refused", reason="unauthorized") == 1
            assert value(f, "ember_ops", kind="op", name="multiply") == 50
            assert value(f, "ember_ops", kind="op", name="add") == 50
            assert value(f, "ember_ops", kind="custom", name="other") == 1  # not a name the peer offers
            assert value(f, "ember_messages", kind="read") == 2
            assert value(f, "ember_payload", kind="upload") == 8000
            assert value(f, "ember_errors", kind="RemoteExecutionError") == 1
            assert value(f, "ember_received_bytes", transport="websocket") > 8000
            assert value(f, "ember_sent_bytes", transport="websocket") > 8000
            assert value(f, "ember_memory_held_bytes", device="0", spec="cpu") >= 8000
            assert value(f, "ember_tensors_held", device="0", spec="cpu") >= 2
            assert value(f, "ember_memory_budget_bytes", device="0", spec="cpu") == 1 << 30
            assert 0 < value(f, "ember_memory_budget_used_ratio", device="0", spec="cpu") < 1e-3
            assert 0 < value(f, "ember_session_memory_budget_used_ratio") < 1e-3
            assert value(f, "ember_memory_refusals", device="0", spec="cpu") == 0
            assert value(f, "ember_op_duration_seconds", "ember_op_duration_seconds_count", kind="op") == 100  # the histogram's count
            assert value(f, "ember_uptime_seconds") > 0
            return f
        families = eventually(check)
        ops = families["ember_op_duration_seconds"]
        assert ops.type == "histogram"
        buckets = [s for s in ops.samples if s.name.endswith("_bucket") and s.labels["kind"] == "op"]
        counts = [s.value for s in buckets]
        assert counts == sorted(counts) and buckets[-1].labels["le"] == "+Inf" and counts[-1] == 100
        d.close()

        def closed():
            f = scrape(url)
            assert value(f, "ember_sessions_closed", reason="client_closed") == 1
            assert value(f, "ember_sessions_open", device="0", spec="cpu") == 0
            assert value(f, "ember_memory_held_bytes", device="0", spec="cpu") == 0
            assert value(f, "ember_received_bytes", transport="websocket") > 8000  # kept after the close
        eventually(closed)
    finally:
        p.terminate()
        p.wait(15)


def test_metric_names_follow_prometheus_conventions():
    srv = Server(["cpu", "cpu"])  # two devices of one spec: their samples must stay apart
    srv.listen_websocket("127.0.0.1", 0)
    srv.listen_metrics("127.0.0.1", 0)
    srv.start_in_thread()
    try:
        d = ember.connect(srv.addresses[0])
        float(xp.sum(xp.ones(4, device=d)))
        d.close()
        fams = scrape(srv.metrics_address)
    finally:
        srv.close()
    assert len(fams) >= 25
    samples = [(s.name, tuple(sorted(s.labels.items()))) for f in fams.values() for s in f.samples]
    assert len(samples) == len(set(samples)), "duplicate samples"
    assert value(fams, "ember_memory_held_bytes", device="1", spec="cpu") == 0
    for name, fam in fams.items():
        assert re.fullmatch(r"ember_[a-z_]+", name), name
        if fam.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in fam.samples), name
        if "seconds" in name or "duration" in name or "wait" in name:
            assert name.endswith("_seconds"), name
        if "bytes" in name:
            assert name.endswith("_bytes"), name


def test_metrics_bind_failure_is_a_bind_error():
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    srv = Server(["cpu"])
    srv.listen_metrics("127.0.0.1", s.getsockname()[1])
    try:
        with pytest.raises(BindError) as ei:
            srv.start_in_thread()
        assert ei.value.cause == "address_in_use" and "--metrics" in (ei.value.hint or "")
    finally:
        s.close()
        srv.close()


def test_op_labels_are_only_names_the_peer_offers():
    torch = pytest.importorskip("torch")  # noqa: F841 - a torch:cpu device vets ATen names
    srv = Server(["cpu", "torch:cpu"])
    srv.register_op("my_op", lambda xp, x: x)
    label = srv.figures.label
    assert label("add") == "add" and label("linalg.inv") == "linalg.inv" and label("my_op") == "my_op"
    assert label("aten.add.Tensor") == "aten.add.Tensor"  # a vetted ATen overload
    for hostile in ("__import__", "aten.from_file.default", "aten.nope.x", "x" * 10_000, ["add"], None, 7):
        assert label(hostile) == "other"
    for i in range(10_000):  # a flood of distinct names does not grow what is remembered without bound
        label(f"aten.fake{i}.default")
    assert len(srv.figures._vetted) <= 8192
