"""``ember doctor``: bounded checks with verdicts and hints."""

from __future__ import annotations

import io
import os
import socket
import time
from pathlib import Path

import pytest

from ember.doctor import Check, exit_status, print_checks, run_checks
from ember.keys import generate_key, peer_id_of

LOOPBACK = ["127.0.0.1:0", "[::1]:0"]


def by_name(checks: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in checks}


@pytest.mark.timeout(60)
def test_offline_doctor_passes(tmp_path: Path) -> None:
    key = generate_key(tmp_path / "k.key")
    t = time.monotonic()
    checks = run_checks(key_path=tmp_path / "k.key", offline=True, bind=LOOPBACK)
    assert time.monotonic() - t < 20
    c = by_name(checks)
    assert list(c) == ["UDP sockets", "secret key", "endpoint", "relays", "discovery", "self-connection"]
    assert c["secret key"].ok and peer_id_of(key) in c["secret key"].detail
    assert c["endpoint"].ok and "offline" in c["endpoint"].detail
    assert c["relays"].status == "skip" and c["discovery"].status == "skip"
    assert c["self-connection"].ok, c["self-connection"].detail
    out = io.StringIO()
    assert print_checks(checks, out) == 0 == exit_status(checks)
    assert "serving is possible" in out.getvalue()


@pytest.mark.timeout(60)
def test_missing_explicit_key_fails_with_a_hint(tmp_path: Path) -> None:
    checks = run_checks(key_path=tmp_path / "nope.key", offline=True, bind=LOOPBACK)
    c = by_name(checks)["secret key"]
    assert not c.ok and "ember keygen" in (c.hint or "")
    assert exit_status(checks) == 1
    out = io.StringIO()
    print_checks(checks, out)
    assert "FAIL" in out.getvalue() and "hint: create it" in out.getvalue()


@pytest.mark.timeout(60)
@pytest.mark.skipif(os.name != "posix", reason="POSIX permissions")
def test_key_readable_by_others_fails(tmp_path: Path) -> None:
    p = tmp_path / "k.key"
    generate_key(p)
    p.chmod(0o644)
    c = by_name(run_checks(key_path=p, offline=True, bind=LOOPBACK))["secret key"]
    assert not c.ok and "chmod 600" in (c.hint or "")


@pytest.mark.timeout(60)
def test_default_key_missing_is_fine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBER_KEY", str(tmp_path / "later.key"))
    c = by_name(run_checks(offline=True, bind=LOOPBACK))["secret key"]
    assert c.ok and "will create" in c.detail
    assert not (tmp_path / "later.key").exists()  # the doctor only looks


@pytest.mark.timeout(60)
def test_bind_in_use_fails_endpoint_and_udp(tmp_path: Path) -> None:
    taken = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    taken.bind(("127.0.0.1", 0))
    try:
        where = f"127.0.0.1:{taken.getsockname()[1]}"
        checks = run_checks(key_path=None, offline=True, bind=[where])
    finally:
        taken.close()
    c = by_name(checks)
    assert not c["UDP sockets"].ok and where in c["UDP sockets"].detail
    assert exit_status(checks) == 1


@pytest.mark.timeout(60)
def test_unreachable_relay_is_reported_not_hung(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A relay on a dead loopback port; discovery resolution is stubbed (no network in tests)."""
    import ember.doctor as d
    import ember.transport.iroh_endpoint as ie

    real_bind = ie.bind_endpoint

    async def no_discovery(**kw: object) -> object:
        kw["discovery"] = False
        return await real_bind(**kw)  # type: ignore[arg-type]
    monkeypatch.setattr(ie, "bind_endpoint", no_discovery)
    monkeypatch.setattr(d, "_resolve_bounded", lambda timeout: None)
    t = time.monotonic()
    checks = run_checks(relay="http://127.0.0.1:9", bind=LOOPBACK, timeout=0.5)
    assert time.monotonic() - t < 20
    c = by_name(checks)
    assert not c["relays"].ok and "--offline" in (c["relays"].hint or "")
    assert c["discovery"].status == "warn" and c["discovery"].ok
    assert exit_status(checks) == 1
