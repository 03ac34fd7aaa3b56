"""Authorizers: who may open a session on this peer.

An authorizer is ``fn(peer_id, device_index, credential)``: ``peer_id`` is the
client's authenticated iroh id (64 hex characters), or None over WebSocket
(which authenticates nobody); it returns True/None to accept, False or a
reason string to refuse (or raises ``AuthorizationError(reason)``). The reason
reaches the client as ``AuthorizationError``.
"""

from __future__ import annotations

import hmac
import os
import re
from typing import Callable, Iterable

from ...errors import EmberError

Authorizer = Callable[[str | None, int, bytes], "bool | str | None"]

_PEER_ID = re.compile(r"[0-9a-f]{64}")


def peer_id(text: str, what: str = "") -> str:
    """``text`` as a normalised iroh peer id (64 lowercase hex characters); EmberError naming ``what``
    (e.g. ``--admin-peer``) otherwise."""
    p = text.strip().lower()
    if not _PEER_ID.fullmatch(p):
        raise EmberError(f"{what + ' ' if what else ''}{p[:70]!r} is not an iroh peer id",
                         hint="a peer id is 64 hex characters; `ember keygen` prints one, `ember serve` "
                              "prints its own as `iroh peer-id`")
    return p


def token_authorizer(*tokens: bytes) -> Authorizer:
    """Accept sessions whose credential equals one of ``tokens`` (constant-time compare)."""

    def check(peer_id: str | None, device: int, credential: bytes) -> bool | str:
        if any(hmac.compare_digest(credential, t) for t in tokens):
            return True
        return "missing credential" if not credential else "wrong credential"

    return check


def allowlist_authorizer(peer_ids: Iterable[str]) -> Authorizer:
    """Accept iroh clients whose authenticated peer id is listed; leave WebSocket clients to other checks.

    Raises EmberError for an id that is not 64 hex characters (a typo must not silently
    lock everyone out, or let nobody in)."""
    allowed = {peer_id(p) for p in peer_ids}

    def check(peer_id: str | None, device: int, credential: bytes) -> bool | str:
        if peer_id is None or peer_id.lower() in allowed:
            return True
        return (f"peer {peer_id[:16]}… is not on this peer's allowlist "
                f"({len(allowed)} peer{'s' if len(allowed) != 1 else ''} allowed: --allow / --allow-file)")

    return check


def identity_authorizer(*peer_ids: str) -> Authorizer:
    """Accept only iroh clients whose authenticated peer id is one of ``peer_ids``; refuse every
    client without one (WebSocket, TCP): a leased peer (``ember.pool``) admits its leaseholder only."""
    allowed = {peer_id(p) for p in peer_ids}
    if not allowed:
        raise EmberError("identity_authorizer needs at least one peer id")

    def check(peer_id: str | None, device: int, credential: bytes) -> bool | str:
        if peer_id is None:
            return "this peer admits only its leaseholder's iroh identity: connect over iroh"
        if peer_id.lower() in allowed:
            return True
        return f"peer {peer_id[:16]}… is not this peer's leaseholder"

    return check


def all_of(*authorizers: Authorizer | None) -> Authorizer | None:
    """An authorizer that accepts only what every given one accepts (the first refusal's reason wins)."""
    chain = [a for a in authorizers if a is not None]
    if not chain:
        return None
    if len(chain) == 1:
        return chain[0]

    def check(peer_id: str | None, device: int, credential: bytes) -> bool | str | None:
        for a in chain:
            verdict = a(peer_id, device, credential)
            if not (verdict is None or verdict is True):
                return verdict
        return True

    return check


def read_secret_file(path: str, what: str) -> str:
    """The first line of ``path`` (a token file); EmberError if unreadable or empty."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.readline().strip()
        mode = os.stat(path).st_mode
    except OSError as e:
        raise EmberError(f"cannot read the {what} file {path}: {e.strerror or e}",
                         hint="create it with one line holding the secret, mode 0600") from None
    if not text:
        raise EmberError(f"the {what} file {path} is empty", hint="write the secret on its first line")
    if mode & 0o077:
        import sys
        print(f"ember: warning: {path} is readable by other users (mode {mode & 0o777:o}); "
              f"chmod 600 {path}", file=sys.stderr)
    return text


def read_peer_list(path: str) -> list[str]:
    """Peer ids from ``path``: one per line, ``#`` starts a comment."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise EmberError(f"cannot read the allowlist {path}: {e.strerror or e}",
                         hint="one 64-hex peer id per line; # starts a comment") from None
    ids = [ln.split("#", 1)[0].strip() for ln in lines]
    return [i for i in ids if i]


__all__ = ["Authorizer", "peer_id", "token_authorizer", "allowlist_authorizer", "identity_authorizer",
           "all_of", "read_secret_file",
           "read_peer_list"]
