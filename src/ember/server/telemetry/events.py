"""Telemetry events: what the probe (``server/telemetry/probe.py``) delivers to its subscribers.

Session events are dataclasses (rare); ``Batch`` carries one batch's messages in columns and
``Op`` (a named tuple, cheap to build) is one message, unpacked from a ``Batch`` by ``unpack``.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate, repeat
from operator import sub
from typing import Any, NamedTuple

from ...protocol import messages as m

KINDS = tuple(n.lower() for n in m.KIND_NAMES)
"""Message kind names as telemetry reports them (``op``, ``upload``, ``read``, ...)."""


def kind_name(kind: Any) -> str:
    """A message kind's telemetry name (any other value as its string: a client may send any kind)."""
    return KINDS[kind] if isinstance(kind, int) and 0 <= kind < len(KINDS) else str(kind)


@dataclass(slots=True)
class SessionOpened:
    t: float
    session: str            # 32 hex characters (the client's random session id)
    peer: str | None        # authenticated iroh peer id, None over WebSocket and the memory link
    remote: str             # address as the transport names it
    transport: str          # memory | websocket | iroh
    device: int
    admin: bool


@dataclass(slots=True)
class SessionClosed:
    t: float
    session: str
    peer: str | None
    remote: str
    transport: str
    device: int
    admin: bool
    duration_s: float
    reason: str             # client_closed | disconnected | lost | silent | protocol_error | server_stopping
    why: str                # the same, in words
    figures: dict[str, int]  # see ``counters``


@dataclass(slots=True)
class SessionRefused:
    t: float
    peer: str | None
    remote: str
    code: str               # a handshake reject code (unauthorized, device, version, full, protocol)
    reason: str


@dataclass(slots=True)
class Error:
    t: float
    session: str
    kind: str               # the error kind a reader gets (RemoteExecutionError, ProtocolError, ...)
    cause: str              # the exception type behind it (ValueError, LimitExceeded, ...)
    op: str | None
    message: str
    poisoned: bool          # outputs were poisoned (an op failed), else a malformed message was answered


@dataclass(slots=True)
class Transfer:
    t: float
    session: str | None     # None for a download served to another peer
    peer: str | None        # the other end: source address (fetch) or downloading peer id (serve)
    scope: str              # device (same peer) | fetch (download from a peer) | serve (upload to one)
    phase: str              # started | completed | failed
    nbytes: int = 0
    seconds: float = 0.0
    error: str | None = None


@dataclass(slots=True)
class GraphMissed:
    t: float
    session: str
    gid: int                # a REPLAY named a graph the session's cache did not hold (NEED_GRAPH)


@dataclass(slots=True)
class GraphEvicted:
    t: float
    session: str
    count: int              # graphs the LRU evicted when one was registered


class Batch(NamedTuple):
    """One batch a session ran, message by message, in columns (cheap to build: two appends a message).

    ``names[i]``: message i's op name (OP messages) or None; ``times``: the ``perf_counter()`` at
    which each message finished, as packed doubles (``seconds()`` turns them into durations;
    ``start`` is when the batch began); ``extras``: ``(i, kind, name, nbytes, ops, saved_bytes)`` for
    every message i that is not an OP (reads, uploads, graphs, replays, ...); ``outputs[i]``: an
    OP's ``(id, shape, dtype)`` outputs, only while a subscriber asked for ``shapes``.

    Queued as a plain tuple of tuples, bytes and numbers, which the garbage collector stops
    tracking once it has seen it: events waiting in a queue would otherwise make its full
    collections frequent, and those cost a busy server more than recording the events does.
    """

    t: float                # wall-clock time the batch finished
    session: str
    wait_s: float           # from the frame's arrival to the start of its execution
    run_s: float
    inline: bool            # run by the network loop (tiny, cheap batches), else by the session's worker
    start: float
    names: tuple[Any, ...]
    times: bytes            # doubles, native byte order
    extras: tuple[tuple[Any, ...], ...]
    outputs: dict[int, list[tuple[int, tuple[int, ...], str]]] | None = None
    memory: int = 0         # bytes the session holds after the batch (its memory budget's charge)
    device_memory: int = 0  # bytes its device's budget holds, all sessions (slab credit included)

    @property
    def messages(self) -> int:
        return len(self.names)

    def ends(self) -> memoryview:
        """``times`` as floats."""
        return memoryview(self.times).cast("d")

    def seconds(self) -> list[float]:
        """Each message's execution time."""
        prev, out = self.start, []
        for t in self.ends():
            out.append(t - prev)
            prev = t
        return out

    def ops(self) -> list["Op"]:
        """The messages as ``Op`` events (``wait_s`` counts from the batch's arrival)."""
        return unpack(self)


class Op(NamedTuple):
    """One message a session ran (a named tuple: cheap to build, one per op)."""

    t: float                # wall-clock time it finished
    session: str
    kind: str               # a name of ``KINDS``
    name: Any               # op name (op, custom, aten), graph id (graph, replay), else None
    wait_s: float           # from the batch's arrival to this message's start
    seconds: float
    nbytes: int = 0         # upload / read payload, graph wire bytes, replay binding bytes (estimated)
    ops: int = 1            # ops run: 1, a replay's graph size, 0 for data and control messages
    saved_bytes: int = 0    # wire bytes a replay saved against sending its ops one by one
    outputs: list[tuple[int, tuple[int, ...], str]] | None = None  # (id, shape, dtype) with shapes=True


@dataclass(slots=True)
class Missed:
    t: float
    count: int              # events dropped since the subscriber's previous read (its queue was full)


SESSION_EVENTS = frozenset({"SessionOpened", "SessionClosed", "SessionRefused", "Error", "Transfer",
                            "GraphMissed", "GraphEvicted"})
OP_EVENTS = frozenset({"Batch", "Op"})
EVENTS = SESSION_EVENTS | OP_EVENTS



def unpack(b: Batch) -> list[Op]:
    """A ``Batch`` as ``Op`` events (``wait_s`` counts from the batch's arrival); built column by
    column, the rows in one C-level pass (about 0.15 µs an op)."""
    n = len(b.names)
    if not n:
        return []
    ends = b.ends().tolist()
    starts = [b.start, *ends[:-1]]
    secs = list(map(sub, ends, starts))
    waits = list(accumulate(secs[:-1], initial=b.wait_s))
    wall = b.t - b.run_s - b.start  # perf_counter -> wall clock
    ts = [wall + t for t in ends]
    kinds: list[str] = ["op"] * n
    nbytes: list[int] = [0] * n
    ops: list[int] = [1] * n
    saved: list[int] = [0] * n
    names: Any = b.names
    if b.extras:
        names = list(names)
        for i, kind, name, nb, n_run, sv in b.extras:
            kinds[i] = kind_name(kind)
            names[i], nbytes[i], ops[i], saved[i] = name, nb, n_run, sv
    outputs: Any = repeat(None) if not b.outputs else [b.outputs.get(i) for i in range(n)]
    return list(map(_new, repeat(Op), zip(ts, repeat(b.session), kinds, names, waits, secs, nbytes, ops, saved,
                                          outputs)))


_new = tuple.__new__


__all__ = ["KINDS", "kind_name", "SESSION_EVENTS", "OP_EVENTS", "EVENTS", "SessionOpened", "SessionClosed", "SessionRefused",
           "Error", "Transfer", "GraphMissed", "GraphEvicted", "Batch", "Op", "Missed", "unpack"]
