"""Executes one session's messages against one device's Array API namespace.

The interpreter owns the session's tensors (``id -> array``). An op that fails
*poisons* its outputs: the error is kept under their ids, ops consuming a
poisoned id poison their own outputs, and reading one answers the error. The
session itself carries on.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..errors import LimitExceeded, ProtocolError, RemoteExecutionError, to_wire
from ..protocol import codec, ops
from ..protocol import messages as m
from .adapters import adapt
from .backends import Backend, UnknownOp
from .graph_cache import GraphCache, compile_graph
from .telemetry import OFF

#: ``respond(responses)`` sends one frame of responses; ``respond([[req, OK, [dtype, shape, 0, nil, total]]],
#: data)`` sends a read answer whose bytes (a flat byte view of the array) travel in data frames.
Respond = Callable[..., None]


def build_table(backend: Backend) -> dict[str, Callable[..., Any]]:
    """Op name -> callable over the backend, built once per device.

    Whitelisted names resolve against the backend's Array API namespace; the adapters
    (``server/adapters.py``) then fix calling conventions and backend gaps so each op
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
    return table


#: Chunked uploads one session may have half-sent at once (each holds a buffer of its full size).
MAX_PARTIAL_UPLOADS = 64


def store_results(store: Any, outs: list[int], res: Any, name: str) -> None:
    """Put a multi-output op's results under their ids (or registers)."""
    if len(res) != len(outs):
        raise ValueError(f"{name} returned {len(res)} results for {len(outs)} outputs")
    for o, r in zip(outs, res):
        store[o] = r


class Poison:
    """Why a tensor has no value."""

    __slots__ = ("error",)

    def __init__(self, error: dict[str, Any]) -> None:
        self.error = error


class Placed:
    """An upload chunk's ``n`` bytes that the network loop already read into place
    (see ``Interpreter.upload_target``)."""

    __slots__ = ("n",)

    def __init__(self, n: int) -> None:
        self.n = n


class _Missing:
    """A replay input id the session does not hold (in a replay's register file)."""

    __slots__ = ("tid",)

    def __init__(self, tid: Any) -> None:
        self.tid = tid


class NeedGraph(Exception):
    """A REPLAY named a graph the cache does not hold."""

    def __init__(self, gid: Any) -> None:
        super().__init__(gid)
        self.gid = gid


#: Messages a stalled session (waiting for a GRAPH it asked for) holds, at most.
MAX_STALLED = 1 << 20

#: What the network loop may run itself (see ``Interpreter.cheap``).
INLINE_OPS = ops.ELEMENTWISE
INLINE_MAX_MESSAGES = 16
INLINE_MAX_ELEMENTS = 4096
INLINE_MAX_BYTES = 256 * 1024


def _describe_layouts(kwargs: Any) -> str:
    """An ATen call's operands as the client sees them (from its layouts), e.g. ``(4, 3) float32``."""
    try:
        return ", ".join(f"{tuple(lay[0])} {lay[3]}" for lay in kwargs["l"]) if "l" in kwargs else ""
    except Exception:
        return ""


def _describe(vals: list[Any]) -> str:
    parts = []
    for v in vals:
        shape = getattr(v, "shape", None)
        parts.append(f"{tuple(shape)} {getattr(v, 'dtype', '')}".strip() if shape is not None else repr(v))
    return ", ".join(parts)


class Interpreter:
    """State and execution of one session (runs on the session's worker thread)."""

    def __init__(self, backend: Backend, table: dict[str, Callable[..., Any]],
                 custom_ops: dict[str, Callable[..., Any]], respond: Respond,
                 limits: dict[str, int]) -> None:
        self.backend = backend
        if backend.kind == "torch":  # ATen ops of ember.torch: a per-session table (own random stream)
            from .aten import AtenOps
            table = AtenOps(table, backend.device, int(limits.get("max_tensor", 1 << 40)))
        self.table = table
        self.custom_ops = custom_ops
        self.respond = respond
        self.limits = limits
        self.tensors: dict[int, Any] = {}
        self.poison: dict[int, Poison] = {}
        self._uploads: dict[int, tuple[Any, str, list[int]]] = {}
        self.data_frames = False  # the client speaks data frames (read answers go out in them)
        self.handlers: tuple[Callable[[list[Any], list[list[Any]]], None] | None, ...] = (
            self.op, self.upload, self.drop, self.read, self.sync, self.custom, self.close, self.sync,
            self.shape, self.graph, self.replay, None, None, None, None, None)
        self.ops_run = 0
        self.probe, self.label = OFF, ""  # telemetry (server/telemetry.py): the session sets both
        self.graph_hits = self.graph_misses = self.replayed_ops = self.graph_saved = 0
        self.graphs = GraphCache(int(limits.get("graph_cache", m.DEFAULT_GRAPH_CACHE)))
        self._stalled: list[list[Any]] | None = None  # REPLAY of an unknown graph + everything after it
        self._stall_gid: Any = None

    def enable_transfers(self, ops: Any) -> None:
        """Route EXPOSE / FETCH / MOVE to ``ops`` (a ``transfer.TransferOps``)."""
        h = list(self.handlers)
        h[m.EXPOSE], h[m.FETCH], h[m.MOVE] = ops.expose, ops.fetch, ops.move
        self.handlers = tuple(h)

    # ---- batch ---------------------------------------------------------------
    def cheap(self, batch: list[list[Any]]) -> bool:
        """Is this batch certainly cheap to run (bounded microseconds, nothing that can wait)?

        NumPy devices only (a GPU read waits for the device); at most
        ``INLINE_MAX_MESSAGES`` messages, each an elementwise op without keyword
        arguments on arrays of at most ``INLINE_MAX_ELEMENTS`` elements that do not
        broadcast each other up (one shape, or size 1), a read of at most
        ``INLINE_MAX_BYTES``, a small upload, a sync or a drop.
        """
        if self.backend.kind != "numpy" or len(batch) > INLINE_MAX_MESSAGES or self._stalled is not None:
            return False
        t = self.tensors
        for msg in batch:
            kind = msg[0]
            if kind == m.OP:
                if len(msg) != 6 or msg[5] or msg[1] not in INLINE_OPS:
                    return False
                smask, shape = msg[3], None
                i = 0
                for a in msg[2]:
                    if not (smask >> i & 1):
                        v = t.get(a) if type(a) is int else None
                        if v is not None:
                            n = v.size
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
            elif kind == m.UPLOAD:
                if len(msg) != 7 or type(msg[6]) is not int or msg[6] > INLINE_MAX_BYTES:
                    return False
            elif kind != m.SYNC and kind != m.DROP:
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
        handlers, run_op = self.handlers, self.op
        for msg in batch:
            kind = msg[0]
            if kind == m.OP:
                run_op(msg, out)
                if rec is not None:
                    names(msg[1])
                    times(clock())
                    if shapes:
                        rec.add_outputs(self.tensors, msg)
                continue
            h = handlers[kind]
            if h is None:
                self._malformed(msg, out, ProtocolError(f"{m.KIND_NAMES[kind]} is not supported by this peer"))
            else:
                try:
                    h(msg, out)
                except NeedGraph as e:  # hold this REPLAY and all after it until the client re-sends the graph
                    i = next(i for i, x in enumerate(batch) if x is msg)
                    self._stalled, self._stall_gid = batch[i:], e.gid
                    out.append([0, m.NEED_GRAPH, e.gid])
                    self.graph_misses += 1
                    self.probe.graph_missed(self.label, e.gid)
                    if rec is not None:
                        rec.other(kind, msg, self)
                    break
                except Exception as e:  # a malformed message: answer it, keep the session
                    self._malformed(msg, out, e)
            if rec is not None:
                rec.other(kind, msg, self)
        self.ops_run += len(batch)
        if out:
            self.respond(out)
        if rec is not None:
            self.probe.batch(self.label, rec, received, inline)

    def _resume(self, batch: list[list[Any]]) -> list[list[Any]] | None:
        """Stalled: register the awaited GRAPH if this batch brings it, then run everything held, in order."""
        stalled, gid = self._stalled, self._stall_gid
        assert stalled is not None
        for msg in batch:
            if msg[0] == m.GRAPH and len(msg) > 1 and msg[1] == gid:
                out: list[list[Any]] = []
                self.graph(msg, out)
                if out:
                    self.respond(out)
                break
        else:
            stalled.extend(batch)
            if len(stalled) > MAX_STALLED:
                self._stalled = None
                self.respond([[0, m.ERROR, to_wire(ProtocolError(
                    f"the session waited for graph {gid} past {MAX_STALLED} messages; the client never sent it"))]])
            return None
        self._stalled = self._stall_gid = None
        stalled.extend(batch)
        return stalled

    def _malformed(self, msg: list[Any], out: list[list[Any]], e: Exception) -> None:
        err = e if isinstance(e, ProtocolError) else ProtocolError(f"malformed {m.KIND_NAMES[msg[0]]} message: {e}")
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
            vals = [a if smask >> i & 1 else t[a] for i, a in enumerate(args)] if smask else [t[a] for a in args]
            fn = self.table[name]
            if kwargs:
                if "dtype" in kwargs and type(kwargs["dtype"]) is str:
                    kwargs["dtype"] = self.backend.dtype(kwargs["dtype"])
                if "axis" in kwargs and type(kwargs["axis"]) is list:
                    kwargs["axis"] = tuple(kwargs["axis"])
                res = fn(*vals, **kwargs)
            else:
                res = fn(*vals)
            if len(outs) == 1:
                t[outs[0]] = res
            else:
                store_results(t, outs, res, name)
        except Exception as e:
            if not isinstance(name, str):
                name = repr(name)
            self._fail(name, args, smask, list(outs) + self._written(name, args, kwargs), e, kwargs)

    def _written(self, name: str, args: Any, kwargs: Any) -> list[Any]:
        """Ids of the inputs an op writes in place (ATen in-place and out= ops): poisoned when it fails."""
        w = getattr(self.table.get(name), "written", None)
        if w is None:
            return []
        try:
            return [args[p] for p in w(kwargs) if p < len(args)]
        except Exception:
            return []

    def _why(self, name: str, e: Exception, missing: list[Any]) -> str:
        """What to tell the client about a failed op (unknown names, missing inputs, the error)."""
        if isinstance(e, UnknownOp):
            return str(e)
        if isinstance(e, KeyError) and self.table.get(name) is None and name not in self.custom_ops:
            if name.startswith(("aten.", "torch.")) and self.backend.kind != "torch":
                return (f"ATen op {name!r} needs a torch device, and device {self.backend.spec} is a "
                        f"{self.backend.kind} device: serve with --device torch:cpu or --device torch:cuda:N")
            return f"unknown op {name!r}: not an Array API function this peer offers nor a registered custom op"
        if isinstance(e, KeyError) and missing:
            return f"input tensor id(s) {missing} unknown to this session (dropped or never created)"
        return f"{type(e).__name__}: {e}"

    def _fail(self, name: str, args: Any, smask: int, outs: Any, e: Exception, kwargs: Any = None) -> None:
        """Poison ``outs`` with the error (or the upstream poison an input carries)."""
        try:
            ids = [a for i, a in enumerate(args) if not smask >> i & 1]
        except TypeError:
            ids = []
        upstream = next((self.poison[i] for i in ids if i in self.poison), None)
        if upstream is not None:
            poison = upstream
        else:
            msg = self._why(name, e, [i for i in ids if i not in self.tensors])
            desc = _describe_layouts(kwargs) or _describe([self.tensors.get(i, "?") for i in ids])
            poison = Poison({"kind": "RemoteExecutionError", "op": name,
                             "message": f"op {name}({desc}) failed on {self.backend.spec}: {msg}"})
            self.probe.error(self.label, "RemoteExecutionError", type(e).__name__, name, poison.error["message"], True)
        try:
            for o in outs:
                self.tensors.pop(o, None)
                self.poison[o] = poison
        except TypeError:
            pass

    # ---- graphs ---------------------------------------------------------------------
    def graph(self, msg: list[Any], out: list[list[Any]]) -> None:
        """Register (or refresh) a graph. A malformed one is a client bug: a session-level error."""
        try:
            g = compile_graph(msg, self.table, self.backend)
        except ProtocolError as e:
            out.append([0, m.ERROR, to_wire(e)])
            return
        evicted = self.graphs.evictions
        self.graphs.put(g)
        if self.graphs.evictions != evicted:
            self.probe.graph_evicted(self.label, self.graphs.evictions - evicted)

    def replay(self, msg: list[Any], out: list[list[Any]]) -> None:
        """Run a registered graph: the same ops, the same poisoning, as if each op had been sent."""
        _, gid, ins, outs, scal = msg
        g = self.graphs.get(gid)
        if g is None:
            raise NeedGraph(gid)
        n_in = g.n_in
        if type(outs) is int:  # dense ids: output register r gets id outs + r - (first output register)
            first = outs - n_in - g.n_s
            outs = [first + r for r in g.kept]
        if len(ins) != n_in or len(outs) != len(g.kept) or len(scal) % 2:
            raise ProtocolError(f"Replay of graph {gid} binds {len(ins)} inputs and {len(outs)} outputs; "
                                f"the graph has {n_in} and {len(g.kept)}")
        self.graph_hits += 1
        self.replayed_ops += g.n_ops
        self.graph_saved += g.saved
        t, poison = self.tensors, self.poison
        R: list[Any] = [None] * g.n_reg
        spoiled: dict[Any, Poison] = {}
        bad = False
        for k, i in enumerate(ins):
            v = t.get(i)
            if v is None:
                v = poison.get(i) or _Missing(i)
                bad = True
            R[k] = v
        R[n_in:n_in + g.n_s] = g.scalars
        for j in range(0, len(scal), 2):
            idx = scal[j]
            if type(idx) is not int or not 0 <= idx < g.n_s:
                raise ProtocolError(f"Replay of graph {gid} overrides scalar {idx!r} of {g.n_s}")
            R[n_in + idx] = scal[j + 1]
        for fn, regs, oregs, kw, name, tregs, err in g.steps:
            try:
                if bad:
                    for r in tregs:
                        v = R[r]
                        if type(v) is Poison or type(v) is _Missing:
                            raise KeyError(v.tid if type(v) is _Missing else name)
                if fn is None:
                    raise KeyError(name)
                if err is not None:
                    raise err
                if kw:
                    res = fn(*[R[r] for r in regs], **kw)
                else:
                    res = fn(*[R[r] for r in regs])
                if len(oregs) == 1:
                    R[oregs[0]] = res
                else:
                    store_results(R, oregs, res, name)
            except Exception as e:
                p = self._replay_poison(name, [R[r] for r in tregs], e, kw)
                for o in oregs:
                    R[o] = p
                for r in self._written_regs(fn, regs, kw):  # in-place ops poison what they write
                    R[r] = p
                    if r < n_in:
                        spoiled[ins[r]] = p
                bad = True
        for i, p in spoiled.items():
            t.pop(i, None)
            poison[i] = p
        for reg, oid in zip(g.kept, outs):
            v = R[reg]
            if type(v) is Poison:
                t.pop(oid, None)
                poison[oid] = v
            else:
                t[oid] = v
        for k in g.consumed:
            i = ins[k]
            if t.pop(i, None) is None:
                poison.pop(i, None)

    @staticmethod
    def _written_regs(fn: Any, regs: tuple[int, ...], kw: Any) -> list[int]:
        w = getattr(fn, "written", None)
        if w is None:
            return []
        try:
            return [regs[p] for p in w(kw or {}) if p < len(regs)]
        except Exception:
            return []

    def _replay_poison(self, name: str, vals: list[Any], e: Exception, kw: Any = None) -> Poison:
        """What ``_fail`` would have made of this op sent alone (same message, same upstream poison)."""
        upstream = next((v for v in vals if type(v) is Poison), None)
        if upstream is not None:
            return upstream
        msg = self._why(name, e, [v.tid for v in vals if type(v) is _Missing])
        desc = _describe_layouts(kw) or _describe(["?" if type(v) is _Missing else v for v in vals])
        p = Poison({"kind": "RemoteExecutionError", "op": name,
                    "message": f"op {name}({desc}) failed on {self.backend.spec}: {msg}"})
        self.probe.error(self.label, "RemoteExecutionError", type(e).__name__, name, p.error["message"], True)
        return p

    def custom(self, msg: list[Any], out: list[list[Any]]) -> None:
        _, name, inputs, outs, scalars, specs = msg
        try:
            fn = self.custom_ops.get(name)
            if fn is None:
                raise UnknownOp(f"no custom op named {name!r} is registered on this peer "
                                f"(registered: {sorted(self.custom_ops) or 'none'})")
            vals = [self.tensors[i] for i in inputs]
            res = fn(self.backend.xp, *vals, **(scalars or {}))
            res = (res,) if len(outs) == 1 and not isinstance(res, (tuple, list)) else tuple(res)
            if len(res) != len(outs):
                raise ValueError(f"custom op {name!r} returned {len(res)} arrays, the client declared {len(outs)}")
            for r, (shape, dtype) in zip(res, specs):
                if tuple(r.shape) != tuple(shape) or str(r.dtype).rsplit(".", 1)[-1] != dtype:
                    raise ValueError(f"custom op {name!r} returned {tuple(r.shape)} {r.dtype}, "
                                     f"the client declared {tuple(shape)} {dtype}")
            for o, r in zip(outs, res):
                self.tensors[o] = r
        except Exception as e:
            self._fail(name, inputs, 0, outs, e)

    # ---- data in / out ------------------------------------------------------------
    def upload(self, msg: list[Any], out: list[list[Any]]) -> None:
        """A whole upload, or one chunk of it (in order; the last one completes it). ``data`` is the
        chunk's bytes, or ``Placed`` when the network loop already read them into place."""
        _, tid, dtype, shape, offset, data, total = msg
        if total > self.limits["max_tensor"]:
            self._uploads.pop(tid, None)
            return self._fail("upload", [], 0, [tid], LimitExceeded(
                f"upload of {total} bytes exceeds this peer's max_tensor of {self.limits['max_tensor']} bytes"))
        placed = type(data) is Placed
        n = data.n if placed else len(data)
        if offset == 0 and n == total and not placed:
            buf: Any = data
        else:
            entry = self._uploads.get(tid)
            if entry is None and offset == 0 and not placed:
                entry = self._new_upload(tid, dtype, shape, total)
                if entry is None:
                    return self._fail("upload", [], 0, [tid], LimitExceeded(
                        f"more than {MAX_PARTIAL_UPLOADS} chunked uploads in progress in one session"))
            if entry is None:
                raise ProtocolError(f"chunk at offset {offset} of upload {tid}, which has no first chunk")
            if not placed:
                memoryview(entry[0])[offset:offset + n] = data
            if offset + n < total:
                return
            del self._uploads[tid]
            buf = entry[0]
        try:
            arr = np.frombuffer(buf, dtype=np.dtype(dtype)).reshape(shape)
            self.tensors[tid] = self.backend.from_host(arr)
            self.poison.pop(tid, None)
        except Exception as e:
            self._fail("upload", [], 0, [tid], e)

    def _new_upload(self, tid: int, dtype: str, shape: list[int], total: int) -> Any:
        """The buffer a chunked upload is assembled in, or None past ``MAX_PARTIAL_UPLOADS``."""
        if len(self._uploads) >= MAX_PARTIAL_UPLOADS:
            return None
        entry = self._uploads[tid] = (np.empty(total, np.uint8), dtype, shape)
        return entry

    def upload_target(self, tid: Any, dtype: Any, shape: Any, offset: Any, n: int, total: Any) -> memoryview | None:
        """Where the network loop may read an upload chunk's ``n`` bytes straight into (the
        transport's data sink), or None to let it arrive in the frame and go through ``upload``,
        which then answers whatever is wrong. Runs on the network loop, not the worker."""
        if type(tid) is not int or type(offset) is not int or type(total) is not int:
            return None
        if not 0 <= offset <= total - n or total > self.limits["max_tensor"]:
            return None
        entry = self._uploads.get(tid)
        if entry is None:
            if offset != 0:
                return None
            try:
                if np.dtype(dtype).itemsize * int(np.prod(shape, dtype=np.int64)) != total:
                    return None
            except (TypeError, ValueError, OverflowError):
                return None
            entry = self._new_upload(tid, dtype, shape, total)
            if entry is None:
                return None
        buf = entry[0]
        if len(buf) != total:
            return None
        return memoryview(buf)[offset:offset + n]

    def read(self, msg: list[Any], out: list[list[Any]]) -> None:
        _, req, tid = msg
        v = self._value(tid, req, out)
        if v is None:
            return
        host = self.backend.to_host(v)
        dt, shape = host.dtype.name, list(host.shape)
        flat = memoryview(host.reshape(-1).view(np.uint8))
        total, chunk = len(flat), self.limits["chunk"]
        if self.data_frames and total > m.INLINE_DATA:  # data frames: views of the array, no copies
            if out:
                self.respond(out[:])  # keep order: earlier answers first
                out.clear()
            self.respond([[req, m.OK, [dt, shape, 0, None, total]]], flat)
            return
        if total <= chunk:
            out.append([req, m.OK, [dt, shape, 0, flat, total]])
            return
        self.respond(out[:])  # keep order: earlier answers first
        out.clear()
        for off in range(0, total - chunk, chunk):
            self.respond([[req, m.CHUNK, [off, flat[off:off + chunk], total]]])
        last = ((total - 1) // chunk) * chunk
        out.append([req, m.OK, [dt, shape, last, flat[last:], total]])

    def shape(self, msg: list[Any], out: list[list[Any]]) -> None:
        _, req, tid = msg
        v = self._value(tid, req, out)
        if v is not None:
            out.append([req, m.OK, [list(v.shape), str(v.dtype).rsplit(".", 1)[-1]]])

    def _value(self, tid: int, req: int, out: list[list[Any]]) -> Any:
        v = self.tensors.get(tid)
        if v is None:
            p = self.poison.get(tid)
            err = p.error if p else to_wire(RemoteExecutionError(
                f"tensor {tid} is unknown to this session (dropped, or never created)"))
            out.append([req, m.ERROR, err])
        return v

    def sync(self, msg: list[Any], out: list[list[Any]]) -> None:
        out.append([msg[1], m.OK, None])

    def drop(self, msg: list[Any], out: list[list[Any]]) -> None:
        t, p = self.tensors, self.poison
        for i in msg[1]:
            if t.pop(i, None) is None:
                p.pop(i, None)

    def close(self, msg: list[Any], out: list[list[Any]]) -> None:
        self.clear()

    def held(self) -> int:
        return len(self.tensors) + len(self.poison)

    def clear(self) -> None:
        self.tensors.clear()
        self.poison.clear()
        self._uploads.clear()
        self.graphs.clear()
        self._stalled = None
