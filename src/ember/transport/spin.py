"""A short busy-wait for the answer of a small round trip, on both ends of a network link.

On a virtual machine, a thread that sleeps in ``poll``/``epoll_wait`` for the few dozen microseconds a
small round trip takes pays twice: the wake-up itself (an interrupt through the hypervisor) and then its
Python code running on cold caches, about twice as slowly as in a loop that never sleeps. Measured on
loopback TCP (``bench/bench_torch.py --only roundtrip``), ``(a + 1).item()``: ~245 µs p50 with both ends
sleeping, ~150-200 µs with both polling for a moment first (raw asyncio TCP echo ~75-100 µs, same runs).

So, for at most :data:`SPIN` seconds (``EMBER_SPIN_US``, microseconds; ``0`` turns it off):

* a client's caller thread that wrote a request on a calm TCP link polls its socket without sleeping
  before it sleeps in ``poll`` (``transport.tcp_exchange``): it waits for that answer anyway;
* a peer (``ember serve``'s own loop, never the embedded peer's, which shares its process with the
  user's thread) that has just answered a small batch inline keeps polling its sockets without sleeping
  (:class:`HotSelector`), while no session's worker runs anything (a spinning loop would take the GIL
  from a worker's Python); it cools as soon as a batch goes to a worker.

Each end backs off (:class:`Backoff`) while its hot waits go unanswered, so a loop of training steps that
reads its loss now and then (the answer comes milliseconds later) does not burn its core's fair share.
Never on a machine (or an affinity mask) of one CPU: the spinner would hold the very core the other end
needs to answer; unless told (``ember serve --spin-us``): a peer pinned to a core of its own. Measured on
loopback TCP with the peer pinned to the second core (``taskset -c 1``), ``(a + 1).item()``: 185-225 µs p50
sleeping, 96-128 µs with ``--spin-us 300`` (same runs).
"""

from __future__ import annotations

import math
import os
import selectors
import time
from typing import Any


#: The longest hot wait a setting may ask for (microseconds): a moment, never a busy loop.
MAX_SPIN_US = 10_000.0


def _bounded(us: float) -> float:
    return 0.0 if math.isnan(us) else max(0.0, min(us, MAX_SPIN_US)) * 1e-6


def _spin_seconds() -> float:
    try:
        us = float(os.environ.get("EMBER_SPIN_US", "300"))
    except ValueError:
        us = 300.0
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return _bounded(us) if cpus >= 2 else 0.0


#: How long an end polls without sleeping before it sleeps as usual (seconds; 0: never).
SPIN = _spin_seconds()


def set_spin_us(us: float) -> None:
    """Set :data:`SPIN` to ``us`` microseconds (bounded as ``EMBER_SPIN_US`` is), even on one CPU:
    ``ember serve --spin-us``, for a peer pinned to a core that no client shares."""
    global SPIN
    SPIN = _bounded(us)


class Backoff:
    """Poll hot only while it pays: after a hot wait that ended without its event (the other end was busy
    for longer, a training step's read, say), the next 2, 4, ... 64 chances sleep at once; a hot wait that
    catches its event starts over. A wasted hot wait costs the CPU's fair share on a shared core."""

    __slots__ = ("misses", "skip")

    def __init__(self) -> None:
        self.skip = 0
        self.misses = 0

    def want(self) -> bool:
        """May this wait poll hot?"""
        if self.skip:
            self.skip -= 1
            return False
        return True

    def hit(self) -> None:
        self.misses = 0

    def missed(self) -> None:
        self.misses = min(self.misses + 1, _MAX_MISSES)
        self.skip = 1 << self.misses


_MAX_MISSES = 6  # (at most 64 chances skipped in a row)


class HotSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    """The event loop's selector that polls without sleeping until ``hot_until`` (``time.monotonic``),
    then sleeps as usual; a timer due sooner ends the hot wait as it would end the sleep."""

    def __init__(self) -> None:
        super().__init__()
        self.hot_until = 0.0
        self.hot_waits = 0  # waits that ended with an event before sleeping (tests, figures)
        self.backoff = Backoff()

    def select(self, timeout: float | None = None) -> list[Any]:
        if timeout is None or timeout > 0:
            now = time.monotonic()
            end = self.hot_until
            if now < end:
                if timeout is not None:
                    end = min(end, now + timeout)
                sel = super().select
                while True:
                    ready = sel(0)
                    if ready:
                        self.hot_waits += 1
                        self.backoff.hit()
                        return ready
                    t = time.monotonic()
                    if t >= end:
                        break
                if t >= self.hot_until:  # (not a timer due sooner: the hot wait is over, in vain)
                    self.hot_until = 0.0
                    self.backoff.missed()
                if timeout is not None:
                    timeout = max(0.0, timeout - (t - now))
        return super().select(timeout)

    def keep_hot(self, seconds: float = -1.0) -> None:
        """Poll without sleeping for the next ``seconds`` (default :data:`SPIN`)."""
        s = SPIN if seconds < 0 else seconds
        if s > 0 and self.backoff.want():
            self.hot_until = time.monotonic() + s

    def cool(self) -> None:
        """Sleep as usual from now on (a worker got work: a hot loop would take the GIL from its Python)."""
        self.hot_until = 0.0


def poll_hot(poller: Any, deadline: float, backoff: Backoff | None = None) -> bool:
    """Poll ``poller`` (a ``select.poll`` with the one event wanted) without sleeping until the event
    or ``min(deadline, now + SPIN)`` (``time.monotonic``): True on the event; False: sleep as usual
    (at once when ``backoff`` says polling hot did not pay lately)."""
    if backoff is not None and not backoff.want():
        return False
    end = min(deadline, time.monotonic() + SPIN)
    poll = poller.poll
    while True:
        if poll(0):
            if backoff is not None:
                backoff.hit()
            return True
        if time.monotonic() >= end:
            if backoff is not None:
                backoff.missed()
            return False


__all__ = ["SPIN", "MAX_SPIN_US", "Backoff", "HotSelector", "poll_hot", "set_spin_us"]
