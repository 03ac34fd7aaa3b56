"""Executes one session's messages against one device's Array API namespace.

The interpreter owns the session's tensors (``id -> array``). An op that fails
*poisons* its outputs: the error is kept under their ids, ops consuming a
poisoned id poison their own outputs, and reading one answers the error. The
session itself carries on.
"""

from __future__ import annotations

import math

from typing import Any, Callable

import numpy as np

from ...errors import LimitExceeded, ProtocolError, to_wire
from ...protocol import aten as A
from ...protocol import codec, ops
from ...protocol import messages as m
from ...protocol.codec import safe_repr
from ..guard.limits import ClientLimits
from ..guard.memory import DeviceMemory, SessionMemory, footprint_for
from ..telemetry.probe import OFF
from .adapters import adapt
from .answers import Answers
from .backends import Backend, UnknownOp
from .confine import REFUSED_KWARGS, confine, kwargs_fault, scalar_fault
from .graph_cache import MAX_CACHE_BYTES, GraphCache
from .holdings import SMALL, Holdings, _ELEMENTWISE
from .replay import GraphReplay, NeedGraph, Poison, call_text, describe, describe_layouts, written_of
from .sizes import PREDICTED, custom_outputs, upload_fault

_REPLAY = m.REPLAY

#: ``respond(responses)`` sends one frame of responses; ``respond([[req, OK, [dtype, shape, 0, nil, total]]],
#: data)`` sends a read answer whose bytes (a flat byte view of the array) travel in data frames.
Respond = Callable[..., None]


def build_table(backend: Backend) -> dict[str, Callable[..., Any]]:
    """Op name -> callable over the backend, built once per device.

    Whitelisted names resolve against the backend's Array API namespace; the adapters
    (``server/execute/adapters.py``) then fix calling conventions and backend gaps so each op
    returns exactly the shape and dtype the client computed.
    """
    xp, dev = backend.xp, backend.device
    table: dict[str, Callable[..., Any]] = {}
    for name in ops.ALL - ops.INTERNAL:
        mod, _, fname = name.rpartition(".")
        fn = getattr(getattr(xp, mod, None) if mod else xp, fname, None)
        if fn is None:
            continue
        if name in ops.CREATION:
            fn = (lambda f: lambda *a, **k: f(*a, device=dev, **k))(fn)
        elif name in ops.SEQUENCE_ARG:
            fn = (lambda f: lambda *a, **k: f(a, **k))(fn)
        table[name] = fn

    def getitem(x: Any, *arrays: Any, key: list[Any]) -> Any:
        return x[codec.decode_key(key, list(arrays))]

    def setitem(x: Any, value: Any, *arrays: Any, key: list[Any]) -> Any:
        y = xp.asarray(x, copy=True)
        y[codec.decode_key(key, list(arrays))] = value
        return y

    table["getitem"] = getitem
    table["setitem"] = setitem
    table["copy"] = lambda x: xp.asarray(x, copy=True)
    adapt(backend.kind, xp, dev, table)
    confine(table)
    return table


#: Defaults of the per-session limits (``Server(max_uploads=..., max_tensors=...)`` overrides them).
MAX_PARTIAL_UPLOADS = ClientLimits.max_uploads
"""Chunked uploads one session may have half-sent at once (each is charged its declared total)."""
MAX_TENSORS = ClientLimits.max_tensors
"""Tensor ids (values and poisoned ids, each) one session may hold at once."""


class Placed:
    """An upload chunk's ``n`` bytes that the network loop already read into place
    (see ``Interpreter.upload_target``)."""

    __slots__ = ("n",)

    def __init__(self, n: int) -> None:
        self.n = n


#: What the network loop may run itself (see ``Interpreter.cheap``).
INLINE_OPS = ops.ELEMENTWISE
INLINE_MAX_MESSAGES = 16
INLINE_MAX_ELEMENTS = 4096
INLINE_MAX_BYTES = 256 * 1024


def _unbounded() -> SessionMemory:
    return DeviceMemory(None, "unbounded").session(None, "interpreter")


class Interpreter(GraphReplay, Holdings, Answers):
    """State and execution of one session (runs on the session's worker thread)."""

    def __init__(self, backend: Backend, table: dict[str, Callable[..., Any]],
                 custom_ops: dict[str, Callable[..., Any]], respond: Respond,
                 limits: dict[str, int], memory: SessionMemory | None = None) -> None:
        self.backend = backend
        if backend.kind == "torch":  # ATen ops of ember.torch: a per-session table (own random stream)
            from .aten import AtenOps
            table = AtenOps(table, backend.device, int(limits.get("max_tensor", 1 << 40)), memory)
        self.table = table
        self.custom_ops = custom_ops
        self.respond = respond
        self.limits = limits
        self.mem = memory if memory is not None else _unbounded()
        self._aten = backend.kind == "torch"  # ATen kernels may write (and grow) their operands
        self._numpy = backend.kind == "numpy"
        # torch on the CPU: kernels run synchronously, so small elementwise batches may run inline too
        self._inline = self._numpy or (self._aten and getattr(backend.device, "type", None) == "cpu")
        self._fp = footprint_for(backend.kind)
        #: a small storage's own bytes on a torch CPU device (read: no host copy, no dtype round trip)
        self._small_bytes = backend.small_bytes(min(m.INLINE_DATA, int(limits.get("chunk", m.DEFAULT_CHUNK))))
        self.max_tensors = int(limits.get("max_tensors", MAX_TENSORS))
        self.max_uploads = int(limits.get("max_uploads", MAX_PARTIAL_UPLOADS))
        self.tensors: dict[int, Any] = {}
        self.poison: dict[int, Poison] = {}
        self._views: dict[int, set[Any]] = {}  # stored values graph programs cached views of (program.py)
        self.compiler: Any = None  # the peer's Compiler when this session agreed on compiled graphs (compiled.py)
        # id -> (buffer, dtype, shape, total, reserved by the network loop: a shared charge until adopted)
        self._uploads: dict[int, tuple[Any, str, list[int], int, bool]] = {}
        self._out_bytes = 0  # bytes of tensor data in the responses being gathered
        self.on_stall: Callable[[], None] | None = None  # the session arms its stall deadline
        self.on_fatal: Callable[..., None] | None = None  # the session ends itself on a session-level error
        self.fatal: tuple[ProtocolError, bool] | None = None  # such an error, pending the batch's end
        self.on_clear: Callable[[], None] | None = None  # the session frees what it holds for this one (lanes)
        self.data_frames = False  # the client speaks data frames (read answers go out in them)
        self.handlers: tuple[Callable[[list[Any], list[list[Any]]], None] | None, ...] = (
            self.op, self.upload, self.drop, self.read, self.sync, self.custom, self.close, self.sync,
            self.shape, self.graph, self.replay, None, None, None, None, None)
        self.ops_run = 0
        self.cancelled = False  # set from the loop when the session ends (read between ops)
        self.probe, self.label = OFF, ""  # telemetry (server/telemetry/probe.py): the session sets both
        self.graph_hits = self.graph_misses = self.replayed_ops = self.graph_saved = 0
        lim = self.mem.limit or self.mem.device.limit  # graphs may hold a quarter of the budget at most
        self.graphs = GraphCache(int(limits.get("graph_cache", m.DEFAULT_GRAPH_CACHE)), memory=self.mem,
                                 max_bytes=min(MAX_CACHE_BYTES, lim // 4) if lim else MAX_CACHE_BYTES)
        self._stalled: list[list[Any]] | None = None  # REPLAY of an unknown graph + everything after it
        self._stall_gid: Any = None
        self._stalled_bytes = 0  # upload bytes held meanwhile (bounded by replay.MAX_STALLED_BYTES)
        #: set from the loop when a batch is queued: a long replay looks between its steps (``between``) for a small
        #: read that may run now (server/read_ahead.py); ``running``: the worker's batch and the REPLAY it runs
        self.poked = False
        self.between: Callable[[list[list[Any]], list[Any]], None] | None = None
        self.running: tuple[list[list[Any]], list[Any]] | None = None

    def poke(self) -> None:
        """Between two steps of a replay, a batch came (``poked``): the session may run a small read now."""
        self.poked = False
        run = self.running
        if run is not None and self.between is not None:
            out_bytes = self._out_bytes
            try:
                self.between(*run)
            finally:
                self.running, self._out_bytes = run, out_bytes

    def enable_transfers(self, ops: Any) -> None:
        """Route EXPOSE / FETCH / MOVE to ``ops`` (a ``transfer.TransferOps``)."""
        h = list(self.handlers)
        h[m.EXPOSE], h[m.FETCH], h[m.MOVE] = ops.expose, ops.fetch, ops.move
        self.handlers = tuple(h)

    # ---- batch ---------------------------------------------------------------
    def cheap(self, batch: list[list[Any]], direct: bool = False) -> bool:
        """Is this batch certainly cheap to run (bounded microseconds, nothing that can wait)?

        NumPy and torch CPU devices only (a GPU read waits for the device); at most ``INLINE_MAX_MESSAGES``
        messages, each an elementwise op without keyword arguments on arrays of at most ``INLINE_MAX_ELEMENTS``
        elements that do not broadcast each other up (one shape, or size 1), a read of at most
        ``INLINE_MAX_BYTES``, a small upload, a sync or a drop; on torch, also a pointwise or reducing ATen op whose
        operand and output layouts hold at most ``INLINE_MAX_ELEMENTS`` elements (``_cheap_aten``), or with
        ``direct`` (on the caller's own thread: ``Session.direct``) any ``bounded`` ATen op on such layouts (a
        reduction, a matmul, a loss: what precedes ``loss.item()``), at most 16 operands.
        """
        if not self._inline or len(batch) > INLINE_MAX_MESSAGES or self._stalled is not None:
            return False
        try:
            return self._cheap(batch, direct)
        except Exception:  # noqa: BLE001 - hostile fields (an unhashable name...): not cheap, the worker judges
            return False

    def _cheap(self, batch: list[list[Any]], direct: bool) -> bool:
        t, aten = self.tensors, self._aten
        for msg in batch:
            kind = msg[0]
            if kind == m.OP:
                if aten and len(msg) == 6 and type(msg[5]) is dict:
                    if not self._cheap_aten(msg[1], msg[5], direct):
                        return False
                    continue
                if len(msg) != 6 or msg[5] or msg[1] not in INLINE_OPS:
                    return False
                smask, shape = msg[3], None
                i = 0
                for a in msg[2]:
                    if not (smask >> i & 1):
                        v = t.get(a) if type(a) is int else None
                        if v is not None:
                            n = v.numel() if aten else v.size
                            if n > INLINE_MAX_ELEMENTS:
                                return False
                            if n > 1:
                                if shape is None:
                                    shape = v.shape
                                elif v.shape != shape:
                                    return False
                    i += 1
            elif kind == m.READ:
                v = t.get(msg[2]) if len(msg) == 3 and type(msg[2]) is int else None
                if v is not None and v.nbytes > INLINE_MAX_BYTES:
                    return False
            elif kind == m.UPLOAD:  # (nil bytes: they come on lanes, and the worker waits for them)
                if len(msg) != 7 or type(msg[6]) is not int or msg[6] > INLINE_MAX_BYTES or msg[5] is None:
                    return False
            elif kind != m.SYNC and kind != m.DROP:
                return False
        return True

    def _cheap_aten(self, name: Any, kw: dict[str, Any], direct: bool) -> bool:
        """A pointwise or reducing (``direct``: bounded) ATen kernel on small operand and output layouts."""
        if type(name) is not str or not name.startswith("aten.") or \
                not getattr(self.table.get(name), "bounded" if direct else "loop_ok", False):
            return False
        outs = kw.get("o")
        if type(outs) is not list or len(kw.get("l") or ()) > INLINE_MAX_MESSAGES:  # data-dependent outputs
            return False
        for lay in kw.get("l") or ():
            if math.prod(lay[0]) > INLINE_MAX_ELEMENTS:
                return False
        if A.broadcast_numel(kw.get("l") or ()) > INLINE_MAX_ELEMENTS:  # (three small operands may broadcast to 1 GiB)
            return False
        for spec in outs:
            if math.prod(spec[1]) > INLINE_MAX_ELEMENTS or not 0 <= spec[5] <= INLINE_MAX_BYTES:
                return False
        return True

    def run_batch(self, batch: list[list[Any]], received: float = 0.0, inline: bool = False) -> None:
        """Run a batch; ``received`` (perf_counter at its arrival) and ``inline`` only inform telemetry."""
        if self._stalled is not None:
            resumed = self._resume(batch)
            if resumed is None:
                return
            batch = resumed
        rec = self.probe.record() if self.probe.active else None  # telemetry: None unless op events are wanted
        if rec is not None:
            names, times, clock, shapes = rec.names.append, rec.times.append, rec.clock, rec.outputs is not None
        out: list[list[Any]] = []
        self._out_bytes = 0
        self.mem.settle()  # releases other threads queued (exposures used up elsewhere)
        handlers, run_op = self.handlers, self.op
        for msg in batch:
            if self.cancelled:  # the session ended: its queued work stops between ops
                break
            kind = msg[0]
            try:
                if kind == m.OP:
                    run_op(msg, out)
                    if rec is not None:
                        names(msg[1])
                        times(clock())
                        if shapes:
                            rec.add_outputs(self.tensors, msg)
                    continue
                h = handlers[kind]
                if kind == _REPLAY and not inline:
                    self.running = (batch, msg)  # (a long replay may let a small read run between its steps)
                if h is None:
                    self._malformed(msg, out, ProtocolError(f"{m.KIND_NAMES[kind]} is not supported by this peer"))
                else:
                    h(msg, out)
                    if kind == m.READ and out and msg is not batch[-1]:  # work follows (a step's rest, after
                        self._answer_now(out)  # its loss: client/grouping.py): the answer goes first
            except NeedGraph as e:  # hold this REPLAY and all after it until the client re-sends the graph
                i = next(i for i, x in enumerate(batch) if x is msg)
                self._stalled, self._stall_gid, self._stalled_bytes = batch[i:], e.gid, 0
                out.append([0, m.NEED_GRAPH, e.gid])
                self.graph_misses += 1
                self.probe.graph_missed(self.label, e.gid)
                if rec is not None:
                    rec.other(kind, msg, self)
                if self.on_stall is not None:
                    self.on_stall()
                break
            except Exception as e:  # a malformed message: answer it, keep the session
                self._malformed(msg, out, e)
            if rec is not None:
                rec.other(kind, msg, self)
        self.running = None
        self.ops_run += len(batch)
        if out:
            self.respond(out)
        if rec is not None:
            mem = self.mem
            self.probe.batch(self.label, rec, received, inline, mem.held(), mem.device.reserved())

    def _malformed(self, msg: list[Any], out: list[list[Any]], e: Exception) -> None:
        err = e if isinstance(e, ProtocolError) else ProtocolError(
            f"malformed {m.KIND_NAMES[msg[0]]} message: {type(e).__name__}: {str(e)[:200]}")
        req = msg[1] if len(msg) > 1 and msg[0] in (m.READ, m.SYNC, m.SHAPE) and isinstance(msg[1], int) else 0
        self.probe.error(self.label, "ProtocolError", type(e).__name__, None, err.message, False)
        if req:
            out.append([req, m.ERROR, to_wire(err)])

    # ---- ops -------------------------------------------------------------------
    def op(self, msg: list[Any], out: list[list[Any]]) -> None:
        try:
            _, name, args, smask, outs, kwargs = msg
        except ValueError:
            return self._malformed(msg, out, ProtocolError(f"Op message has {len(msg)} fields, expected 6"))
        t = self.tensors
        try:
            fn = self.table[name]
            try:
                vals = [a if smask >> i & 1 else t[a] for i, a in enumerate(args)] if smask else [t[a] for a in args]
            except KeyError:  # a collective still joins its peers with a poisoned input (collectives.py)
                if not getattr(fn, "joins_poisoned", False):
                    raise
                vals = [a if smask >> i & 1 else t.get(a) for i, a in enumerate(args)]
            if smask and not self._aten:  # (torch makes no object tensors; the ATen table checks its scalars)
                bad = scalar_fault(args, smask, self.backend.dtypes)
                if bad is not None:
                    raise TypeError(bad)
            if kwargs:
                if not REFUSED_KWARGS.isdisjoint(kwargs):
                    raise TypeError(kwargs_fault(kwargs))
                if "dtype" in kwargs and kwargs["dtype"] is not None:
                    kwargs["dtype"] = self.backend.dtype(kwargs["dtype"])  # a dtype name, nothing else
                if "axis" in kwargs and type(kwargs["axis"]) is list:
                    kwargs["axis"] = tuple(kwargs["axis"])
            reserved = 0
            if name in PREDICTED:
                if name in _ELEMENTWISE and 0 < len(vals) <= 2:  # the hot path, inlined: small operands
                    a, b = vals[0], vals[-1]
                    na, nb = getattr(a, "nbytes", 0), getattr(b, "nbytes", 0)
                    if not (na < SMALL and nb < SMALL and (not na or not nb or a.shape == b.shape)):
                        reserved = self._reserve_predicted(name, vals, kwargs)
                else:
                    reserved = self._reserve(name, vals, kwargs)
            else:
                reserved = self._reserve_unpredicted(name, vals, kwargs)
            written = self._footprints(fn, args, kwargs) if self._aten else None
            try:
                res = fn(*vals, **kwargs) if kwargs else fn(*vals)
            finally:
                if reserved:
                    self.mem.release(reserved)
            if written:
                self._recharge(written, name)
            if len(outs) == 1:
                self.put(outs[0], res, name)
            else:
                self._put_all(outs, res, name)
        except Exception as e:
            if not isinstance(name, str):
                name = safe_repr(name)
            self._fail(name, args, smask, self._with_written(outs, name, args, kwargs), e, kwargs)

    def _with_written(self, outs: Any, name: str, args: Any, kwargs: Any) -> Any:
        """The ids a failed op poisons: its outputs and the inputs it writes in place."""
        w = written_of(self.table.get(name), args, kwargs)
        if not w:
            return outs
        try:
            return list(outs) + w
        except TypeError:
            return w

    def _why(self, name: str, e: Exception, missing: list[Any]) -> str:
        """What to tell the client about a failed op (unknown names, missing inputs, the error)."""
        if isinstance(e, UnknownOp):
            return str(e)
        if isinstance(e, KeyError) and self.table.get(name) is None and name not in self.custom_ops:
            if name.startswith(("aten.", "torch.")) and self.backend.kind != "torch":
                return (f"ATen op {safe_repr(name)} needs a torch device, and device {self.backend.spec} is a "
                        f"{self.backend.kind} device: serve with --device torch:cpu or --device torch:cuda:N")
            return (f"unknown op {safe_repr(name)}: not an Array API function this peer offers nor a registered "
                    "custom op")
        if isinstance(e, KeyError) and missing:
            return f"input tensor id(s) {missing[:16]} unknown to this session (dropped or never created)"
        return f"{type(e).__name__}: {str(e)[:500]}"

    # ---- memory: what each tensor costs (see server/guard/memory.py) ---------------------------
    def _fail(self, name: str, args: Any, smask: Any, outs: Any, e: Exception, kwargs: Any = None) -> None:
        """Poison ``outs`` with the error (or the upstream poison an input carries)."""
        try:
            ids = [a for i, a in enumerate(args) if not smask >> i & 1 and type(a) is int]
        except TypeError:
            ids = []
        name = name if isinstance(name, str) else safe_repr(name)
        upstream = next((self.poison[i] for i in ids if i in self.poison), None)
        poison = upstream if upstream is not None else self._op_poison(
            name, e, [i for i in ids if i not in self.tensors],
            lambda: describe_layouts(kwargs) or describe([self.tensors.get(i, "?") for i in ids]))
        self._set_poison(outs, poison)

    def custom(self, msg: list[Any], out: list[list[Any]]) -> None:
        _, name, inputs, outs, scalars, specs = msg
        try:
            fn = self.custom_ops.get(name)
            if fn is None:
                raise UnknownOp(f"no custom op named {name!r} is registered on this peer "
                                f"(registered: {sorted(self.custom_ops) or 'none'})")
            vals = [self.tensors[i] for i in inputs]
            need = custom_outputs(specs)  # the declared outputs, checked below: charged before the op runs
            if need:
                self.mem.charge(need, lambda: f"custom op {call_text(name, vals, None)}")
            try:
                res = fn(self.backend.xp, *vals, **(scalars or {}))
            finally:
                self.mem.release(need)
            res = (res,) if len(outs) == 1 and not isinstance(res, (tuple, list)) else tuple(res)
            if len(res) != len(outs):
                raise ValueError(f"custom op {name!r} returned {len(res)} arrays, the client declared {len(outs)}")
            for r, (shape, dtype) in zip(res, specs):
                if tuple(r.shape) != tuple(shape) or str(r.dtype).rsplit(".", 1)[-1] != dtype:
                    raise ValueError(f"custom op {name!r} returned {tuple(r.shape)} {r.dtype}, "
                                     f"the client declared {tuple(shape)} {dtype}")
            self._put_all(outs, res, name)
        except Exception as e:
            self._fail(name, inputs, 0, outs, e)

    # ---- data in / out ------------------------------------------------------------
    def upload(self, msg: list[Any], out: list[list[Any]]) -> None:
        """A whole upload, or one chunk of it (in order; the last one completes it). ``data`` is the
        chunk's bytes, or ``Placed`` when the network loop already read them into place."""
        _, tid, dtype, shape, offset, data, total = msg
        if type(tid) is not int:
            raise ProtocolError(f"Upload of tensor id {safe_repr(tid)}: ids are ints")
        placed = type(data) is Placed
        bad = upload_fault(self.backend, dtype, shape, offset, b"" if placed else data, total,
                            self.limits["max_tensor"], data.n if placed else None)
        if bad is not None:
            self._cancel_upload(tid)
            return self._fail("upload", [], 0, [tid], bad)
        n = data.n if placed else len(data)
        prepaid = 0
        if offset == 0 and n == total and not placed:
            buf: Any = data
        else:
            entry = self._uploads.get(tid)
            if offset == 0 and not placed:  # the first chunk (again?): a fresh buffer, charged first
                self._cancel_upload(tid)
                try:
                    entry = self._new_upload(tid, dtype, shape, total)
                except LimitExceeded as e:
                    return self._fail("upload", [], 0, [tid], e)
            if entry is None or (entry[1], entry[2], entry[3]) != (dtype, shape, total):
                return  # a chunk of an upload that was refused (its id is poisoned) or never began
            if not placed:
                memoryview(entry[0])[offset:offset + n] = data
            if offset + n < total:
                return
            del self._uploads[tid]
            if entry[4]:  # reserved by the network loop: the charge becomes this thread's
                self.mem.adopt_shared(total)
            buf, prepaid = entry[0], total
        self.store_upload(tid, buf, dtype, shape, prepaid)

    def store_upload(self, tid: int, buf: Any, dtype: str, shape: list[int], prepaid: int = 0) -> None:
        """An upload's bytes, all in, become tensor ``tid`` (``prepaid``: what its assembly was charged)."""
        try:
            arr = np.frombuffer(buf, dtype=np.dtype(dtype)).reshape(shape)
            self.put(tid, self.backend.from_host(arr), "upload", prepaid)
            self.poison.pop(tid, None)
        except Exception as e:
            self._fail("upload", [], 0, [tid], e)

    def upload_slot_fault(self, elsewhere: int = 0) -> LimitExceeded | None:
        """Why one more chunked upload may not begin (``elsewhere``: those assembled outside, on lanes)."""
        if len(self._uploads) + elsewhere < self.max_uploads:
            return None
        return LimitExceeded(f"more than {self.max_uploads} chunked uploads in progress in one session "
                             "(max_uploads)", hint="upload one array at a time")

    def _new_upload(self, tid: int, dtype: str, shape: list[int], total: int, loop: bool = False) -> Any:
        """The buffer a chunked upload is assembled in, its declared total charged before it exists
        (``loop``: from the network loop, while the worker may charge the same budget: a shared charge).

        LimitExceeded past ``max_uploads`` or over a memory budget. ``np.empty``: its pages are
        committed as chunks arrive, not for the whole declared total up front."""
        full = self.upload_slot_fault()
        if full is not None:
            raise full
        what = f"upload of tensor {tid} ({tuple(shape)} {dtype})"
        if loop:
            self.mem.shared_reserve(total, what)
        else:
            self.mem.charge(total, what)
        entry = self._uploads[tid] = (np.empty(total, np.uint8), dtype, shape, total, loop)
        return entry

    def _cancel_upload(self, tid: Any) -> None:
        entry = self._uploads.pop(tid, None)
        if entry is not None:
            (self.mem.shared_release if entry[4] else self.mem.release)(entry[3])

    def upload_target(self, tid: Any, dtype: Any, shape: Any, offset: Any, n: int, total: Any) -> memoryview | None:
        """Where the network loop may read an upload chunk's ``n`` bytes straight into (the
        transport's data sink), or None to let it arrive in the frame and go through ``upload``,
        which then answers whatever is wrong. Runs on the network loop, not the worker."""
        if type(tid) is not int or upload_fault(self.backend, dtype, shape, offset, b"", total,
                                                 self.limits["max_tensor"], n) is not None:
            return None
        entry = self._uploads.get(tid)
        if entry is None:
            if offset != 0:
                return None
            try:
                entry = self._new_upload(tid, dtype, shape, total, loop=True)
            except LimitExceeded:
                return None  # the chunk arrives in its frame; upload() refuses it with the reason
        if (entry[1], entry[2], entry[3]) != (dtype, shape, total):
            return None
        return memoryview(entry[0])[offset:offset + n]

    def drop(self, msg: list[Any], out: list[list[Any]]) -> None:
        forget, uploads = self.forget, self._uploads
        for i in msg[1]:
            forget(i)
            if uploads and i in uploads:
                self._cancel_upload(i)

    def close(self, msg: list[Any], out: list[list[Any]]) -> None:
        self.clear()

    def held(self) -> int:
        return len(self.tensors) + len(self.poison)

    def clear(self) -> None:
        """Free everything this session holds, returning each charge (the session may go on)."""
        for tid in list(self.tensors):
            self.forget(tid)
        self.poison.clear()
        for tid in list(self._uploads):
            self._cancel_upload(tid)
        if self.on_clear is not None:
            self.on_clear()
        self.graphs.clear()
        self._stalled = None
