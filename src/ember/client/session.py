"""ClientSession: batching, client-allocated ids, reads, drops, heartbeat.

Recording an op appends one short list to ``_pending`` under a lock; nothing
is sent until a value is needed (read, sync), the batch passes ``max_batch``
messages, or the idle timer ticks (every ``idle_flush`` seconds while the
session is in use: pending ops wait at most that long) so work starts while
user code keeps going. Frames are encoded on the recording thread and queued in
order for the I/O loop's sender. The timer is a tick on the I/O loop that keeps
running while ops are being recorded and stops after ~50 quiet ticks, so
recording an op normally wakes no thread (a per-batch timer would cost an
extra I/O-thread wake-up on every op + read round trip).

Op-graph caching (``graphs=True``, see :mod:`ember.client.graph`): a group of
ops that recurs between two boundaries (reads, uploads...) is held instead of
queued while it matches the previous such group, and goes out as one REPLAY.
A group may be up to ``graph_max_ops`` (4096) long; it is held at most
``graph_hold`` seconds, longer (up to ``graph_hold_max``) once a group given up
at that limit turned out to match its candidate (a step that takes longer to
record than the hold: an LSTM's).
A loop with no boundary in it (a training loop that reads its loss only now
and then) is one long run of ops; once it outgrows a graph the session looks
for a period in its op names and, if there is one, cuts the run every period
(at least ``graph_min_period`` ops, so the per-group cost stays small) with
*soft* boundaries, so each period is a group and gets replayed.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import weakref
from collections import deque
from typing import Any, Callable

import numpy as np

from .._version import __version__
from ..errors import (AuthorizationError, ConnectError, EmberError, ProtocolError, SessionLost,
                      from_wire)
from ..protocol import codec
from ..protocol import messages as m
from ..transport.base import FrameConnection
from .bulk import BulkData, ReadTimeout, Upload, Waiter, size_text
from .exchange import Exchanging
from .fanout import FanOut
from .grouping import GroupHolding
from .lanes import LaneData, StripedUpload
from . import batch
from .graph import Candidate, GraphTable
from .known import READS_ONLY, Knowing

_sessions: "weakref.WeakSet[ClientSession]" = weakref.WeakSet()
_OP = m.OP


class ClientSession(BulkData, LaneData, GroupHolding, FanOut, Exchanging, Knowing):
    """One session with one device of one peer."""

    def __init__(self, conn: FrameConnection, welcome: dict[str, Any], loop: asyncio.AbstractEventLoop, *,
                 address: str, device: int, read_timeout: float = 300.0, idle_flush: float = 0.002,
                 max_batch: int = 512, heartbeat_interval: float = 1.0, heartbeat_timeout: float = 5.0,
                 graphs: bool = True, graph_min_ops: int = 8, graph_max_ops: int = 4096,
                 graph_hold: float = 0.02, graph_hold_max: float = 0.5, graph_min_period: int = 128, lanes: int = 0,
                 dial_lane: Any = None, session_id: bytes = b"") -> None:
        self.conn, self.welcome, self.loop, self.address, self.device = conn, welcome, loop, address, device
        self.read_timeout, self.idle_flush, self.max_batch = read_timeout, idle_flush, max_batch
        self.hb_interval, self.hb_timeout = heartbeat_interval, heartbeat_timeout
        limits = welcome.get("limits", {})
        self.idle_ping = float(limits.get("idle_timeout") or 0) / 4 or None  # the peer ends silent sessions
        self.max_frame = int(limits.get("max_frame", m.DEFAULT_MAX_FRAME))
        self.chunk = int(limits.get("chunk", m.DEFAULT_CHUNK))
        self.max_tensor = limits.get("max_tensor")        # what the peer accepts: refused here, before sending
        self.session_memory = limits.get("session_memory")
        if limits.get("max_messages"):  # the peer ends a session whose batch is longer (a few messages spare)
            self.max_batch = max_batch = max(1, min(max_batch, (int(limits["max_messages"]) - 2) // 2))
        self.ids, self._reqs = itertools.count(1), itertools.count(1)
        self._lock = threading.Lock()
        self._pending: list[list[Any]] = []
        self._drops: deque[int] = deque()
        self._frames: deque[Any] = deque()  # frames (bytes, or gathered parts) and _Upload jobs
        self._waiters: dict[int, Waiter] = {}
        self._ticking = False  # the idle tick runs on the I/O loop
        self._active = False   # something was recorded since the last tick
        self._quiet = 0        # ticks without activity
        self.lost: EmberError | None = None
        self.stats = {"ops": 0, "batches": 0, "bytes_sent": 0, "bytes_received": 0, "reads": 0,
                      "graphs": 0, "replays": 0, "replayed_ops": 0, "graph_resends": 0, "split_reads": 0,
                      "unsendable": 0,  # messages dropped: they could not be encoded (client/batch.py)
                      "known_reads": 0,  # reads the frontend answered from bytes it holds (known)
                      "requests": 0}  # requests waited for (a read, a shape, a sync...)
        #: id -> the exact bytes of that storage, as a frontend knows them without asking (ember.torch's
        #: ``_known``); an id is forgotten whenever a message may write it (:meth:`_unknow`) or it is released
        self.known: dict[int, Any] = {}
        self.pure: set[str] = set()
        # op-graph caching: the current group, held or shadow-captured (None: not capturing)
        gcap = int(limits.get("graph_cache", 0))
        self._g_on = bool(graphs) and gcap > 0
        # (a held group longer than a batch goes out in batches when it is released: _spill)
        self._g_min, self._g_max = max(2, graph_min_ops), min(graph_max_ops, m.MAX_GRAPH_OPS)
        self._g_cut = min(1024, max_batch, self._g_max)  # a group this long: look for a period to cut on
        self._no_period = False  # cutting on a period never replayed: groups grow to _g_max instead
        self.graph_hold, self.graph_min_period = graph_hold, graph_min_period
        self.graph_hold_max = max(graph_hold, graph_hold_max)
        self._hold_s = graph_hold  # how long a group is held: learned (_end_group), up to graph_hold_max
        self._timed_out: Candidate | None = None  # the candidate whose hold the tick just gave up
        self._grp: list[list[Any]] | None = [] if self._g_on else None
        self._grp_drops: list[int] = []
        self._cand: Candidate | None = None
        self._cands: dict[str, list[Candidate]] = {}  # by first op name, most recent first
        self._hold_t0 = 0.0
        self._period = -1  # > 0: the op stream repeats every _period ops (groups end there too)
        self._misses = 0   # periods in a row that did not replay
        self._send_soon = False  # a replayed group waits in _pending: the next op sends it (_send_now_locked)
        self._cstart = 0  # the held group's ops before this index went out in chunks (_chunk_locked)
        self._at_read = False  # the boundary being made is a read's (_request_locked)
        self._read_tid: int | None = None  # the id being read at that boundary, on a network link (grouping.py)
        self._after_read = 0  # work (messages, replayed ops) the last request's batch holds after it
        #: the frontend's "may this op (by name) write an argument?" (None: unknown): where a read can split
        #: the held group (:meth:`_request_locked`); None: reads never split groups
        self.op_writes: Callable[[str], bool | None] | None = None
        self._gtable = GraphTable(gcap)
        self._poisoned: dict[int, EmberError] = {}  # ids whose message could not be sent: why
        self.data = m.DATA_FEATURE in codec.agreed_features(welcome.get("features"))
        #: the peer takes moving layouts (GRAPH's ``moving``): a group that slices a tensor at a moving offset replays
        self._g_offsets = m.OFFSETS_FEATURE in codec.agreed_features(welcome.get("features"))
        self.welcome_features = welcome.get("features")
        self.compiled = False  # the peer compiles this session's graphs (feature "compile", set by Device)
        self._placed: dict[tuple[int, int], int] = {}
        self._init_lanes(welcome, lanes, dial_lane, session_id)  # (client/lanes.py)
        set_sink = getattr(conn, "set_data_sink", None)
        if self.data and set_sink is not None:
            set_sink(self._sink)
        self._wake = asyncio.Event()
        self._send_nowait = getattr(conn, "send_nowait", None)  # a link that sends at once (in-memory)
        self._parked = False  # the sender waits for frames (everything before them has been sent)
        self._init_exchange(conn)  # (client/exchange.py)
        self._last_recv = self._pinged = time.monotonic()
        self._tasks = [loop.create_task(self._receiver()), loop.create_task(self._sender()),
                       loop.create_task(self._heartbeat())]
        _sessions.add(self)

    # ---- recording (user threads) -----------------------------------------------------
    def record(self, msg: list[Any]) -> None:
        """Queue one message; flush when the batch is full, arm the idle timer when it starts."""
        if self.lost is not None:
            raise self._lost_error()
        if self.known and not (msg[0] == _OP and msg[1] in self.pure):
            self._unknow(msg)
        with self._lock:
            g = self._grp
            if msg[0] == _OP:
                if self._send_soon:
                    self._send_soon = False
                    self._send_now_locked()
                if g is not None:
                    n = len(g)
                    if n == self._period:  # the stream repeats every _period ops: a soft boundary
                        self._soft_boundary()
                        g, n = self._grp, 0
                        assert g is not None
                    c = self._cand
                    if c is not None:  # holding: does the group still follow a candidate?
                        if n < c.n and msg[1] == c.names[n] or self._switch_candidate(n, msg[1]):
                            g.append(msg)
                            c = self._cand  # (a chunk of it goes out now, short of the read's own ops: grouping.py)
                            late, k, cut = c.late, n + 1, c.cut
                            if late and (k == cut or k - self._cstart >= late and (k < cut or not cut)) \
                                    and k <= c.n - c.tail:
                                self._chunk_locked(g)
                            return
                        self._release_held()
                    elif not n:  # first op of a group
                        cl = self._cands.get(msg[1])
                        if cl:
                            self._start_hold(cl[0], msg)
                            return
                    g.append(msg)
                    if n >= self._g_cut and (n == self._g_cut or n >= self._g_max):
                        self._too_long(g)
            elif g is None or g:
                self._end_group()
            p = self._pending
            p.append(msg)
            self._arm_locked()
            if len(p) < self.max_batch:
                return
            self._flush_locked(False)
        # A full batch while the user keeps recording: let the I/O thread take the GIL and send it
        # now, so the peer works while we record (else it waits for the next GIL switch, ~5 ms).
        time.sleep(0)

    def release(self, tid: int) -> None:
        """The user dropped an array: free it on the peer with the next batch (called from __del__)."""
        self._drops.append(tid)
        if self.known:
            self.known.pop(tid, None)

    def flush(self) -> None:
        with self._lock:
            self._flush_locked()

    def _flush_locked(self, boundary: bool = True, drops_too: bool = True, fan: bool = True,
                      take: bool = False) -> bytes | None:
        """Encode and queue the pending batch. ``boundary``: also end the current op group; ``drops_too``:
        False while a long group goes out in batches (a release must follow every op recorded before it);
        ``fan``: queue it on the followers too (a mesh, :meth:`fanout`); ``take``: return the batch's frame
        instead of queueing it, when it is one frame (``client/exchange.py`` sends it itself)."""
        if self._off:
            fan = False
        if boundary:
            self._boundary_locked()
        p = self._pending
        drops = self._drops
        if drops and drops_too and (fan or not self._fan):  # (a drop of a mesh goes to every peer)
            ids = []
            while drops:
                ids.append(drops.popleft())
            p.append([m.DROP, ids])
            if self._grp:  # capturing: the group's analysis needs to know what was released
                self._grp_drops.extend(ids)
        if not p:
            return None
        self._pending = []
        if self._own:  # a mesh's leader: its own messages (its shard's upload) go to it alone
            self._split(p, fan)
            return None
        return self._queue(p, fan, take)

    def _queue(self, p: list[list[Any]], fan: bool, take: bool = False) -> bytes | None:
        """Encode a batch and queue its frames (and on the followers, ``fan``); ``take``: see
        :meth:`_flush_locked`."""
        try:
            frames = None if self._poisoned else [codec.packb(p)]
        except Exception:  # a message the protocol cannot carry: never the whole batch (client/batch.py)
            frames = None
        if frames is None or len(frames[0]) > self.max_frame:
            frames, answers, sent, unsendable = batch.sift(p, self._poisoned, self.max_frame, self.address)
            self.stats["unsendable"] += unsendable
            for req, err in answers:  # reads of poisoned ids: answered here
                w = self._waiters.pop(req, None)
                if w is not None:
                    w.error = err
                    w.set()
        else:
            sent = len(p)
        self.stats["ops"] += sent
        for frame in frames:
            self.stats["batches"] += 1
            self.stats["bytes_sent"] += len(frame)
        if take and len(frames) == 1 and not (fan and self._fan):
            return frames[0]
        self._frames.extend(frames)
        if frames:
            if fan and self._fan:
                self._fan_out(frames)
                self.loop.call_soon_threadsafe(self._kick_all)
            else:
                self.loop.call_soon_threadsafe(self._kick)
        return None

    def send_alone(self, msg: list[Any]) -> None:
        """Send ``msg`` as a batch of its own, after everything recorded so far."""
        if self.lost is not None:
            raise self._lost_error()
        if self.known:
            self._unknow(msg)
        with self._lock:
            self._flush_locked()
            self._pending.append(msg)
            self._flush_locked()

    # ---- data in / out -----------------------------------------------------------------
    def request(self, kind: int, *fields: Any, timeout: float | None = None,
                progress: Any = None, nbytes: int = 0) -> Any:
        """Send a request (READ, SYNC, SHAPE, ...) and wait for its answer (``progress``: show the
        ``nbytes`` of a large answer arriving)."""
        if self.lost is not None:
            raise self._lost_error()
        if self.known and kind not in READS_ONLY:
            self._unknow([kind, *fields])
        self.stats["requests"] += 1
        req = next(self._reqs)
        w = Waiter()
        self._waiters[req] = w
        t = self.read_timeout if timeout is None else timeout
        if progress is None and self._exchanges and not self._fan:  # on this thread, when the link is calm
            self._exchange([kind, req, *fields], req, t)  # (client/exchange.py)
        else:
            with self._lock:
                if self._fan:  # the ops before go to every peer of the mesh; the request to this one only
                    self._boundary_locked()
                    self._flush_locked(False)
                    self._pending.append([kind, req, *fields])
                else:
                    self._request_locked([kind, req, *fields])
                self._flush_locked(False, fan=False)
        if progress is not None:
            try:
                self._wait(w, nbytes, progress, f"download {size_text(nbytes)}", t)
            finally:
                self._waiters.pop(req, None)
            return w.value
        if not w.wait(t):
            self._waiters.pop(req, None)
            if self.lost is not None:
                raise self._lost_error()
            raise ReadTimeout(f"no answer from {self.address} within {t:g} s",
                              hint="a long computation? pass a larger read_timeout to ember.connect")
        if w.error is not None:
            raise w.error
        return w.value

    def read(self, tid: int, timeout: float | None = None, progress: Any = None, nbytes: int = 0) -> np.ndarray:
        if self.lanes_wanted and nbytes:
            self._striping(nbytes)  # the peer stripes the answer over the lanes once they are open
        dt, shape, off, data, total = self.request(m.READ, tid, timeout=timeout, progress=progress, nbytes=nbytes)
        self.stats["reads"] += 1
        if isinstance(data, np.ndarray):  # assembled from data frames
            return data.view(np.dtype(dt)).reshape(shape)
        return np.frombuffer(data, dtype=np.dtype(dt)).reshape(shape)

    def sync(self, timeout: float | None = None) -> None:
        self.request(m.SYNC, timeout=timeout)

    def close(self) -> None:
        if self.lost is not None:
            return
        try:
            with self._lock:
                self._flush_locked()
                self._pending.append([m.CLOSE])
                self._flush_locked(False)
        except RuntimeError:  # loop already gone (interpreter exit)
            pass
        self._fail_all(SessionLost("session closed by this client"))

    # ---- I/O loop side -----------------------------------------------------------------
    def _arm_tick(self) -> None:
        self.loop.call_later(self.idle_flush, self._tick)

    def _tick(self) -> None:
        """Every ``idle_flush`` while in use: send what waits; give up holding a group past ``graph_hold``."""
        with self._lock:
            if self._cand is not None and time.monotonic() - self._hold_t0 >= self._hold_s:
                self._timed_out = self._cand  # (if the group still matches it at its end, hold longer next time)
                self._release_held()
            if self._cand is None and (self._pending or self._drops):
                self._flush_locked(False)
            elif self._pending:  # holding a group: what was recorded before it goes now (its releases wait
                self._flush_locked(False, drops_too=False)  # for the group: they may name the group's ids)
            if self._active or self._pending or self._cand is not None:
                self._active, self._quiet = False, 0
            else:
                self._quiet += 1
            if self._quiet >= 50 or self.lost is not None:
                self._ticking = False
                return
        self.loop.call_later(self.idle_flush, self._tick)

    def _kick(self) -> None:
        """On the loop: frames were queued. With the sender parked on a link that sends at once, plain
        frames go out here, in order (nothing is in flight), a task switch sooner; else the sender wakes."""
        frames, send = self._frames, self._send_nowait
        if send is not None and self._parked and self.lost is None:
            while frames and type(frames[0]) is bytes:
                frame = frames.popleft()
                try:
                    send(frame)
                except ConnectionError:  # the sender meets it again and reports the loss
                    frames.appendleft(frame)
                    break
        if frames:
            self._wake.set()

    async def _sender(self) -> None:
        frames, wake, conn = self._frames, self._wake, self.conn
        try:
            while self.lost is None or frames:
                self._parked = True
                await wake.wait()
                self._parked = False
                wake.clear()
                while frames:
                    frame = frames.popleft()
                    if type(frame) is Upload:
                        await self._send_upload(frame)
                        self._reader_idle()
                        continue
                    if type(frame) is StripedUpload:
                        await self._send_striped(frame)
                        continue
                    self._reader_wanted()
                    await conn.send(frame)
                    if len(frame) >= 1 << 20:
                        # a big send completing is a sign of life: a long upload gets no answers, but
                        # a dead peer stops acknowledging and the send stalls (pings do not count)
                        self._last_recv = time.monotonic()
                if self.lost is not None:
                    break
        except (ConnectionError, OSError) as e:
            await self._session_says_why()
            self._fail_all(SessionLost(f"connection to {self.address} broke while sending: {e}"))
        except asyncio.CancelledError:
            pass
        finally:
            if self.lost is not None:
                try:
                    await asyncio.wait_for(conn.close(), 2.0)
                except Exception:
                    pass
                await self._close_lanes()
                for t in self._tasks[0], self._tasks[2]:  # receiver, heartbeat
                    t.cancel()

    async def _session_says_why(self) -> None:
        """A send failed or a lane ended: let the receiver read the reason the peer sent first (it may lag)."""
        receiver = self._tasks[0]
        if self.lost is None and not receiver.done():
            await asyncio.wait([receiver], timeout=1.0)

    async def _receiver(self) -> None:
        conn = self.conn
        try:
            while True:
                frame = await conn.recv()
                if frame is None:
                    raise SessionLost(f"peer {self.address} closed the session",
                                      hint="the peer process ended or dropped this client (its log says why); "
                                           "tensors do not survive their session: new work reconnects")
                self._on_frame(frame)
                self._reader_idle()
        except asyncio.CancelledError:
            pass
        except BaseException as e:  # noqa: BLE001 - every failure ends the session, with its reason
            self._frame_failed(e)

    def _on_frame(self, frame: Any) -> None:
        """One frame from the peer: complete the requests it answers (the receiver, or an exchange's
        thread). Raises what ends the session (see ``_frame_failed``)."""
        waiters = self._waiters
        self._last_recv = time.monotonic()
        self.stats["bytes_received"] += len(frame)
        if self.data and codec.is_data(frame):
            self._data_frame(frame)
            return
        for req, status, payload in codec.decode_responses(frame, self.max_frame + 4096):
            if req == 0:
                if status == m.ERROR:
                    raise from_wire(payload)
                if status == m.NEED_GRAPH:
                    self._resend_graph(payload)
                    continue
            w = waiters.get(req)
            if w is None:
                continue  # a heartbeat answer, or a request that timed out
            if status == m.CHUNK:
                off, data, total = payload
                if w.buf is None:
                    w.buf = bytearray(total)
                w.buf[off:off + len(data)] = data
                w.done += len(data)
                continue
            waiters.pop(req, None)
            if status == m.OK:
                if w.buf is not None:
                    off, data = payload[2], payload[3]
                    w.buf[off:off + len(data)] = data
                    payload[3] = w.buf
                w.value = payload
            else:
                w.error = from_wire(payload)
            if self._calm is not None:
                self._reader_idle_here()  # (before the caller runs on: its next round trip finds the link calm)
            w.set()

    def _frame_failed(self, e: BaseException) -> None:
        """What reading or handling a frame raised, as the session's end (typed)."""
        if isinstance(e, EmberError):
            self._fail_all(e if isinstance(e, (SessionLost, ProtocolError)) else SessionLost(e.message))
        elif isinstance(e, (ValueError, TypeError, IndexError)):  # a malformed data frame head
            self._fail_all(ProtocolError(f"malformed frame from {self.address}: {e}"))
        elif isinstance(e, (ConnectionError, OSError)):
            self._fail_all(SessionLost(f"connection to {self.address} lost: {e}"))
        else:
            raise e

    def _resend_graph(self, gid: Any) -> None:
        """The peer's cache lost a graph a REPLAY named; it holds the session until it has it again."""
        wire = self._gtable.wire(gid) if isinstance(gid, int) else None
        if wire is None:
            raise ProtocolError(f"the peer asked for graph {gid!r}, which this client never registered")
        frame = codec.packb([wire])
        with self._lock:
            self.stats["graph_resends"] += 1
            self.stats["bytes_sent"] += len(frame)
            self._frames.append(frame)
        self.loop.call_soon_threadsafe(self._wake.set)  # (from the receiver, or an exchange's thread)

    async def _heartbeat(self) -> None:
        try:
            while self.lost is None:
                await asyncio.sleep(self.hb_interval)
                now = time.monotonic()
                if not self._waiters and self._pinged <= self._last_recv:  # idle, nothing unanswered
                    if self.idle_ping is None or now - self._pinged < self.idle_ping:
                        self._last_recv = now  # (silence is no fault while nothing was asked)
                        continue
                    self._pinged = now  # a Ping now and then says we are here, and hears the peer
                elif now - self._last_recv > self.hb_timeout:
                    self._fail_all(SessionLost(
                        f"peer {self.address} did not answer for {now - self._last_recv:.1f} s; it is gone or "
                        "unreachable", hint="check the peer process; new work on this device reconnects"))
                    return
                elif not self._waiters:
                    continue  # an idle Ping is out: its answer, or the timeout above
                with self._lock:
                    self._frames.append(codec.packb([[m.PING, 0]]))
                self._wake.set()
        except asyncio.CancelledError:
            pass

    def _fail_all(self, err: EmberError) -> None:
        if self.lost is None:
            self.lost = err
        for req in list(self._waiters):
            w = self._waiters.pop(req, None)
            if w is not None:
                w.error = err
                w.set()
        try:
            self.loop.call_soon_threadsafe(self._wake.set)
        except RuntimeError:
            pass

    def _lost_error(self) -> EmberError:
        e = self.lost
        assert e is not None
        if isinstance(e, SessionLost):
            return SessionLost(f"this array's session with {self.address} has ended: {e.message}",
                               hint="arrays do not survive their session; new work on the device reconnects")
        return e


# ---- opening a session ------------------------------------------------------------------

async def open_session(conn: FrameConnection, *, address: str, device: int, credential: bytes,
                       timeout: float, session_id: bytes, features: list[str] | None = None,
                       admin: bool = False) -> dict[str, Any]:
    """Handshake on an open connection: send Hello (offering ``features``, default all this
    version speaks), judge the reply, return the Welcome. ``admin``: ask for an admin session
    (``credential`` is the peer's admin token)."""
    await conn.send(codec.encode_hello(session_id=session_id, device=device, credential=credential,
                                       client_version=__version__, features=features, admin=admin))
    try:
        frame = await asyncio.wait_for(conn.recv(), timeout)
    except asyncio.TimeoutError:
        await conn.close()
        raise ConnectError(f"{address} accepted the connection but did not answer Hello within {timeout:g} s",
                           hint="is it an Ember peer? `ember doctor` checks a peer") from None
    if frame is None:
        raise ConnectError(f"{address} closed the connection during the handshake")
    reply = codec.decode_reply(frame)
    if reply["type"] == "welcome":
        if reply.get("protocol") != m.PROTOCOL_VERSION:
            raise ProtocolError(f"protocol version mismatch: this client speaks version {m.PROTOCOL_VERSION}, "
                                f"the peer speaks version {reply.get('protocol')}")
        return reply
    await conn.close()
    code, reason = reply.get("code"), str(reply.get("reason", ""))
    if code == m.REJECT_UNAUTHORIZED:
        raise AuthorizationError(reason, hint="pass the peer's admin token (ember top/status --token T)" if admin
                                 else "pass the peer's credential: ember.connect(address, credential=b'...')")
    if code in (m.REJECT_VERSION, m.REJECT_PROTOCOL):
        raise ProtocolError(reason, hint="install the same ember version on both sides")
    if code == m.REJECT_DEVICE:
        raise ConnectError(reason, hint="ember.devices(address) lists the peer's devices")
    if code in (m.REJECT_LIMIT, m.REJECT_FULL):
        raise ConnectError(f"{address} refused the session: {reason}",
                           hint="close devices you no longer use (dev.close()), or try again later")
    raise ConnectError(f"{address} refused the session: {reason}")


def close_all() -> None:
    for s in list(_sessions):
        try:
            s.close()
        except Exception:
            pass
