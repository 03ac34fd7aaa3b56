"""Fan-out: one session records and encodes, the same frames go to several peers (a mesh).

A mixin of :class:`~ember.client.session.ClientSession`. ``ember.torch.mesh`` makes rank 0's
session the *leader* and the other peers' sessions its *followers*: every op is recorded, grouped
(op-graph caching) and encoded once, by the leader, and each encoded batch is queued as the same
frames on every follower's connection. The followers take no ops of their own and share the
leader's graph table (they see the same GRAPH/REPLAY stream). What must reach one peer only -- the
peer's own shard of a batch, a rank's join, a request -- is recorded *own*: :meth:`record_own`
marks a message of the leader's batch that only the leader gets (the batch is encoded in runs
around it), :meth:`own` turns the fan-out off for what is recorded inside it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import numpy as np

from ..protocol import messages as m


class FanOut:
    """Fanning a session's batches out to follower sessions (a mixin of ClientSession, under its lock)."""

    _fan: "list[Any] | None" = None
    _off = False  # inside :meth:`own`: batches go to this session's peer alone (drops wait for a fanned one)
    _own: list[int] = []  # indices of the pending batch's own messages (the leader's: set by fanout)

    def fanout(self, followers: list[Any]) -> None:
        """From now on every batch this session encodes is also queued, as the same frames, on each
        follower's connection."""
        self: Any
        for f in followers:
            f._g_on, f._grp, f._gtable = False, None, self._gtable
            # no idle tick of its own: what it is given alone is flushed before the next batch fanned
            # out to it (and by any request or close), so a follower never wakes the I/O thread itself
            f._ticking = True
            self.max_frame = min(self.max_frame, f.max_frame)
            self.max_batch = min(self.max_batch, f.max_batch)
        self._own = []
        self._fan = list(followers)

    def _fan_out(self, frames: list[Any]) -> None:
        """Queue ``frames`` on every follower (the caller wakes them with :meth:`_kick_all`)."""
        self: Any
        n = sum(len(x) for x in frames)
        for f in self._fan or ():
            with f._lock:
                if f._pending:
                    f._flush_locked(False)  # what the follower was given alone (its shard) goes first
                f._frames.extend(frames)
                f.stats["bytes_sent"] += n

    def _kick_all(self) -> None:
        """On the loop: wake this session's sender and its followers' (one wake-up of the I/O thread)."""
        self: Any
        self._kick()
        for f in self._fan or ():
            f._kick()

    def record_own(self, msg: list[Any]) -> None:
        """Queue ``msg`` (not an op: a boundary) for this session's peer only, in order with the batch."""
        self: Any
        if self._fan is None:  # not a leader: everything it records is its own
            return self.record(msg)
        if self.lost is not None:
            raise self._lost_error()
        with self._lock:
            self._boundary_locked()
            self._own.append(len(self._pending))
            self._pending.append(msg)
            self._arm_locked()

    def upload_own(self, arr: Any, progress: Any = None) -> int:
        """Upload ``arr`` to this session's peer only (a large one always is: a job of its own)."""
        self: Any
        arr = np.asarray(arr, order="C")
        if arr.nbytes > m.INLINE_DATA or self._fan is None:
            return int(self.upload(arr, progress))
        self._check_upload(arr)
        tid = next(self.ids)
        self.record_own([m.UPLOAD, tid, arr.dtype.name, list(arr.shape), 0, arr.reshape(-1).view(np.uint8).tobytes(),
                         arr.nbytes])
        return int(tid)

    def _split(self, p: list[list[Any]], fan: bool) -> None:
        """Queue a batch holding own messages: runs for everyone around runs for this peer alone."""
        self: Any
        own, self._own = set(self._own), []
        start = 0
        for i in range(len(p) + 1):
            if i == len(p) or (i in own) != (start in own):
                if i > start:
                    self._queue(p[start:i], fan and start not in own)
                start = i

    @contextlib.contextmanager
    def own(self) -> Iterator[None]:
        """Inside: what is recorded or uploaded on this session goes to its own peer only (the batch
        before is flushed to every follower first, and what is recorded inside is flushed at the end)."""
        self: Any
        with self._lock:
            self._flush_locked()
            self._off = True
        try:
            yield
        finally:
            with self._lock:
                self._flush_locked()
                self._off = False
