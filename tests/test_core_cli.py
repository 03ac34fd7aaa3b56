"""`ember serve` / `ember demo` as a user runs them, in real subprocesses."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import ember
import ember.array_api as xp
from ember.errors import SessionLost

ENV = {**os.environ, "EMBER_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def spawn_serve(*args: str, env: dict[str, str] = ENV, stderr: int = subprocess.PIPE) -> subprocess.Popen:
    """Start `ember serve` with ``args`` (its address is read with :func:`address_of`)."""
    return subprocess.Popen([sys.executable, "-m", "ember.cli.main", "serve", *args], stdout=subprocess.PIPE,
                            stderr=stderr, text=True, env=env)


def address_of(p: subprocess.Popen, pattern: str = r"listening on (ws://\S+)", timeout: float = 30) -> str:
    """Wait for the address line of a spawned `ember serve` (the readiness signal; ``pattern``'s group)."""
    assert p.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if not line:
            break
        m = re.search(pattern, line)
        if m:
            return m.group(1)
    p.kill()
    raise AssertionError(f"ember serve printed no address; stderr: {p.stderr.read() if p.stderr else ''}")


def start_serve(*args: str, pattern: str = r"listening on (ws://\S+)") -> tuple[subprocess.Popen, str]:
    """Start `ember serve` and wait for its address."""
    p = spawn_serve(*args)
    return p, address_of(p, pattern)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serve_prints_address_and_exits_zero_on_a_signal(sig):
    p, addr = start_serve("--websocket", "127.0.0.1:0", "--device", "cpu")
    try:
        d = ember.connect(addr)
        assert float(xp.sum(xp.arange(5, device=d))) == 10
        d.close()
        p.send_signal(sig)
        assert p.wait(15) == 0
    finally:
        p.kill()


@pytest.mark.timeout(60)
def test_read_blocked_on_a_killed_server_raises_within_seconds():
    p, addr = start_serve("--websocket", "127.0.0.1:0")
    try:
        d = ember.connect(addr, heartbeat_timeout=3.0)
        x = xp.asarray(np.ones((500, 500)), device=d)
        for _ in range(200):
            x = x @ x * 1e-3  # keeps the peer busy so the read is really blocked
        t0 = time.monotonic()
        os.kill(p.pid, signal.SIGKILL)
        with pytest.raises(SessionLost):
            x.to_numpy()
        assert time.monotonic() - t0 < 8
    finally:
        p.kill()


@pytest.mark.timeout(120)
def test_demo_runs_and_checks_against_numpy():
    r = subprocess.run([sys.executable, "-m", "ember.cli.main", "demo"], capture_output=True, text=True,
                       env=ENV, timeout=110)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK" in r.stdout and "ops sent" in r.stdout and "bytes received" in r.stdout


def test_serve_bind_error_is_clear_and_has_no_traceback():
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    port = s.getsockname()[1]
    try:
        r = subprocess.run([sys.executable, "-m", "ember.cli.main", "serve", "--websocket", f"127.0.0.1:{port}"],
                           capture_output=True, text=True, env=ENV, timeout=30)
    finally:
        s.close()
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    assert "hint:" in r.stderr and str(port) in r.stderr
