"""Secret keys: an Ember peer *is* its key.

File format: the 32-byte ed25519 secret key written as 64 lowercase hex
characters and a newline (text, so it survives copy-paste and shows up
readably in ``cat``). :func:`load_key` also accepts a file holding exactly the
32 raw bytes. Files are created with mode 0600 in a 0700 directory and never
overwritten unless asked.

The default key lives at ``$EMBER_KEY`` if set, else
``$XDG_CONFIG_HOME/ember/secret.key`` (``~/.config/ember/secret.key``;
``%APPDATA%\\ember\\secret.key`` on Windows).
"""

from __future__ import annotations

import os
import re
import stat
import sys
from contextlib import suppress
from pathlib import Path
from typing import Any

import iroh

from ember.errors import BindError

__all__ = ["generate_key", "load_key", "default_key_path", "peer_id_of", "load_or_create_key",
           "key_file_problems", "new_key", "claim_key"]

_GEN_HINT = "create a new key with `ember keygen PATH` (or `--force` to replace it) and pass --key PATH"


def default_key_path() -> Path:
    """Per-user default key path (``EMBER_KEY`` overrides)."""
    env = os.environ.get("EMBER_KEY")
    if env:
        return Path(env).expanduser()
    if sys.platform.startswith("win") and os.environ.get("APPDATA"):
        return Path(os.environ["APPDATA"]) / "ember" / "secret.key"
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base).expanduser() / "ember" / "secret.key"


def new_key() -> bytes:
    """32 fresh secret-key bytes."""
    return bytes(iroh.SecretKey.generate().to_bytes())


def peer_id_of(key: bytes) -> str:
    """The public peer id (64 hex characters) of a secret key."""
    if not isinstance(key, (bytes, bytearray)) or len(key) != 32:
        raise BindError("invalid secret key: expected 32 bytes", cause="invalid_key", hint=_GEN_HINT)
    return str(iroh.SecretKey.from_bytes(bytes(key)).public())


def generate_key(path: str | os.PathLike, force: bool = False) -> bytes:
    """Write a new key to ``path`` (mode 0600); returns the key bytes.

    Raises :class:`FileExistsError` when ``path`` exists and not ``force``.
    """
    p = Path(path).expanduser()
    if p.exists() and not force:
        raise FileExistsError(f"{p} already exists; refusing to overwrite a secret key "
                              "(pass --force to replace it: its peer id will be lost)")
    p.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = new_key()
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(key.hex() + "\n")
            f.flush()
            os.fsync(f.fileno())
        if not force and p.exists():  # raced with another writer
            raise FileExistsError(f"{p} appeared while writing; refusing to overwrite")
        os.replace(tmp, p)
    except BaseException:
        with suppress(OSError):
            os.unlink(tmp)
        raise
    return key


def key_file_problems(path: str | os.PathLike) -> list[str]:
    """Permission problems of a key file (empty when private enough)."""
    if os.name != "posix":
        return []
    st = os.stat(path)
    problems = []
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        problems.append(f"mode {stat.S_IMODE(st.st_mode):04o} lets other users read it")
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        problems.append("it belongs to another user")
    return problems


def load_key(path: str | os.PathLike, *, check_permissions: bool = True) -> bytes:
    """Read and validate a key file; :class:`BindError` (``invalid_key``) if bad."""
    p = Path(path).expanduser()
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise BindError(f"secret key file {p} does not exist", cause="invalid_key",
                        hint=f"create it with `ember keygen {p}`") from None
    except OSError as e:
        raise BindError(f"cannot read secret key file {p}: {e.strerror or e}", cause="invalid_key",
                        hint="check the path and that this user may read it") from None
    text = data.strip()
    if re.fullmatch(rb"[0-9a-fA-F]{64}", text):
        key = bytes.fromhex(text.decode())
    elif len(data) == 32:
        key = data
    else:
        raise BindError(f"{p} does not hold a secret key (expected 64 hex characters)",
                        cause="invalid_key", hint=_GEN_HINT)
    if check_permissions:
        problems = key_file_problems(p)
        if problems:
            raise BindError(f"secret key file {p} is not private: {'; '.join(problems)}",
                            cause="invalid_key", hint=f"run `chmod 600 {p}` (as its owner)")
    try:
        iroh.SecretKey.from_bytes(key)
    except Exception:  # noqa: BLE001
        raise BindError(f"{p} does not hold a valid secret key", cause="invalid_key",
                        hint=_GEN_HINT) from None
    return key


def load_or_create_key(path: str | os.PathLike | None = None) -> tuple[bytes, Path, bool]:
    """(key, path, created): reuse the key at ``path`` (default path if None)
    or create it there."""
    p = Path(path).expanduser() if path is not None else default_key_path()
    if p.exists():
        return load_key(p), p, False
    try:
        return generate_key(p), p, True
    except FileExistsError:  # created concurrently
        return load_key(p), p, False
    except OSError as e:
        raise BindError(f"cannot create secret key file {p}: {e.strerror or e}",
                        cause="invalid_key",
                        hint="pass --key PATH to a writable location, or set EMBER_KEY") from None


def claim_key(path: str | os.PathLike) -> Any:
    """Hold ``path`` as the key of this process's peer: an open handle with an exclusive lock (``flock``) beside
    the key (``<path>.lock``), kept while the returned object lives; None when another running peer holds it.
    Two peers with one key are one address to every client (iroh keeps one connection per peer id): the second
    would silently receive nothing. Where locks are not available (Windows), always a claim."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        return True
    lock = Path(path).expanduser()
    lock = lock.with_name(lock.name + ".lock")
    try:
        f = open(lock, "a")  # noqa: SIM115 - held for the peer's lifetime
    except OSError:
        return True  # (a read-only key directory: nothing to lock, as before)
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        return None
    return f
