"""``DataParallel(model)``: DistributedDataParallel's semantics for a model on a :class:`~.mesh.Mesh`.

The parameters are broadcast from rank 0 once; the buffers (BatchNorm's running statistics) before every
forward that follows a training forward outside ``no_sync``, as DDP's ``broadcast_buffers=True``. In
backward, each parameter's gradient, once accumulated, marks its bucket ready (buckets of
``bucket_cap_mb``, the first one 1 MB, filled in reverse parameter order as DDP does); a ready bucket is
flattened, divided by the world size and all-reduced (SUM, one coalesced collective per bucket)
asynchronously on the peers while the rest of backward runs; at the end of backward every bucket is waited
for. A parameter the step did not use keeps no gradient (every peer runs the same program, so it is unused
on every rank: DDP with ``find_unused_parameters=True`` leaves its ``.grad`` None too, and weight decay does
not move it). Each bucket keeps its async handle, so every step is the same ops and replays as one op graph
on every peer. :meth:`DataParallel.no_sync` skips all of it (gradients accumulate locally) until a backward
outside it. Everything is recorded once and runs on every peer (the client moves no gradient).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from ._storage import ref_of
from .mesh import Mesh, Work

FIRST_BUCKET_BYTES = 1 << 20  # torch.distributed's _DEFAULT_FIRST_BUCKET_BYTES


class _Bucket:
    __slots__ = ("params", "ready", "flat", "work", "handle")

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        self.ready = 0
        self.flat: torch.Tensor | None = None  # (only when a gradient is not contiguous: flattened)
        self.work: Work | None = None
        self.handle = 0


class DataParallel(torch.nn.Module):
    """Wrap a module whose parameters live on a mesh: gradients are averaged over its peers."""

    def __init__(self, module: torch.nn.Module, bucket_cap_mb: float = 25.0, broadcast: bool = True,
                 broadcast_buffers: bool = True) -> None:
        super().__init__()
        self.module = module
        self.broadcast_buffers = broadcast_buffers
        self._buffers_next = True  # (DDP's require_forward_param_sync: the next forward broadcasts the buffers)
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            raise ValueError("DataParallel needs a module with trainable parameters")
        dev = ref_of(params[0]).device
        if not isinstance(dev, Mesh):
            raise ValueError("DataParallel needs the module's parameters on a mesh (ember.torch.mesh): "
                             "move the model inside `with mesh:`")
        self.mesh: Mesh = dev
        self.buckets = _assign(params, int(bucket_cap_mb * (1 << 20)))
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        for b, h in zip(self.buckets, self.mesh.reserve_handles(len(self.buckets))):
            b.handle = h  # the same every step: a step is the same ops, replayed as one graph
        self._sync = True
        self._queued = False
        if broadcast:
            with torch.no_grad():
                for t in [*module.parameters(), *module.buffers()]:
                    if t.is_contiguous():
                        self.mesh.broadcast(t, src=0)
        for p in params:
            p.register_post_accumulate_grad_hook(self._ready)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._buffers_next and self.broadcast_buffers:
            bufs = [b for b in self.module.buffers() if b.is_contiguous()]
            if bufs:
                with torch.no_grad():
                    self.mesh.broadcast(*bufs, src=0)
        out = self.module(*args, **kwargs)
        self._buffers_next = torch.is_grad_enabled() and self._sync
        return out

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients on each peer without communicating."""
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old

    # ---- during backward ----------------------------------------------------------------
    def _ready(self, p: torch.Tensor) -> None:
        if not self._sync:
            return
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        b = self._bucket_of[id(p)]
        b.ready += 1
        if b.ready == len(b.params):
            self._launch(b)

    def _launch(self, b: _Bucket) -> None:
        """Divide the bucket's gradients by the world size, then all-reduce them as one coalesced
        collective (the peer flattens them, as DDP's bucket does), asynchronously."""
        with torch.no_grad():
            grads = [p.grad for p in b.params if p.grad is not None]  # (unused in this step: left None)
            if not grads:
                b.work = _DONE
                return
            if all(g.is_contiguous() for g in grads):
                torch._foreach_div_(grads, self.mesh.size)
                b.work = self.mesh.all_reduce(*grads, async_op=True, handle=b.handle)
                return
            flat = torch.cat([g.reshape(-1) for g in grads])
            flat.div_(self.mesh.size)
            b.flat, b.work = flat, self.mesh.all_reduce(flat, async_op=True, handle=b.handle)

    def _finish(self) -> None:
        self._queued = False
        with torch.no_grad():
            for b in self.buckets:
                if b.work is None:
                    self._launch(b)
            for b in self.buckets:
                assert b.work is not None
                b.work.wait()
                if b.flat is None:
                    b.ready, b.work = 0, None
                    continue
                off = 0
                for p in b.params:
                    g = p.grad
                    if g is None:
                        continue
                    n = g.numel()
                    g.copy_(b.flat[off:off + n].view_as(g))
                    off += n
                b.ready, b.flat, b.work = 0, None, None


class _Done:
    def wait(self) -> None:
        pass


_DONE: Any = _Done()  # a bucket none of whose parameters this step used: nothing to reduce


def _assign(params: list[torch.nn.Parameter], cap: int) -> list[_Bucket]:
    """Buckets in reverse parameter order (the order gradients become ready), one dtype each."""
    buckets: list[_Bucket] = []
    cur: list[torch.nn.Parameter] = []
    size, limit = 0, min(FIRST_BUCKET_BYTES, cap)
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if cur and (size + nbytes > limit or p.dtype != cur[0].dtype):
            buckets.append(_Bucket(cur))
            cur, size, limit = [], 0, cap
        cur.append(p)
        size += nbytes
    if cur:
        buckets.append(_Bucket(cur))
    return buckets


__all__ = ["DataParallel"]
