"""Secure defaults: non-loopback WebSocket needs a token, secrets from files, the iroh allowlist."""

from __future__ import annotations

import subprocess
import sys

import pytest

import ember
import ember.array_api as xp
from ember.cli.main import build_parser
from ember.cli.serve import build_server
from ember.errors import AuthorizationError, EmberError
from ember.server import Server, allowlist_authorizer

from test_core_cli import ENV, start_serve


def serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ember.cli.main", "serve", *args], capture_output=True, text=True,
                          env=ENV, timeout=60)


def test_websocket_on_a_public_address_without_a_token_is_refused_and_says_why():
    r = serve("--websocket", "0.0.0.0:0", "--no-iroh")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "refusing to serve WebSocket on 0.0.0.0:0 without a token" in r.stderr
    assert "--token-file" in r.stderr and "--insecure" in r.stderr


def test_insecure_and_tokens_lift_the_refusal_without_binding():
    parse = build_parser().parse_args
    for extra in (["--insecure"], ["--token", "s3cret"]):
        srv = build_server(parse(["serve", "--websocket", "0.0.0.0:0", "--no-iroh", *extra]))
        assert [lst.host for lst in srv.listeners] == ["0.0.0.0"]  # configured, not started
    with pytest.raises(EmberError, match="without an authorizer"):
        Server(["cpu"]).listen_websocket("0.0.0.0", 0)
    Server(["cpu"]).listen_websocket("0.0.0.0", 0, insecure=True)
    Server(["cpu"]).listen_websocket("::1", 0)  # loopback needs nothing


def test_token_file_keeps_the_secret_out_of_the_command_line(tmp_path):
    secret = "correct-horse-battery-staple"
    f = tmp_path / "token"
    f.write_text(secret + "\n")
    f.chmod(0o600)
    p, addr = start_serve("--websocket", "127.0.0.1:0", "--no-iroh", "--token-file", str(f))
    try:
        with open(f"/proc/{p.pid}/cmdline", "rb") as c:
            assert secret.encode() not in c.read()
        with pytest.raises(AuthorizationError, match="missing credential"):
            ember.connect(addr)
        d = ember.connect(addr, credential=secret)
        assert float(xp.sum(xp.ones(3, device=d))) == 3
        d.close()
    finally:
        p.kill()
        p.wait(10)


def test_unreadable_or_empty_token_file_is_a_clear_error(tmp_path):
    r = serve("--websocket", "127.0.0.1:0", "--no-iroh", "--token-file", str(tmp_path / "missing"))
    assert r.returncode == 2 and "cannot read the token file" in r.stderr and "hint:" in r.stderr
    empty = tmp_path / "empty"
    empty.write_text("\n")
    r = serve("--websocket", "127.0.0.1:0", "--no-iroh", "--token-file", str(empty))
    assert r.returncode == 2 and "is empty" in r.stderr


@pytest.mark.timeout(60)
def test_iroh_allowlist_admits_listed_peers_and_tells_others_why():
    from ember.client.io import run_sync
    from ember.transport.iroh import client_peer_id
    me = run_sync(client_peer_id(), 20, "client id")  # this process's authenticated iroh identity
    stranger = "ab" * 32
    allowing = Server(["cpu"], authorizer=allowlist_authorizer([me]))
    allowing.listen_iroh(offline=True, bind=["127.0.0.1:0", "[::1]:0"])
    refusing = Server(["cpu"], authorizer=allowlist_authorizer([stranger]))
    refusing.listen_iroh(offline=True, bind=["127.0.0.1:0", "[::1]:0"])
    try:
        d = ember.connect(allowing.start_in_thread()[0])
        assert float(xp.sum(xp.arange(5, device=d))) == 10
        d.close()
        with pytest.raises(AuthorizationError, match=r"not on this peer's allowlist \(1 peer allowed"):
            ember.connect(refusing.start_in_thread()[0])
    finally:
        allowing.close()
        refusing.close()


def test_allowlist_rejects_malformed_ids_and_reads_files(tmp_path):
    with pytest.raises(EmberError, match="not an iroh peer id"):
        allowlist_authorizer(["not-a-peer"])
    good = "cd" * 32
    f = tmp_path / "allow"
    f.write_text(f"# the team\n{good}  # alice\n\n")
    parse = build_parser().parse_args
    srv = build_server(parse(["serve", "--websocket", "127.0.0.1:0", "--no-iroh", "--allow-file", str(f)]))
    assert srv.allowlist == [good]  # type: ignore[attr-defined]
    assert srv.authorize(good, 0, b"") is None
    assert "allowlist" in srv.authorize("ef" * 32, 0, b"")
    assert srv.authorize(None, 0, b"") is None  # WebSocket clients: the token decides (none here)
    r = serve("--websocket", "127.0.0.1:0", "--no-iroh", "--allow", "nope")
    assert r.returncode == 2 and "not an iroh peer id" in r.stderr
