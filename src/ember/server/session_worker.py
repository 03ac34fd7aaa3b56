"""A session on the peer: its interpreter, worker thread and outbox (:class:`Session`).

The pump (:mod:`ember.server.session`) hands each decoded batch to :meth:`Session.submit`,
which runs it inline on the network loop when it is tiny and the worker idle, else queues it
for the session's worker thread; the interpreter's answers come back through
:meth:`Session.respond` to the pump's sender. :meth:`Session.direct` runs a batch on the
caller's own thread (the embedded peer's memory link: no loop, no worker hop) when the session
is idle. Back-pressure on answers (``stage_window``) is counted here; see the pump for the rest.
"""

from __future__ import annotations

from __future__ import annotations

import asyncio
import logging
import contextlib
import queue
import sys
import threading
import time
from collections import deque
from typing import Any, Callable

import numpy as np

from ..errors import EmberError, ProtocolError, to_wire
from ..protocol import codec
from ..protocol import messages as m
from ..transport.base import FrameConnection, frame_bytes
from .execute.interpreter import Interpreter, Placed
from .guard.memory import give_back_freed
from . import read_ahead
from .host import SessionHost
from .lanes import SessionLanes, StripedRead
from .telemetry.probe import transport_of
from .transfer import TransferOps

log = logging.getLogger("ember.server")

KEEPALIVE = codec.packb([[0, m.OK, None]])
#: Decoded batches cost about this many times their frame (uploads: their frame).
DECODED_FACTOR = 8


class Session:
    """A client's session on one device: its interpreter, worker thread and outbox."""

    def __init__(self, server: SessionHost, conn: FrameConnection, hello: dict[str, Any],
                 loop: asyncio.AbstractEventLoop, identity: str = "") -> None:
        self.server = server
        self.conn = conn
        self.session_id: bytes = hello["session_id"]
        self.device_index: int = hello["device"]
        self.peer_id = conn.peer_id
        self.identity = identity
        self.loop = loop
        self.limits = server.client_limits
        self.outbox: asyncio.Queue[Any] = asyncio.Queue()  # frames, (data-frame stream, bytes), None
        self.inbox: queue.SimpleQueue[tuple[list[list[Any]], float, int] | None] = queue.SimpleQueue()
        self.alive = True
        self.on_gone: Callable[[], None] | None = None  # on the loop, once the worker has stopped
        self.sending = False  # a frame is being sent (by the sender task, or inline by the pump)
        self.queued = 0  # batches handed to the worker (written by the loop)
        self.done = 0    # batches the worker finished (written by the worker)
        self.queued_bytes = 0  # their estimated decoded size (written by the loop)
        # frames of the stream the pump has finished with (run inline, queued, or answered), the
        # Hello included: ``direct`` compares it with the frames the client sent
        self.handled = 1
        # one batch runs at a time, whoever runs it (worker, loop inline, a caller's thread: ``direct``)
        self._run_lock = threading.Lock()
        self._direct_out: list[Any] | None = None  # a direct run's answers, collected for its caller
        self.now: list[Any] | None = None  # during an inline run on the loop: its answer, for the pump
        self._direct_thread = 0
        self.done_bytes = 0    # (written by the worker)
        # answers waiting for the network: bytes in (from the worker, from the loop) and out, each
        # written by one thread only, so counting costs no lock; the worker waits on _cond past the window
        self._in_worker = self._in_loop = self._out = 0
        self._waiting = False
        self._cond = threading.Condition()
        self.sender: asyncio.Future[None] | None = None
        self.inline = bool(getattr(server, "inline_small", True))
        self._loop_thread = threading.get_ident()
        # telemetry: who, and plain counters (one addition per frame); see server/telemetry/probe.py
        self.label, self.admin, self.transport = self.session_id.hex(), bool(hello.get("admin")), transport_of(conn)
        self.opened = time.monotonic()
        self.bytes_in = self.bytes_out = self.batches = 0
        self.read_aheads = 0  # batches the worker ran ahead of queued ones (server/read_ahead.py)
        self.reads_between = 0  # of those, run between two steps of a replay under way
        self._pending: deque[Any] = deque()  # taken from the inbox, not run yet (oldest first: the worker's)
        backend = server.backends[self.device_index]
        self.mem = server.budgets[self.device_index].session(server.session_memory, self.session_id.hex()[:8])
        self.interp = Interpreter(backend, server.tables[self.device_index], server.custom_ops,
                                  self.respond, server.welcome_limits(self.device_index), memory=self.mem)
        self.interp.on_stall = self._on_stall
        self.interp.on_fatal = self._on_fatal
        self.transfer_ops = TransferOps(self.interp, server.transfers, loop, server.limits["max_frame"],
                                        max_wait=self.limits.max_wait)
        self.transfer_ops.client = identity
        self.interp.enable_transfers(self.transfer_ops)
        self.features = codec.agreed_features(hello.get("features"))
        if m.COMPILE_FEATURE in self.features:  # compiled graphs: only on a peer started with the option
            if server.compiler is None or backend.kind != "torch":
                self.features.remove(m.COMPILE_FEATURE)
            else:
                self.interp.compiler = server.compiler
        self.data = m.DATA_FEATURE in self.features
        if not self.data and m.LANES_FEATURE in self.features:  # lanes carry data frames
            self.features.remove(m.LANES_FEATURE)
        self.interp.data_frames = self.data
        self.lanes = SessionLanes(self, self._lane_failed) if m.LANES_FEATURE in self.features else None
        self._placed: dict[tuple[int, int], int] = {}  # (upload id, offset) -> bytes the sink put in place
        set_sink = getattr(conn, "set_data_sink", None)
        if self.data and set_sink is not None:
            set_sink(self.sink)
        if hasattr(conn, "direct_handler"):  # a link whose client may run batches here itself (memory)
            conn.direct_handler = self.direct
        self.interp.probe, self.interp.label = server.telemetry, self.label
        handlers = list(self.interp.handlers)
        handlers[m.STATS] = self.stats  # (the pump answers a lone STATS itself)
        if self.lanes is not None:
            handlers[m.UPLOAD] = self._upload
            self.interp.on_clear = self.lanes.clear
        self.interp.handlers = tuple(handlers)
        self.worker = threading.Thread(target=self._work, name=f"ember-session-{self.session_id.hex()[:8]}",
                                       daemon=True)
        server.live.add(self)
        self.worker.start()

    def respond(self, responses: list[list[Any]], data: memoryview | None = None, held: int = 0) -> None:
        """Called on the worker (or the loop, inline): encode once, hand the frame to the network loop.

        With ``data``, ``responses`` is one read answer whose bytes go out as data frames, chunked
        by the sender on the loop (views of the array: nothing is copied here; ``held`` is what the
        views keep alive beyond the session's tensors, a host copy). On the worker, waits while
        more than ``stage_window`` bytes of answers wait to be sent."""
        if data is None:
            frame: Any = codec.packb(responses)
            n = len(frame)
        else:
            req, _, (dt, shape, _, _, _) = responses[0]
            n = held
            if self.lanes is not None and self.lanes.stripes_for(len(data)):  # several streams side by side
                frame = (StripedRead(req, dt, shape, data), n)
            else:
                frame = (codec.read_frames(req, dt, shape, data, self.server.limits["chunk"]), n)
        me = threading.get_ident()
        if self._direct_out is not None and me == self._direct_thread:  # a direct run: back to its caller
            if data is None:
                self._direct_out.append(frame)
            elif type(frame[0]) is StripedRead:
                raise ProtocolError("a direct run cannot stripe a read")  # (no lanes: never)
            else:
                self._direct_out.extend(frame_bytes(parts) for parts in frame[0])
            return
        if me == self._loop_thread:
            self.post(frame, n)
            return
        self._in_worker += n
        try:
            self.loop.call_soon_threadsafe(self.outbox.put_nowait, frame)
        except RuntimeError:  # loop closed: the server is shutting down
            self.alive = False
            return
        window = self.limits.stage_window
        if self.staged > window:
            with self._cond:
                self._waiting = True
                while self.staged > window and self.alive:
                    self._cond.wait(1.0)
                self._waiting = False

    @property
    def staged(self) -> int:
        """Bytes of answers waiting for the network (bounded by ``stage_window``, in the session's figures)."""
        return self._in_worker + self._in_loop - self._out

    def post(self, frame: Any, n: int | None = None) -> None:
        """On the loop: queue a frame (or a ``(data-frame stream, bytes)`` pair) for the sender,
        counted until it has left."""
        self._in_loop += len(frame) if n is None else n
        now = self.now
        if now is not None and not now and not self.sending and self.outbox.empty():
            now.append(frame)  # an inline run's one answer: the pump sends it, the sender task sleeps on
            return
        if now:  # a second answer: all of them the ordinary way, in order
            for f in now:
                self.outbox.put_nowait(f)
            now.clear()
        self.outbox.put_nowait(frame)

    def sent(self, n: int) -> None:
        """On the loop: a frame of ``n`` bytes has left."""
        self._out += n
        if self._waiting:
            with self._cond:
                self._cond.notify_all()

    def _work(self) -> None:
        with np.errstate(all="ignore"):  # IEEE semantics: nan/inf results, no warnings
            self._work_loop()
        with self._run_lock:  # (a direct run may be under way on a caller's thread)
            self.interp.clear()
        self.server.transfers.revoke(self.transfer_ops)
        self.mem.close()
        self.server.live.discard(self)
        if self.mem.peak >= 1 << 20 or not self.server.live:
            give_back_freed(force=not self.server.live)
        gone = self.on_gone
        if gone is not None:  # the session counted against its client until now
            try:
                self.loop.call_soon_threadsafe(gone)
            except RuntimeError:  # the loop is closed: the server is gone too
                pass

    def _upload(self, msg: list[Any], out: list[list[Any]]) -> None:
        """UPLOAD with lanes agreed: nil bytes mean they come on the lanes (``server.lanes``)."""
        if len(msg) == 7 and msg[5] is None:
            assert self.lanes is not None
            self.lanes.finish(msg, out)
        else:
            self.interp.upload(msg, out)

    def _lane_failed(self, err: EmberError) -> None:
        """On the loop: a lane broke, or brought what it must not; the session ends."""
        if self.alive:
            asyncio.ensure_future(end_session(self, err))

    def stats(self, msg: list[Any], out: list[list[Any]]) -> None:
        """STATS (in a batch, in order; alone, the pump answers it at once): figures, see server/telemetry/figures.py."""
        resp = self.server.figures.answer(self, msg)
        if resp is not None:
            out.append(resp)

    def _work_loop(self) -> None:
        inbox, interp = self.inbox, self.interp
        pending = self._pending
        interp.between = self._between
        while True:
            if not pending:
                pending.append(inbox.get())
            self._take_inbox()
            first = pending[0]
            item = read_ahead.take(pending, interp)
            if item is None or not self.alive:
                break
            with self._run_lock:
                self._run_item(item, item is not first)

    def _take_inbox(self) -> None:
        """Move what else came into ``_pending`` (a small read among it may overtake the rest)."""
        pending, inbox = self._pending, self.inbox
        while len(pending) < read_ahead.MAX_SCAN:
            try:
                pending.append(inbox.get_nowait())
            except queue.Empty:
                break

    def _run_item(self, item: Any, ahead: bool) -> None:
        """Run a queued ``(batch, received, cost)`` (``ahead``: out of turn), on the worker."""
        if ahead:
            self.read_aheads += 1
        batch, received, cost = item
        try:
            self._run(batch, received, False)
        finally:
            if cost is not None:  # (None: the part of a batch that overtook queued work; its rest counts it)
                self.mem.shared_release(cost)
                self.done_bytes += cost
                self.done += 1

    def _between(self, batch: list[list[Any]], msg: list[Any]) -> None:
        """On the worker, between two steps of the REPLAY ``msg`` of ``batch`` (a batch came meanwhile): run a
        small read that overtakes the rest of the batch and the queued work before it (``read_ahead.take_during``),
        so that its answer need not wait for the whole replay (Hugging Face's ``isinf(loss)`` during the backward)."""
        if not self.alive or self.interp.probe.active:
            return
        self._take_inbox()
        i = next((i for i, x in enumerate(batch) if x is msg), None)
        item = None if i is None else read_ahead.take_during(self._pending, batch[i:], self.interp)
        if item is not None:
            self.reads_between += 1
            self._run_item(item, True)

    async def send_frames(self, conn: FrameConnection, frames: Any) -> None:
        """Send data frames ``(prefix, payload)`` on ``conn`` (the session stream or a lane), counted."""
        for parts in frames:
            self.bytes_out += len(parts[0]) + len(parts[1])
            await conn.send(parts)

    def _run(self, batch: list[list[Any]], received: float, inline: bool) -> None:
        """Run one batch (on the worker, or inline on the loop); a session-level error it raised ends
        the session."""
        try:
            self.interp.run_batch(batch, received, inline)
        except Exception:  # never let one batch kill the worker (or the loop)
            log.exception("session %s: batch failed", self.session_id.hex()[:8])
        fatal, self.interp.fatal = self.interp.fatal, None
        if fatal is not None:
            self._on_fatal(*fatal)

    def _run_here(self, batch: list[list[Any]], received: float) -> None:
        """Run a batch on this thread (inline on the loop, or a caller's: ``direct``), with NumPy's IEEE
        semantics (nan/inf results, no warnings) as on the worker; a torch device computes nothing with
        NumPy, so it runs without that (costly) context."""
        if self.interp._aten:
            self._run(batch, received, True)
            return
        with np.errstate(all="ignore"):
            self._run(batch, received, True)

    def submit(self, batch: list[list[Any]], frame_bytes: int = 0) -> bool:
        """On the loop: run a tiny, cheap batch inline when the worker is idle (True), else queue it."""
        received = time.perf_counter() if self.interp.probe.active else 0.0
        if self.inline and self.queued == self.done and self.interp.cheap(batch) and self._run_lock.acquire(False):
            self.now = []
            try:
                self._run_here(batch, received)
            finally:
                self._run_lock.release()
            return True
        cost = frame_bytes if batch[0][0] == m.UPLOAD else frame_bytes * DECODED_FACTOR
        self.mem.shared_charge(cost)
        self.queued_bytes += cost
        self.queued += 1
        self.inbox.put((batch, received, cost))
        if read_ahead.may_read(batch):
            self.interp.poked = True  # (a replay under way looks at it between two steps)
        return False

    def direct(self, frame: bytes, sent: int) -> list[bytes] | None:
        """Run ``frame``'s batch on the calling thread, now, and return its answers (frames); None
        when it cannot, and the frame must take the ordinary way (the link, the pump).

        The embedded peer's memory link calls this from the client's thread
        (``MemoryConnection.direct``): user thread -> interpreter -> user thread, with no loop and
        no worker in between. Only while the session is idle: every frame the client sent before
        (``sent``) handled by the pump, none waiting for or running on the worker, no other run
        under way (the run lock), and only batches the loop itself would run inline
        (``Interpreter.cheap``: bounded, nothing that waits for the loop; ``direct``: any bounded ATen op on
        small layouts, not only a pointwise one: it blocks no loop, only its own caller)."""
        if not self.alive or self.lanes is not None or not self.inline or self.handled != sent \
                or self.queued != self.done or not self._run_lock.acquire(False):
            return None
        try:
            if self.handled != sent or self.queued != self.done or not self.alive:
                return None
            limits = self.limits
            try:
                batch = codec.decode_batch(frame, self.server.limits["max_frame"] + 4096, limits.max_messages)
            except ProtocolError:
                return None  # the pump says why, and ends the session
            if not batch or batch[0][0] in (m.PING, m.STATS, m.EXPOSE, m.CLOSE) or not self.interp.cheap(batch, True):
                return None
            torch_state = _caller_torch_state() if self.interp._aten else _AS_IS
            if torch_state is None:
                return None
            received = time.perf_counter() if self.interp.probe.active else 0.0
            self.bytes_in += len(frame)
            self.batches += 1
            out = self._direct_out = []
            self._direct_thread = threading.get_ident()
            try:
                with torch_state:
                    self._run_here(batch, received)
            finally:
                self._direct_out = None
            for f in out:
                self.bytes_out += len(f)
            return out
        finally:
            self._run_lock.release()

    def inflight(self) -> int:
        """Estimated bytes of decoded batches waiting for the worker (read on the loop)."""
        return self.queued_bytes - self.done_bytes

    def stop(self) -> None:
        self.alive = False
        self.interp.cancelled = True
        self.inbox.put(None)
        if self.lanes is not None:
            self.lanes.stop()
        with self._cond:
            self._cond.notify_all()

    # ---- a REPLAY waiting for a GRAPH the client never sends --------------------------------
    def _on_stall(self) -> None:
        """On the worker (or the loop): the interpreter began holding messages for a graph."""
        token = self.interp._stalled
        try:
            self.loop.call_soon_threadsafe(self.loop.call_later, self.limits.stall_timeout, self._check_stall, token)
        except RuntimeError:
            pass

    def _on_fatal(self, err: ProtocolError, answered: bool = False) -> None:
        """After a batch (worker or loop): a session-level error in it (a malformed GRAPH, a stall
        overflow) ends the session, once that batch's answers are queued."""
        def end() -> None:
            asyncio.ensure_future(end_session(self, err, notify=not answered))
        if threading.get_ident() == self._loop_thread:
            end()
            return
        try:
            self.loop.call_soon_threadsafe(end)
        except RuntimeError:
            pass

    def _check_stall(self, token: Any) -> None:
        if self.alive and token is not None and self.interp._stalled is token:
            err = ProtocolError(f"a Replay waited {self.limits.stall_timeout:g} s for graph "
                                f"{self.interp._stall_gid} (NEED_GRAPH) that the client never sent")
            log.info("session %s: %s", self.session_id.hex()[:8], err.message)
            asyncio.ensure_future(end_session(self, err))

    # ---- data frames (on the loop) ---------------------------------------------------
    def sink(self, head: memoryview, n: int) -> memoryview | None:
        """The transport's data sink: where an upload chunk's payload should be read into."""
        try:
            h = codec.decode_data_head(head)
        except ProtocolError:
            return None
        if not codec.is_upload_head(h):
            return None
        dest = self.interp.upload_target(h[1], h[2], h[3], h[4], n, h[6])
        if dest is not None:
            self._placed[(h[1], h[4])] = n
        return dest

    def data_message(self, frame: Any) -> list[Any]:
        """The UPLOAD message a data frame carries (its bytes, or ``Placed`` when the sink put them)."""
        head, payload = codec.decode_data(frame)
        if not codec.is_upload_head(head):
            raise ProtocolError(f"a data frame from a client must carry one Upload, got {str(head)[:80]}")
        placed = self._placed.pop((head[1], head[4]), None) if not len(payload) else None
        head[5] = Placed(placed) if placed is not None else payload
        self.bytes_in += placed or 0  # (the transport read those bytes straight into place)
        return head


async def end_session(session: Session, err: EmberError, notify: bool = True) -> None:
    """Tell the client why (a session-level error; ``notify=False``: it was told), then close its stream."""
    session.alive = False
    session.end = ["protocol_error", err.message]
    if notify:
        session.post(codec.packb([[0, m.ERROR, to_wire(err)]]))
    session.outbox.put_nowait(None)
    if session.sender is not None:
        try:
            await asyncio.wait_for(asyncio.shield(session.sender), 5.0)
        except Exception:  # noqa: BLE001
            pass
    await close_quietly(session.conn)




async def close_quietly(conn: FrameConnection) -> None:
    """Close, reading (and dropping) whatever the client still sends meanwhile: a WebSocket's close
    handshake needs the client's close frame, queued behind the frames nobody reads any more."""
    async def drain() -> None:
        try:
            while await conn.recv() is not None:
                pass
        except Exception:  # noqa: BLE001 - broken or closed: done
            pass
    reader = asyncio.ensure_future(drain())
    try:
        await asyncio.wait_for(conn.close(), 5.0)
    except Exception:
        pass
    finally:
        reader.cancel()


def _caller_torch_state() -> Any:
    """What a caller's thread must run a direct batch's torch kernels under, to run them as the worker does:
    None when it cannot (a ``torch.autocast`` region or a ``TorchDispatchMode`` of the user's around the
    read would reach the peer's kernels: the batch takes the worker); else a context (inference mode off:
    the peer's tensors are made as on the worker)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return _AS_IS
    c = torch._C
    if c._is_any_autocast_enabled() or c._len_torch_dispatch_stack():
        return None
    return c._InferenceMode(False) if torch.is_inference_mode_enabled() else _AS_IS


_AS_IS = contextlib.nullcontext()  # (reusable: it keeps no state)


__all__ = ["Session", "end_session", "close_quietly", "KEEPALIVE", "DECODED_FACTOR"]
