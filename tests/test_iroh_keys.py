"""Secret keys: file format, permissions, stable identities."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import pytest

from ember.errors import BindError
from ember.keys import (default_key_path, generate_key, load_key, load_or_create_key, new_key,
                        peer_id_of)
from ember.transport import iroh as T

posix_only = pytest.mark.skipif(os.name != "posix", reason="POSIX permissions")


@posix_only
def test_keygen_writes_a_private_hex_key(tmp_path: Path) -> None:
    p = tmp_path / "sub" / "k.key"
    key = generate_key(p)
    assert len(key) == 32
    assert stat.S_IMODE(p.stat().st_mode) == 0o600
    assert stat.S_IMODE(p.parent.stat().st_mode) & 0o077 == 0
    text = p.read_text()
    assert text == key.hex() + "\n"
    assert load_key(p) == key
    assert not list(p.parent.glob(".*tmp"))  # no temp file left behind


def test_keygen_refuses_to_overwrite_without_force(tmp_path: Path) -> None:
    p = tmp_path / "k.key"
    first = generate_key(p)
    with pytest.raises(FileExistsError, match="--force"):
        generate_key(p)
    assert load_key(p) == first
    second = generate_key(p, force=True)
    assert second != first and load_key(p) == second


def test_peer_id_is_stable_and_64_hex(tmp_path: Path) -> None:
    key = new_key()
    pid = peer_id_of(key)
    assert len(pid) == 64 and int(pid, 16) >= 0
    assert peer_id_of(key) == pid
    assert peer_id_of(new_key()) != pid
    with pytest.raises(BindError):
        peer_id_of(b"short")


@pytest.mark.parametrize("content", [b"", b"garbage\n", b"zz" * 32, b"ab" * 31, b"x" * 31, b"x" * 64 + b"yy"])
def test_garbage_key_file(tmp_path: Path, content: bytes) -> None:
    p = tmp_path / "bad.key"
    p.write_bytes(content)
    p.chmod(0o600)
    with pytest.raises(BindError) as ei:
        load_key(p)
    assert ei.value.cause == "invalid_key"
    assert "keygen" in (ei.value.hint or "")


def test_raw_32_byte_key_file_is_accepted(tmp_path: Path) -> None:
    p = tmp_path / "raw.key"
    key = new_key()
    p.write_bytes(key)
    p.chmod(0o600)
    assert load_key(p) == key


def test_missing_and_unreadable_key_files(tmp_path: Path) -> None:
    with pytest.raises(BindError) as ei:
        load_key(tmp_path / "nope.key")
    assert ei.value.cause == "invalid_key" and "ember keygen" in (ei.value.hint or "")
    with pytest.raises(BindError) as ei:
        load_key(tmp_path)  # a directory
    assert ei.value.cause == "invalid_key"


@posix_only
def test_key_readable_by_others_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "k.key"
    generate_key(p)
    p.chmod(0o644)
    with pytest.raises(BindError) as ei:
        load_key(p)
    assert ei.value.cause == "invalid_key" and "chmod 600" in (ei.value.hint or "")
    assert len(load_key(p, check_permissions=False)) == 32


def test_default_key_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("EMBER_KEY", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    assert default_key_path() == tmp_path / "cfg" / "ember" / "secret.key"
    monkeypatch.setenv("EMBER_KEY", str(tmp_path / "mine.key"))
    assert default_key_path() == tmp_path / "mine.key"


def test_load_or_create_reuses(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("EMBER_KEY", str(tmp_path / "auto" / "secret.key"))
    k1, p1, created1 = load_or_create_key()
    k2, p2, created2 = load_or_create_key()
    assert (created1, created2) == (True, False)
    assert k1 == k2 and p1 == p2 == tmp_path / "auto" / "secret.key"


@pytest.mark.timeout(30)
def test_listener_identity_comes_from_the_key(tmp_path: Path) -> None:
    p = tmp_path / "srv.key"
    key = generate_key(p)

    async def serve_once() -> str:
        lst = T.IrohListener(key=load_key(p), offline=True, bind=["127.0.0.1:0", "[::1]:0"])
        await lst.start(lambda c: c.close())
        pid = lst.peer_id
        await lst.stop()
        return pid

    first = asyncio.run(serve_once())
    second = asyncio.run(serve_once())
    assert first == second == peer_id_of(key)
