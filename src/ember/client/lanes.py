"""Lanes for a ClientSession (feature ``"lanes"``, see ``protocol.lanes``): extra streams to the
same peer, attached to the session, over which large uploads and read answers are striped.

Lanes are opened the first time a transfer of at least ``STRIPE_MIN`` bytes needs them (the
user's thread waits for the attach, once per session; a peer that refuses them leaves the session
on one stream). Over iroh a lane is another bi-stream of the same QUIC connection. Each lane has
a receiver task that hands its frames (a striped read's chunks) to the same code as the session
stream's; a large upload is one ``StripedUpload`` job for the sender: its ``UPLOAD`` with nil bytes
on the session stream (its place in the order), then one stripe per lane side by side. A lane that
breaks, closes or brings anything but data frames ends the session (``SessionLost`` /
``ProtocolError``), like its session stream would.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable

from ..errors import ConnectError, EmberError, ProtocolError, SessionLost
from ..protocol import codec
from ..protocol import lanes as pl
from ..protocol import messages as m
from ..transport.loop import all_or_nothing

log = logging.getLogger("ember.client")

#: Seconds a lane may take to open and attach.
LANE_TIMEOUT = 10.0


class StripedUpload:
    """A large upload for the sender: its UPLOAD on the session stream, its bytes on the lanes."""

    __slots__ = ("tid", "dtype", "shape", "flat", "waiter")

    def __init__(self, tid: int, dtype: str, shape: list[int], flat: memoryview, waiter: Any) -> None:
        self.tid, self.dtype, self.shape, self.flat, self.waiter = tid, dtype, shape, flat, waiter


class LaneData:
    """The lanes half of ``ClientSession`` (which supplies ``conn``, ``loop``, ``chunk``, ``data``,
    ``address``, ``stats``, ``_data_frame``, ``_sink``, ``_fail_all`` and ``_last_recv``)."""

    conn: Any
    loop: asyncio.AbstractEventLoop
    chunk: int
    data: bool
    address: str
    stats: dict[str, int]
    lost: EmberError | None
    _last_recv: float

    def _init_lanes(self, welcome: dict[str, Any], wanted: int, dial: Callable[[], Awaitable[Any]] | None,
                    session_id: bytes) -> None:
        n, key = pl.agreed_lanes(welcome, wanted)
        self.lanes_wanted = n if dial is not None and self.data and session_id else 0
        self._lane_key, self._lane_dial, self._session_id = key, dial, session_id
        self.lanes: list[Any] = []
        self._lane_tasks: list[asyncio.Task] = []
        self._lanes_tried = False

    def _striping(self, total: int) -> bool:
        """Do ``total`` bytes go over lanes? Opens them the first time (this thread waits, once)."""
        if not self.lanes_wanted or total < pl.STRIPE_MIN:
            return False
        if not self._lanes_tried:
            self._lanes_tried = True
            try:
                asyncio.run_coroutine_threadsafe(self._open_lanes(), self.loop).result(LANE_TIMEOUT + 2.0)
            except Exception as e:  # noqa: BLE001 - the session carries on, on its one stream
                log.info("no lanes to %s: %s", self.address[:40], e)
        return bool(self.lanes) and self.lost is None

    async def _open_lanes(self) -> None:
        async def one() -> Any:
            assert self._lane_dial is not None and self._lane_key is not None
            conn = await self._lane_dial()
            try:
                await conn.send(pl.encode_attach(self._session_id, self._lane_key))
                reply = await asyncio.wait_for(conn.recv(), LANE_TIMEOUT)
                d = codec.unpackb(reply) if reply is not None else None
                if not isinstance(d, dict) or d.get("type") != "lane":
                    why = d.get("reason") if isinstance(d, dict) else "no answer"
                    raise ConnectError(f"{self.address} refused a lane: {why}")
            except BaseException:
                await conn.close()
                raise
            return conn
        got = await asyncio.wait_for(asyncio.gather(*(one() for _ in range(self.lanes_wanted)),
                                                    return_exceptions=True), LANE_TIMEOUT)
        for r in got:
            if isinstance(r, BaseException):
                log.info("a lane to %s was not attached: %s", self.address[:40], r)
                continue
            if self.lost is not None:
                await r.close()
                continue
            set_sink = getattr(r, "set_data_sink", None)
            if set_sink is not None:
                set_sink(self._sink)
            self.lanes.append(r)
            self._lane_tasks.append(self.loop.create_task(self._lane_receiver(r)))

    async def _lane_receiver(self, conn: Any) -> None:
        """A lane's frames: a striped read's chunks (the session stream brings its OK)."""
        try:
            while True:
                frame = await conn.recv()
                if frame is None:
                    raise SessionLost(f"peer {self.address} closed a lane of this session")
                self._last_recv = time.monotonic()
                self.stats["bytes_received"] += len(frame)
                if not codec.is_data(frame):
                    raise ProtocolError(f"peer {self.address} sent a frame that is no data frame on a lane")
                self._data_frame(frame)  # type: ignore[attr-defined]
        except asyncio.CancelledError:
            pass
        except EmberError as e:
            if isinstance(e, SessionLost):
                await self._session_says_why()  # type: ignore[attr-defined]
            self._fail_all(e if isinstance(e, (SessionLost, ProtocolError)) else SessionLost(e.message))  # type: ignore[attr-defined]
        except (ValueError, TypeError, IndexError) as e:
            self._fail_all(ProtocolError(f"malformed frame on a lane from {self.address}: {e}"))  # type: ignore[attr-defined]
        except (ConnectionError, OSError) as e:
            await self._session_says_why()  # type: ignore[attr-defined]
            self._fail_all(SessionLost(f"a lane to {self.address} broke: {e}"))  # type: ignore[attr-defined]

    async def _send_striped(self, job: StripedUpload) -> None:
        """The upload's place in the order on the session stream, then its stripes on the lanes."""
        w, flat, chunk = job.waiter, job.flat, self.chunk
        total = len(flat)
        await self.conn.send(codec.packb([[m.UPLOAD, job.tid, job.dtype, job.shape, 0, None, total]]))
        lanes = list(self.lanes)
        if not lanes:
            raise ConnectionError("every lane of this session is gone")
        send = self._send_frames  # type: ignore[attr-defined]  # (client/bulk.py)
        await all_or_nothing(send(c, pl.upload_stripe(job.tid, job.dtype, job.shape, flat, lo, hi, chunk), w)
                             for c, (lo, hi) in zip(lanes, pl.stripe_bounds(total, chunk, len(lanes))))
        w.set()

    async def _close_lanes(self) -> None:
        for t in self._lane_tasks:
            t.cancel()
        lanes, self.lanes = self.lanes, []
        for c in lanes:
            try:
                await asyncio.wait_for(c.close(), 2.0)
            except Exception:  # noqa: BLE001
                pass


__all__ = ["LaneData", "StripedUpload", "LANE_TIMEOUT"]
