"""What the session pump needs of the peer that hosts it: :class:`SessionHost` (``Server`` is one)."""

from __future__ import annotations

from typing import Any, Callable, Protocol

from .execute.backends import Backend
from .guard.limits import Admission, ClientLimits
from .guard.memory import DeviceMemory
from .telemetry.probe import Probe
from .transfer import TransferHub

__all__ = ["SessionHost"]


class SessionHost(Protocol):
    """What the session pump needs of the peer that hosts it (``Server`` is one).

    The pump receives its host as an argument and never imports ``server.py``,
    so the peer's configuration and its sessions stay two modules without a cycle.
    """

    backends: list[Backend]
    tables: list[dict[str, Callable[..., Any]]]
    custom_ops: dict[str, Callable[..., Any]]
    limits: dict[str, int]
    client_limits: ClientLimits
    admission: Admission
    budgets: list[DeviceMemory]          # one per device index (host devices share theirs)
    session_memory: int | None
    transfers: TransferHub
    inline_small: bool
    max_sessions: int
    sessions: dict[bytes, Any]   # server/session.py Session objects (which import this module)
    live: set[Any]
    peer_id: str | None
    transfer_peer_id: str | None
    version: str
    instance: str
    telemetry: Probe
    figures: Any  # server/telemetry/figures.py: answers STATS

    def authorize(self, peer_id: str | None, device: int, credential: bytes) -> str | None: ...

    def authorize_admin(self, peer_id: str | None, credential: bytes) -> str | None: ...

    def device_info(self) -> list[dict[str, Any]]: ...

    def welcome_limits(self, device: int) -> dict[str, Any]: ...
