"""What a session's interpreter sends back: READ, SHAPE and SYNC answers.

:class:`Answers` is the part of the :class:`~ember.server.execute.interpreter.Interpreter` that
answers requests, in the order they came: a read's bytes inline in the batch's answers (a frame of
about a chunk at most), in ``CHUNK`` responses, or as data frames; and answers sent before the rest of
their batch has run (``_answer_now``), in order. It relies on the interpreter's ``tensors``, ``poison``,
``mem``, ``backend``, ``limits``, ``respond``, ``data_frames``, ``_small_bytes`` and ``_out_bytes``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...errors import LimitExceeded, RemoteExecutionError, to_wire
from ...protocol import messages as m
from ..guard.memory import host_copy_bytes
from .replay import describe

#: NumPy dtype -> its name (``dtype.name`` costs microseconds on every read).
_DTYPE_NAMES: dict[Any, str] = {np.dtype(n): n for n in (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "float32",
    "float64", "complex64", "complex128")}


class Answers:
    """Answering READ, SHAPE and SYNC (a mixin of the Interpreter)."""

    tensors: dict[int, Any]
    poison: dict[int, Any]
    mem: Any
    backend: Any
    limits: Any
    respond: Any
    data_frames: bool
    _small_bytes: Any
    _out_bytes: int

    def read(self, msg: list[Any], out: list[list[Any]]) -> None:
        _, req, tid = msg
        v = self._value(tid, req, out)
        if v is None:
            return
        small = self._small_bytes
        got = small(v) if small is not None else None
        if got is not None:  # what the general way below answers for it, with fewer steps
            return self._answer_read(req, got[0], got[1], got[2], out)
        staging = host_copy_bytes(self.backend.kind, v)
        if staging:  # the host copy is charged before it is made
            try:
                self.mem.charge(staging, lambda: f"reading tensor {tid} ({describe([v])}) through a host copy")
            except LimitExceeded as e:
                out.append([req, m.ERROR, to_wire(e)])
                return
        try:
            host = self.backend.to_host(v)
            hd = host.dtype
            dt, shape = _DTYPE_NAMES.get(hd) or hd.name, list(host.shape)  # (dtype.name is slow)
            flat = memoryview(host.reshape(-1).view(np.uint8))
            total, chunk = len(flat), self.limits["chunk"]
            if self.data_frames and total > m.INLINE_DATA:  # data frames: views of the array, no copies
                if out:
                    self._answer_now(out)  # keep order: earlier answers first
                self.respond([[req, m.OK, [dt, shape, 0, None, total]]], flat, staging)  # a copy stays counted
                return
            if total <= chunk:
                return self._answer_read(req, dt, shape, flat, out)
            self._answer_now(out)  # keep order: earlier answers first
            for off in range(0, total - chunk, chunk):
                self.respond([[req, m.CHUNK, [off, flat[off:off + chunk], total]]])
            last = ((total - 1) // chunk) * chunk
            self.respond([[req, m.OK, [dt, shape, last, flat[last:], total]]])
        finally:
            self.mem.release(staging)

    def _answer_read(self, req: int, dt: str, shape: list[int], flat: bytes | memoryview, out: list[list[Any]]) -> None:
        """A read's answer of at most a chunk, in the batch's answers."""
        out.append([req, m.OK, [dt, shape, 0, flat, len(flat)]])
        self._out_bytes += len(flat)
        if self._out_bytes > self.limits["chunk"]:  # many reads in one batch: answer in frames of about a chunk
            self._answer_now(out)

    def _answer_now(self, out: list[list[Any]]) -> None:
        """Send the answers gathered so far, before the rest of the batch runs."""
        self.respond(out[:])
        out.clear()
        self._out_bytes = 0

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
