"""Every error Ember raises derives from :class:`EmberError`.

Each error carries a human message and, where one helps, a ``hint`` saying what
to change. Errors that cross the wire travel as ``{kind, message, op}`` and are
rebuilt here by :func:`from_wire`.
"""

from __future__ import annotations

from typing import Any


class EmberError(Exception):
    """Base class of every Ember error."""

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        self.message = message
        self.hint = hint
        super().__init__(f"{message}\n  hint: {hint}" if hint else message)


class BindError(EmberError):
    """A listener or endpoint could not bind.

    ``cause`` is one of :data:`BIND_CAUSES`; ``transient`` says whether a retry
    may help.
    """

    def __init__(self, message: str, *, cause: str, hint: str | None = None,
                 transient: bool = False) -> None:
        self.cause = cause
        self.transient = transient
        super().__init__(message, hint=hint)


BIND_CAUSES = (
    "address_in_use",
    "address_not_available",
    "invalid_address",
    "invalid_key",
    "key_in_use",
    "no_udp",
    "relay_unreachable",
    "other",
)


class ConnectError(EmberError):
    """The peer could not be reached or refused the session."""


class AuthorizationError(ConnectError):
    """The peer's authorizer refused this session; ``reason`` is its word."""

    def __init__(self, reason: str, *, hint: str | None = None) -> None:
        self.reason = reason
        super().__init__(f"session refused by the peer's authorizer: {reason}", hint=hint)


class ProtocolError(EmberError):
    """Bytes or messages that do not follow the Ember protocol."""


class LimitExceeded(ProtocolError):
    """A frame, tensor or table exceeded a configured limit."""


class RemoteExecutionError(EmberError):
    """An op failed on the compute peer; raised when a dependent value is read."""

    def __init__(self, message: str, *, op: str | None = None, hint: str | None = None) -> None:
        self.op = op
        super().__init__(message, hint=hint)


class SessionLost(EmberError):
    """The session ended (peer gone, connection dropped) with work outstanding."""


class TransferError(EmberError):
    """A tensor move between devices or peers failed."""


_KINDS: dict[str, type[EmberError]] = {
    cls.__name__: cls
    for cls in (EmberError, ConnectError, AuthorizationError, ProtocolError, LimitExceeded,
                RemoteExecutionError, SessionLost, TransferError)
}


def to_wire(err: BaseException, op: str | None = None) -> dict[str, Any]:
    """Encode an error for a response message."""
    kind = type(err).__name__ if isinstance(err, EmberError) else "RemoteExecutionError"
    message = err.message if isinstance(err, EmberError) else f"{type(err).__name__}: {err}"
    return {"kind": kind, "message": message, "op": op or getattr(err, "op", None)}


def from_wire(d: dict[str, Any]) -> EmberError:
    """Rebuild an error sent by :func:`to_wire`."""
    cls = _KINDS.get(d.get("kind", ""), RemoteExecutionError)
    msg = str(d.get("message", "remote error"))
    if cls is RemoteExecutionError:
        return RemoteExecutionError(msg, op=d.get("op"))
    if cls is AuthorizationError:
        return AuthorizationError(msg)
    if cls is TransferError:
        return TransferError(msg, hint="the moved tensor has no value on this peer: move it again from a live "
                                       "source (a source that ended takes its tensors with it)")
    return cls(msg)
