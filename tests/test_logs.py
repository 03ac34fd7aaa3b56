"""Logs a person can read: one line per session opened, closed or refused; --log-level, --log-json."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time

import numpy as np
import pytest

import ember
import ember.array_api as xp
from ember.errors import AuthorizationError
from ember.server import Server

from test_core_cli import ENV, start_serve
from test_core_sessions import wait_until


def test_session_lines_say_who_what_how_long_and_why(caplog):
    caplog.set_level(logging.INFO, logger="ember")
    srv = Server(["cpu"], authorizer=lambda p, d, c: c == b"ok" or "wrong credential")
    srv.listen_websocket("127.0.0.1", 0)
    srv.start_in_thread()
    try:
        d = ember.connect(srv.addresses[0], credential="ok")
        x = xp.asarray(np.ones(16), device=d)
        for _ in range(5):  # a recurring group: graph caching replays it
            y = x
            for _ in range(20):
                y = y * 1.0 + 0.0
            float(xp.sum(y))
        d.close()
        with pytest.raises(AuthorizationError):
            ember.connect(srv.addresses[0], credential="no")

        def lines():
            return [r for r in caplog.records if r.name == "ember.server.sessions"]
        assert wait_until(lambda: len(lines()) == 3)
    finally:
        srv.close()
    by_event = {r.ember["event"]: r for r in lines()}  # the close may be logged after the refusal
    opened, closed, refused = (by_event[e].getMessage() for e in ("SessionOpened", "SessionClosed", "SessionRefused"))
    sid = opened.split()[1]
    assert opened == f"session {sid} opened: websocket {opened.split('websocket ')[1].split(',')[0]}, device 0 (cpu)"
    assert closed.startswith(f"session {sid} ended after ") and "closed by the client" in closed
    assert "device 0 (cpu)" in closed and "websocket 127.0.0.1:" in closed
    assert " ops in " in closed and (" B in, " in closed or " kB in, " in closed)
    assert "graph caching saved" in closed and "replays" in closed
    assert refused.startswith("session refused (unauthorized) for 127.0.0.1:") and refused.endswith("wrong credential")
    rec = by_event["SessionClosed"].ember  # the fields, for --log-json
    assert rec["event"] == "SessionClosed" and rec["reason"] == "client_closed" and rec["graph_hits"] >= 3


def test_a_lost_connection_and_a_stopping_peer_are_told_apart(caplog):
    caplog.set_level(logging.INFO, logger="ember.server.sessions")
    srv = Server(["cpu"])
    srv.listen_websocket("127.0.0.1", 0)
    srv.start_in_thread()
    d = ember.connect(srv.addresses[0])
    float(xp.sum(xp.ones(3, device=d)))
    srv.close()
    msgs = [r.getMessage() for r in caplog.records if r.name == "ember.server.sessions"]
    assert any("ended after" in m and "the peer shut down" in m for m in msgs), msgs


def _one_session_logged(*flags: str) -> str:
    """What `ember serve FLAGS` writes to stderr around one short session the client closes."""
    p, addr = start_serve("--no-iroh", "--websocket", "127.0.0.1:0", *flags)
    try:
        d = ember.connect(addr)
        float(xp.sum(xp.ones(3, device=d)))
        d.close()
        time.sleep(0.2)  # the peer logs the close (the client closed it) before it is stopped
    finally:
        p.terminate()
        p.wait(15)
    assert p.stderr is not None
    return p.stderr.read()


@pytest.mark.timeout(60)
def test_serve_log_json_writes_one_object_per_line():
    records = [json.loads(line) for line in _one_session_logged("--log-json").splitlines() if line.startswith("{")]
    by_event = {r.get("event"): r for r in records}
    assert by_event["SessionOpened"]["logger"] == "ember.server.sessions" and by_event["SessionOpened"]["level"] == "info"
    closed = by_event["SessionClosed"]
    assert closed["reason"] == "client_closed" and closed["bytes_in"] > 0 and closed["duration_s"] > 0
    assert closed["message"].startswith("session ") and "ended after" in closed["message"]


@pytest.mark.timeout(60)
def test_serve_log_level_warning_keeps_session_lines_out():
    assert "session" not in _one_session_logged("--log-level", "warning")


def test_log_level_is_checked():
    r = subprocess.run([sys.executable, "-m", "ember.cli.main", "serve", "--log-level", "loud"], capture_output=True,
                       text=True, env=ENV, timeout=30)
    assert r.returncode == 2 and "invalid choice: 'loud'" in r.stderr
