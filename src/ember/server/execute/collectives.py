"""Collectives as vetted ops of a torch peer: torch.distributed among the peers of a mesh.

Opt-in (``Server(collectives=True, dist_host=ADDR)``, ``ember serve --collectives --dist-host ADDR``):
gloo, NCCL and the TCPStore authenticate nobody, so they bind only to ``dist_host`` and a session
reaches only stores on hosts the peer allows (``dist_allow``, default: ``dist_host``'s own kind:
loopback stays loopback). Every process group is built directly from a ``PrefixStore`` with a
random per-mesh prefix over a ``TCPStore`` one peer of the mesh hosts; torch's global default
group is never initialised, so two meshes sharing a peer never cross. A group belongs to the
session that formed it and ends with it.

The ops (all in place on the operands' storages, which a failure poisons; ``l``: their layouts):

* ``torch.dist.store()`` -> ``"host:port"`` (uint8): host the mesh's TCPStore here.
* ``torch.dist.join(g, store, rank, size, timeout, backend)`` -> ``[rank]`` (int64): form group ``g``.
* ``torch.dist.all_reduce(*bufs, g, l, op, h)`` (several operands: one coalesced all-reduce, each
  reduced on its own), ``broadcast(*bufs, g, l, src, h)``, ``all_gather(out, in, g, l, h)`` (into one
  tensor), ``reduce_scatter(out, in, g, l, op, h)``: with ``h`` (an int) the work runs asynchronously
  until ``torch.dist.wait(*bufs, g, h)``.
* ``torch.dist.barrier(g)``, ``torch.dist.leave(g)``.

Memory: what a collective holds while it runs -- the flat copy a coalesced all-reduce or a
reduce-scatter makes, the zeros a poisoned operand joins with -- is charged to the session's budget
from its launch until it settles (the wait, for an async one). A refused charge fails the collective
on this peer (its operands poisoned); the other ranks then fail within the group's timeout.
"""

from __future__ import annotations

import datetime
import ipaddress
from typing import Any, Callable

import torch

from ...protocol import aten as A
from .aten import ITEMSIZE, SESSION_OPS, operand

_REDUCE = {"sum": "SUM", "max": "MAX", "min": "MIN", "product": "PRODUCT", "avg": "AVG"}
MAX_GROUPS = 16        # per session
MAX_PENDING = 1024     # async works per session
MAX_TIMEOUT = 3600.0
MAX_STAND_IN = 1 << 32  # bytes of zeros a poisoned operand may be replaced with


class CollectiveError(ValueError):
    """A collective was asked wrongly (the group, the layouts, the store address)."""


class Collectives:
    """One session's process groups and pending async works on one device."""

    def __init__(self, device: torch.device, dist_host: str, allow: frozenset[str] | None, mem: Any = None) -> None:
        self.device, self.dist_host, self.allow, self.mem = device, dist_host, allow, mem
        self.groups: dict[str, Any] = {}
        self.stores: list[Any] = []
        self.pending: dict[tuple[str, int], Any] = {}
        self.poisoned = False  # the collective being called got a poisoned operand (zeros stand in)
        self.stand_in = 0      # bytes of the zeros standing in for poisoned operands (charged)

    # ---- forming a group ------------------------------------------------------------
    def store(self) -> torch.Tensor:
        import torch.distributed as dist
        if len(self.stores) >= MAX_GROUPS:
            raise CollectiveError(f"this session already hosts {MAX_GROUPS} stores")
        s = dist.TCPStore(self.dist_host, 0, None, True, datetime.timedelta(seconds=60), wait_for_workers=False)
        self.stores.append(s)
        return torch.frombuffer(bytearray(f"{self.dist_host}:{s.port}".encode()), dtype=torch.uint8).clone()

    def _check_store(self, addr: Any) -> tuple[str, int]:
        if not isinstance(addr, str) or ":" not in addr:
            raise CollectiveError(f"a store address is 'ip:port', got {str(addr)[:60]!r}")
        host, _, port = addr.rpartition(":")
        try:
            ip = ipaddress.ip_address(host.strip("[]"))
            p = int(port)
        except ValueError:
            raise CollectiveError(f"a store address is an IP literal and a port, got {addr[:60]!r}") from None
        ok = host in self.allow if self.allow is not None else \
            ip.is_loopback == ipaddress.ip_address(self.dist_host).is_loopback
        if not ok or not 0 < p < 65536:
            raise CollectiveError(f"this peer may not reach a store at {addr}: collectives here bind "
                                  f"{self.dist_host} and reach only the hosts its operator allows (--dist-allow)")
        return host.strip("[]"), p

    def join(self, *, g: Any, store: Any, rank: Any, size: Any, timeout: Any, backend: Any = "gloo") -> torch.Tensor:
        import torch.distributed as dist
        if not isinstance(g, str) or not 16 <= len(g) <= 64:
            raise CollectiveError("a group name is a random string of 16 to 64 characters")
        if g in self.groups or len(self.groups) >= MAX_GROUPS:
            raise CollectiveError(f"group {g[:8]}… exists already, or this session has {MAX_GROUPS} groups")
        if type(size) is not int or type(rank) is not int or not 0 <= rank < size <= 1024:
            raise CollectiveError(f"rank {rank!r} of size {size!r}: need 0 <= rank < size <= 1024")
        if type(timeout) not in (int, float) or not 0 < timeout <= MAX_TIMEOUT:
            raise CollectiveError(f"a group timeout is in (0, {MAX_TIMEOUT:g}] seconds, got {timeout!r}")
        host, port = self._check_store(store)
        td = datetime.timedelta(seconds=float(timeout))
        base = dist.TCPStore(host, port, None, False, td)
        ps = dist.PrefixStore(f"ember/{g}/", base)
        if backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = td
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self.dist_host)]
            pg = dist.ProcessGroupGloo(ps, rank, size, opts)
        elif backend == "nccl":
            if self.device.type != "cuda":
                raise CollectiveError("the nccl backend needs a torch:cuda device")
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = td
            pg = dist.ProcessGroupNCCL(ps, rank, size, opts)
        else:
            raise CollectiveError(f"backend {str(backend)[:20]!r}: 'gloo' or 'nccl'")
        self.groups[g] = (pg, base)
        t = torch.tensor([rank], dtype=torch.int64, device=self.device)
        pg.allreduce([t.clone()]).wait()  # everyone is here (and can reach everyone)
        return t

    def leave(self, *, g: Any) -> tuple[()]:
        self.groups.pop(g, None)
        for k in [k for k in self.pending if k[0] == g]:
            self._give_back(self.pending.pop(k)[3])
        return ()

    # ---- running collectives ------------------------------------------------------------
    def _group(self, g: Any) -> Any:
        pg = self.groups.get(g) if isinstance(g, str) else None
        if pg is None:
            raise CollectiveError("no such process group in this session (it was never joined, or left)")
        return pg[0]

    def _views(self, bufs: tuple[Any, ...], l: Any) -> list[torch.Tensor]:  # noqa: E741
        if not isinstance(l, list) or len(l) != len(bufs) or not bufs:
            raise CollectiveError("a collective needs one layout per operand")
        views = [operand(b, lay, self.device) for b, lay in zip(bufs, l)]
        if not all(v.is_contiguous() for v in views):
            raise CollectiveError("collective operands must be contiguous")
        return views

    def _finish(self, g: str, launch: Callable[[], Any], h: Any, bufs: tuple[Any, ...], scratch: int = 0,
                name: str = "collective", fused: torch.Tensor | None = None) -> tuple[()]:
        """Run a collective after a one-int MAX all-reduce of "an operand is poisoned here", so a rank
        with a poisoned input still joins (with zeros) and every rank's result is poisoned. ``scratch``:
        bytes the backend copies the operands into (charged, with the stand-ins, until it settles).
        ``fused``: the flag rides in the collective itself (a coalesced sum or max: one round, not two)."""
        import torch.distributed as dist
        pg = self._group(g)
        if h is not None and (type(h) is not int or len(self.pending) >= MAX_PENDING or (g, h) in self.pending):
            raise CollectiveError(f"async handle {h!r}: an int not pending already (at most {MAX_PENDING})")
        held = scratch + self.stand_in
        if held and self.mem is not None:
            self.mem.charge(held, lambda: f"the buffers torch.dist.{name} holds while it runs")
        try:
            if fused is not None:
                entry = (None, fused, launch(), held)
            else:
                flag = torch.tensor([int(self.poisoned)], dtype=torch.int32, device=self.device)
                o = dist.AllreduceOptions()
                o.reduceOp = dist.ReduceOp.MAX
                entry = (pg.allreduce([flag], o), flag, launch(), held)
        except BaseException:
            self._give_back(held)
            raise
        self.poisoned = False
        if h is None:
            return self._settle(entry)
        self.pending[(g, h)] = entry
        return ()

    def _give_back(self, n: int) -> None:
        if n and self.mem is not None:
            self.mem.release(n)

    def _settle(self, entry: tuple[Any, Any, Any, int]) -> tuple[()]:
        flag_work, flag, work, held = entry
        try:
            work.wait()
            if flag_work is not None:
                flag_work.wait()
        finally:
            self._give_back(held)
        if flag.item() > 0:
            raise CollectiveError("an operand of this collective was poisoned on a peer of the mesh (it joined "
                                  "with zeros): the result is poisoned on every peer")
        return ()

    def all_reduce(self, *bufs: Any, g: Any, l: Any, op: Any = "sum", h: Any = None) -> tuple[()]:  # noqa: E741
        import torch.distributed as dist
        pg, views = self._group(g), self._views(bufs, l)
        if op not in _REDUCE:
            raise CollectiveError(f"reduce op {str(op)[:20]!r}: one of {sorted(_REDUCE)}")
        if len(views) == 1:
            o = dist.AllreduceOptions()
            o.reduceOp = getattr(dist.ReduceOp, _REDUCE[op])
            return self._finish(g, lambda: pg.allreduce(views, o), h, bufs, 0, "all_reduce")
        # (a list given to allreduce means one input per local device, all reduced into one: each
        # operand is reduced on its own by the coalesced form, which flattens them into one buffer)
        if len({v.dtype for v in views}) != 1:
            raise CollectiveError("a coalesced all_reduce takes operands of one dtype (one call per dtype)")
        oc = dist.AllreduceCoalescedOptions()
        oc.reduceOp = getattr(dist.ReduceOp, _REDUCE[op])
        flat = sum(v.numel() * v.element_size() for v in views)
        fused = None
        dt = views[0].dtype
        if op in ("sum", "avg", "max") and dt != torch.bool and not dt.is_complex:
            # "an operand is poisoned here" as one more element of the same collective: > 0 on every
            # rank when it is 1 on any (sum, avg and max of 0s and 1s)
            fused = torch.tensor([int(self.poisoned)], dtype=dt, device=self.device)
            views = [*views, fused]
        return self._finish(g, lambda: pg.allreduce_coalesced(views, oc), h, bufs, flat, "all_reduce", fused)

    def broadcast(self, *bufs: Any, g: Any, l: Any, src: Any = 0, h: Any = None) -> tuple[()]:  # noqa: E741
        import torch.distributed as dist
        pg, views = self._group(g), self._views(bufs, l)
        if type(src) is not int or not 0 <= src < pg.size():
            raise CollectiveError(f"broadcast source {src!r} is not a rank of the group")
        o = dist.BroadcastOptions()
        o.rootRank = src
        # (one broadcast per operand: a list would mean one tensor per local device, all given the first's)
        return self._finish(g, lambda: _Works([pg.broadcast([v], o) for v in views]), h, bufs, 0, "broadcast")

    def all_gather(self, out: Any, inp: Any, *, g: Any, l: Any, h: Any = None) -> tuple[()]:  # noqa: E741
        pg = self._group(g)
        o, i = self._views((out, inp), l)
        if o.numel() != i.numel() * pg.size() or o.dtype != i.dtype:
            raise CollectiveError("all_gather: the output holds size x the input's elements, of its dtype")
        return self._finish(g, lambda: pg._allgather_base(o, i), h, (out,), 0, "all_gather")

    def reduce_scatter(self, out: Any, inp: Any, *, g: Any, l: Any, op: Any = "sum",  # noqa: E741
                       h: Any = None) -> tuple[()]:
        import torch.distributed as dist
        pg = self._group(g)
        o, i = self._views((out, inp), l)
        if i.numel() != o.numel() * pg.size() or o.dtype != i.dtype or op not in _REDUCE:
            raise CollectiveError("reduce_scatter: the input holds size x the output's elements, of its dtype")
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = getattr(dist.ReduceOp, _REDUCE[op])
        return self._finish(g, lambda: pg._reduce_scatter_base(o, i, opts), h, (out,),
                            i.numel() * i.element_size(), "reduce_scatter")

    def wait(self, *bufs: Any, g: Any, h: Any, l: Any = None) -> tuple[()]:  # noqa: E741
        entry = self.pending.pop((g, h), None) if isinstance(g, str) and type(h) is int else None
        if entry is None:
            raise CollectiveError(f"no pending collective {h!r} in this group")
        return self._settle(entry)

    def barrier(self, *, g: Any) -> tuple[()]:
        import torch.distributed as dist
        o = dist.BarrierOptions()
        if self.device.type == "cuda":  # (NCCL would guess the device from the rank: this peer's own)
            o.device_ids = [self.device.index or 0]
        self._group(g).barrier(o).wait()
        return ()

    def table(self) -> dict[str, Callable[..., Any]]:
        ops: dict[str, Callable[..., Any]] = {
            "torch.dist.store": self.store, "torch.dist.join": self.join, "torch.dist.leave": self.leave,
            "torch.dist.barrier": self.barrier}
        for name, fn in (("all_reduce", self.all_reduce), ("broadcast", self.broadcast),
                         ("all_gather", self.all_gather), ("reduce_scatter", self.reduce_scatter)):
            ops["torch.dist." + name] = _Writes(fn, self)
        ops["torch.dist.wait"] = _Writes(self.wait, None)
        return ops


class _Works:
    """Several works settled as one."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self) -> bool:
        for w in self.works:
            w.wait()
        return True


class _Writes:
    """A collective that writes every operand (a failure poisons them all: ``written``). Called with a
    poisoned operand (None), it joins with zeros of the operand's layout (``joins_poisoned``)."""

    def __init__(self, fn: Callable[..., Any], owner: Collectives | None) -> None:
        self.fn, self.owner = fn, owner
        self.joins_poisoned = owner is not None

    def __call__(self, *bufs: Any, **k: Any) -> Any:
        if self.owner is not None and any(b is None for b in bufs):
            layouts = k.get("l")
            if not isinstance(layouts, list) or len(layouts) != len(bufs):
                raise CollectiveError("a collective needs one layout per operand")
            if any(A.layout_extent(lay, ITEMSIZE) > MAX_STAND_IN for lay in layouts):
                raise CollectiveError(f"a poisoned operand over {MAX_STAND_IN} bytes cannot join with zeros")
            sizes = [A.layout_extent(lay, ITEMSIZE) if b is None else 0 for b, lay in zip(bufs, layouts)]
            bufs = tuple(torch.zeros(n, dtype=torch.uint8, device=self.owner.device) if b is None else b
                         for b, n in zip(bufs, sizes))
            self.owner.poisoned = True
            self.owner.stand_in = sum(sizes)
        try:
            return self.fn(*bufs, **k)
        finally:
            if self.owner is not None:
                self.owner.poisoned = False
                self.owner.stand_in = 0

    @staticmethod
    def written(kwargs: Any) -> list[int]:
        layouts = kwargs.get("l") if isinstance(kwargs, dict) else None
        return list(range(len(layouts))) if isinstance(layouts, list) else []


def enable(tables: list[dict[str, Any]], backends: list[Any], dist_host: str,
           allow: list[str] | None = None) -> None:
    """Offer collectives on every torch device of a peer (``Server(collectives=True)``)."""
    ipaddress.ip_address(dist_host)  # an IP literal: what gloo and the store bind
    allowed = frozenset(allow) if allow else None
    for table, b in zip(tables, backends):
        if b.kind == "torch":
            table[SESSION_OPS] = lambda device, mem=None, h=dist_host: (  # type: ignore[misc]
                Collectives(device, h, allowed, mem).table())


__all__ = ["Collectives", "CollectiveError", "enable"]
