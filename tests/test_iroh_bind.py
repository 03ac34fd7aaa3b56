"""Binding never panics, never hangs: every failure is a typed BindError."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import iroh
import pytest

from ember.errors import BIND_CAUSES, BindError
from ember.transport import iroh as T
from ember.transport.iroh_endpoint import (bind_endpoint, classify_bind_error, parse_bind_address,
                                           parse_relay)


def bind(**kw: Any) -> Any:
    async def go() -> Any:
        ep = await bind_endpoint(**kw)
        socks = ep.bound_sockets()
        await ep.close()
        return socks
    return asyncio.run(asyncio.wait_for(go(), 30))


def bind_error(**kw: Any) -> tuple[BindError, float]:
    t = time.monotonic()
    with pytest.raises(BindError) as ei:
        bind(**kw)
    assert ei.value.cause in BIND_CAUSES
    assert ei.value.hint
    return ei.value, time.monotonic() - t


@pytest.mark.timeout(30)
def test_port_in_use(capfd: pytest.CaptureFixture[str]) -> None:
    taken = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    taken.bind(("127.0.0.1", 0))
    try:
        addr = f"127.0.0.1:{taken.getsockname()[1]}"
        e, took = bind_error(offline=True, bind=[addr, "[::1]:0"], retries=2, backoff=0.05)
        assert e.cause == "address_in_use" and e.transient
        assert "Address already in use" in e.message and addr in e.message
        assert "port" in e.hint
        assert 0.15 <= took < 5  # retried twice with backoff 0.05, 0.1
    finally:
        taken.close()
    assert "panicked" not in capfd.readouterr().err


@pytest.mark.timeout(30)
def test_port_in_use_through_the_listener() -> None:
    taken = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    taken.bind(("127.0.0.1", 0))

    async def go() -> None:
        lst = T.IrohListener(offline=True, bind=[f"127.0.0.1:{taken.getsockname()[1]}"], retries=0)
        with pytest.raises(BindError) as ei:
            await lst.start(lambda c: asyncio.sleep(0))
        assert ei.value.cause == "address_in_use"
    try:
        asyncio.run(asyncio.wait_for(go(), 20))
    finally:
        taken.close()


@pytest.mark.timeout(30)
def test_address_not_on_this_host_fails_at_once() -> None:
    e, took = bind_error(offline=True, bind=["203.0.113.7:0"])  # TEST-NET-3
    assert e.cause == "address_not_available" and not e.transient
    assert "Cannot assign requested address" in e.message
    assert took < 3


@pytest.mark.timeout(30)
@pytest.mark.parametrize("bad", ["not an address", "localhost:0", "127.0.0.1", "127.0.0.1:99999",
                                 "[::1:0", "::1:0", "300.1.1.1:0", ""])
def test_malformed_bind_address(bad: str, capfd: pytest.CaptureFixture[str]) -> None:
    e, took = bind_error(offline=True, bind=[bad])
    assert e.cause == "invalid_address" and not e.transient
    assert "127.0.0.1:0" in e.hint
    assert took < 1
    assert "panicked" not in capfd.readouterr().err


@pytest.mark.timeout(30)
def test_two_addresses_of_one_family_are_refused_clearly() -> None:
    e, _ = bind_error(offline=True, bind=["127.0.0.1:0", "127.0.0.2:0"])
    assert e.cause == "invalid_address" and "IPv4" in e.message


@pytest.mark.timeout(30)
@pytest.mark.parametrize("key", [b"short", b"x" * 33, "not bytes"])
def test_invalid_key_material(key: Any) -> None:
    e, took = bind_error(offline=True, bind=["127.0.0.1:0"], key=key)
    assert e.cause == "invalid_key" and "keygen" in e.hint
    assert took < 1


@pytest.mark.timeout(30)
def test_bind_exactly_what_is_asked() -> None:
    socks = bind(offline=True, bind=["127.0.0.1:0", "[::1]:0"])
    assert sorted(s.split(":")[0] for s in socks) == ["127.0.0.1", "["]
    assert all(s.startswith(("127.0.0.1:", "[::1]:")) for s in socks)
    # one family asked: the other is pinned to loopback, never the wildcard
    socks = bind(offline=True, bind=["127.0.0.1:0"])
    assert all(s.startswith(("127.0.0.1:", "[::1]:")) for s in socks), socks


@pytest.mark.timeout(30)
def test_relay_unreachable_is_bounded_and_typed() -> None:
    # a "relay" on a dead loopback port; discovery off: nothing leaves the host
    e, took = bind_error(relay=["http://127.0.0.1:9"], discovery=False, bind=["127.0.0.1:0"],
                         online_timeout=0.5)
    assert e.cause == "relay_unreachable" and e.transient
    assert "--offline" in e.hint and "unreachable" in e.hint
    assert took < 5


@pytest.mark.timeout(30)
def test_offline_never_waits_for_relays() -> None:
    t = time.monotonic()
    bind(offline=True, bind=["127.0.0.1:0"], relay="default")  # offline wins over relay
    assert time.monotonic() - t < 3


def test_parse_helpers() -> None:
    assert str(parse_bind_address("127.0.0.1:7000")) == "127.0.0.1:7000"
    assert str(parse_bind_address("[::1]:0")) == "[::1]:0"
    assert parse_bind_address("[::1]:0").family == 6
    assert parse_relay("default") == "default" and parse_relay("DISABLED") == "disabled"
    assert parse_relay("https://a.example,https://b.example") == ["https://a.example", "https://b.example"]
    for bad in ("ftp://x", "nonsense", ","):
        with pytest.raises(BindError) as ei:
            parse_relay(bad)
        assert ei.value.cause == "invalid_address"


@pytest.mark.parametrize("message, cause, transient", [
    ("Failed to bind sockets\nCaused by:\n    Address already in use (os error 98)", "address_in_use", True),
    ("Failed to bind sockets\nCaused by:\n    Cannot assign requested address (os error 99)",
     "address_not_available", False),
    ("Failed to bind sockets\nCaused by:\n    Address family not supported by protocol (os error 97)",
     "no_udp", False),
    ("Failed to bind sockets\nCaused by:\n    Operation not permitted (os error 1)", "no_udp", False),
    ("Failed to bind sockets\nCaused by:\n    Permission denied (os error 13)", "other", False),
    ("invalid socket address syntax", "invalid_address", False),
    ("something new", "other", False),
])
def test_classification_of_os_errors(message: str, cause: str, transient: bool) -> None:
    e = classify_bind_error(OSError(message), ["127.0.0.1:1"])
    assert (e.cause, e.transient) == (cause, transient)
    assert message.splitlines()[-1].strip() in e.message
    if cause == "other" and "13" in message:
        assert "1024" in e.hint
    if cause == "no_udp":
        assert "websocket" in e.hint.lower()


def test_preset_failure_is_caught_not_panicked(capfd: pytest.CaptureFixture[str]) -> None:
    """Even an error raised inside the preset callback becomes a BindError."""
    from ember.transport.iroh_endpoint import _EmberPreset, _bind_once

    preset = _EmberPreset(offline=True, relay="disabled", binds=["127.0.0.1:0"], key=None,
                          alpns=[b"x"])
    preset.binds = ["bogus"]  # bypass validation on purpose
    with pytest.raises(BindError) as ei:
        asyncio.run(_bind_once(preset, None, 5.0, ["bogus"]))
    assert ei.value.cause == "invalid_address"
    assert "panicked" not in capfd.readouterr().err
    assert isinstance(iroh.RelayMode.disabled(), iroh.RelayMode)
