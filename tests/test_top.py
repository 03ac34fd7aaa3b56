"""`ember top` as a person uses it: in a terminal (tmux, read with capture-pane), refreshing, q quits."""

from __future__ import annotations

import os
import pty
import select
import shutil
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

import ember
import ember.array_api as xp

from test_core_cli import ENV, start_serve

pytestmark = pytest.mark.timeout(90)


def screen_until(session: str, pred, timeout: float = 20.0) -> str:
    """The tmux pane's text once ``pred(text)`` holds (polled: the screen is the readiness signal)."""
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        text = subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True).stdout
        if pred(text):
            return text
        time.sleep(0.1)
    raise AssertionError(f"the screen never matched; last screen:\n{text}")


@pytest.fixture
def peer():
    p, addr = start_serve("--no-iroh", "--websocket", "127.0.0.1:0", "--admin-token", "t0p")
    yield addr
    p.terminate()
    p.wait(15)


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (the pty test below still runs)")
def test_top_in_tmux_shows_live_sessions_errors_and_quits_on_q(peer):
    d = ember.connect(peer)
    x = xp.asarray(np.ones((32, 32)), device=d)
    bad = ember.custom_op("no_such_op", x, outputs=[((32, 32), xp.float64)])
    with pytest.raises(ember.errors.RemoteExecutionError):
        bad.to_numpy()
    name = f"ember-top-{uuid.uuid4().hex[:8]}"
    env = " ".join(f"{k}={v}" for k, v in {"PYTHONPATH": os.environ.get("PYTHONPATH", ""),
                                              "EMBER_OFFLINE": "1"}.items())
    subprocess.run(["tmux", "new-session", "-d", "-s", name, "-x", "170", "-y", "45",
                    f"env -u COLUMNS -u LINES {env} {sys.executable} -m ember.cli.main top {peer} --token t0p "
                    "--interval 0.3"], check=True)
    try:
        screen = screen_until(name, lambda s: "sessions" in s and "no_such_op" in s)
        assert "ember top" in screen and peer in screen and "devices" in screen and "cpu" in screen
        assert "8.2 kB" in screen  # the 32x32 float64 array the session holds
        assert "recent errors" in screen and "RemoteExecutionError" in screen
        me = d.stats(peer=True)["peer"]["session"]["id"][:8]
        assert me in screen
        # live: work done now shows up in the next frames (ops/s and the op count move)
        for _ in range(20):
            x = x * 1.0 + 0.5
        float(xp.sum(x))
        ops_after = d.stats()["peer"]["session"]["ops"]  # (the STATS request itself counts once it ran)

        def shows_new_count(text: str) -> bool:
            row = next((line for line in text.splitlines() if line.startswith(me)), "")
            return any(tok.isdigit() and ops_after <= int(tok) <= ops_after + 3 for tok in row.split())
        screen_until(name, shows_new_count)
        subprocess.run(["tmux", "send-keys", "-t", name, "q"], check=True)
        deadline = time.monotonic() + 10
        while subprocess.run(["tmux", "has-session", "-t", name], capture_output=True).returncode == 0:
            assert time.monotonic() < deadline, "ember top did not quit on q"
            time.sleep(0.1)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", name], capture_output=True)
        d.close()


def test_top_on_a_pty_quits_on_q_and_restores_the_terminal(peer):
    pid, fd = pty.fork()
    if pid == 0:  # the child: ember top on the pty's terminal
        os.execvpe(sys.executable, [sys.executable, "-m", "ember.cli.main", "top", peer, "--token", "t0p",
                                    "--interval", "0.2"], {**ENV, "COLUMNS": "150", "LINES": "40", "TERM": "xterm"})
    out = b""
    deadline = time.monotonic() + 30
    try:
        while b"sessions" not in out:
            assert time.monotonic() < deadline, out.decode(errors="replace")
            if select.select([fd], [], [], 0.5)[0]:
                out += os.read(fd, 65536)
        os.write(fd, b"q")
        status = None
        while status is None:
            assert time.monotonic() < deadline, "ember top did not quit on q"
            if select.select([fd], [], [], 0.2)[0]:
                try:
                    os.read(fd, 65536)
                except OSError:
                    pass
            done, st = os.waitpid(pid, os.WNOHANG)
            if done:
                status = st
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        try:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(fd)


def test_top_with_a_wrong_token_says_why_and_exits(peer):
    r = subprocess.run([sys.executable, "-m", "ember.cli.main", "top", peer, "--token", "nope"], capture_output=True,
                       text=True, env=ENV, timeout=30, stdin=subprocess.DEVNULL)
    assert r.returncode == 2 and "wrong admin token" in r.stderr and "Traceback" not in r.stderr


def test_a_frame_shows_recent_transfers_and_rates():
    from rich.console import Console

    from ember.cli.top import render
    from ember.server import Server
    srv = Server(["cpu", "cpu"], admin_tokens=["a"])
    srv.listen_websocket("127.0.0.1", 0)
    srv.start_in_thread()
    try:
        d0, d1 = ember.connect(srv.addresses[0]), ember.connect(srv.addresses[0], device=1)
        admin = ember.connect(srv.addresses[0], admin=True, credential="a")
        first = admin.peer_stats()
        y = xp.asarray(np.ones(4096), device=d0).to_device(d1)
        assert float(xp.sum(y)) == 4096
        deadline = time.monotonic() + 5
        while not (snap := admin.peer_stats())["recent"]["transfers"][-1:] or \
                snap["recent"]["transfers"][-1]["phase"] != "completed":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        console = Console(record=True, width=170)
        console.print(render(snap, first, srv.addresses[0], width=170))
        text = console.export_text()
        assert "recent transfers" in text and "device" in text and "completed" in text and "32.8 kB" in text
        row = next(line for line in text.splitlines() if line.startswith(snap["sessions"][0]["id"][:8]))
        assert "B/s" in row and "…" not in row.split()[4]  # rates from two frames
        narrow = Console(record=True, width=90)
        narrow.print(render(snap, first, srv.addresses[0], width=90))
        small = narrow.export_text()
        assert "in/s" not in small and "ops/s" in small
        d0.close(), d1.close(), admin.close()
    finally:
        srv.close()
