"""A mesh of torch peers driven by one recording (single controller).

>>> mesh = ember.torch.mesh(["tcp://a:7000", "tcp://b:7000"], backend="gloo")   # doctest: +SKIP
>>> with mesh:
...     model = ember.torch.DataParallel(Net().to("ember"))     # the same parameters on every peer
...     x = mesh.shard(x_cpu)                                    # slice i on peer i
...     loss = F.cross_entropy(model(x), mesh.shard(y_cpu)); loss.backward()
...     print(mesh.mean(loss).item())

A :class:`Mesh` is an Ember device whose session (:class:`MeshSession`) records every message once,
in rank 0's session, which groups and encodes each batch once and queues the same frames on every
other peer's session (``client/fanout.py``), under the same ids: torch dispatch, meta inference,
op-graph capture and encoding run once, and each peer runs the same ops (the same replayed graphs)
on its own data. Reads answer rank 0's value. Collectives
(:meth:`Mesh.all_reduce`, ``broadcast``, ``all_gather_into_tensor``, ``reduce_scatter_tensor``,
``barrier``) are ops the peers run among themselves with torch.distributed (peers serve
``--collectives``), in one process group per mesh (server/execute/collectives.py).
"""

from __future__ import annotations

import itertools
import secrets
import threading
from typing import Any, Sequence

import torch

from ..client.device import Device, connect
from ..client.progress import choose
from ..client.session import ClientSession
from ..errors import ConnectError, EmberError, SessionLost
from ..protocol import messages as m
from ._storage import StorageRef, layout_of, new_tensor, ref_of
from ._transfer import _bytes_of, _contiguous

_OP = m.OP


class MeshPeerLost(SessionLost):
    """A peer of the mesh ended (killed, unreachable, or it left the collective): the mesh cannot go on."""


_LOST_HINT = "a mesh does not survive a peer; form a new one with the peers left"
#: How long a failed collective waits for each peer's answer to a ping before naming it lost.
PROBE_S = 3.0


class MeshError(ConnectError):
    """The mesh could not be formed: a peer offers no collectives, or two peers cannot reach each other."""


class _Given:
    """A peer session's id source: the id the mesh chose for the upload under way."""

    value = 0

    def __next__(self) -> int:
        return self.value

    def __iter__(self) -> "_Given":
        return self


class MeshSession:
    """What ember.torch sees as a session: one recording for every peer of the mesh.

    Rank 0's session (the leader) records, groups (op-graph caching) and encodes each batch once;
    the same frames are queued on every other peer's connection (``ClientSession.fanout``), so the
    client's CPU per step is that of one peer. Only uploads of per-peer data (:meth:`upload_each`),
    the mesh's formation and requests go to a peer alone."""

    def __init__(self, peers: list[ClientSession], names: list[str]) -> None:
        self.peers, self.names = peers, names
        self.leader = peers[0]
        self.ids = itertools.count(1)
        self._given = [_Given() for _ in peers]
        for s, g in zip(peers, self._given):
            s.ids = g  # type: ignore[assignment]  # only uploads draw ids there: the mesh sets them
        self.leader.fanout(peers[1:])
        self._lock = threading.Lock()  # one recording order for every peer
        self.address = "mesh(" + ", ".join(names) + ")"
        self.device = peers[0].device

    @property
    def welcome(self) -> dict[str, Any]:
        return self.leader.welcome

    @property
    def stats(self) -> dict[str, Any]:
        return self.leader.stats

    @property
    def lost(self) -> EmberError | None:
        for name, s in zip(self.names, self.peers):
            if s.lost is not None:
                return MeshPeerLost(f"mesh peer {name} is gone: {s.lost.message}", hint=_LOST_HINT)
        return None

    def _check(self) -> None:
        e = self.lost
        if e is not None:
            raise e

    def record(self, msg: list[Any]) -> None:
        self._check()
        with self._lock:
            self.leader.record(msg)

    def record_each(self, msgs: Sequence[list[Any]]) -> None:
        """``msgs[i]`` to peer i alone (after everything recorded before, on every peer)."""
        self._check()
        with self._lock:
            for s, msg in zip(self.peers, msgs):
                with s.own():
                    s.record(msg)

    def release(self, tid: int) -> None:
        self.leader.release(tid)

    def flush(self) -> None:
        self.leader.flush()

    def graph_entry(self, c: Any) -> Any:
        """A whole captured graph (torch.compile, ember.torch.capture): the leader's registration, whose
        GRAPH and REPLAY frames are fanned out to every peer like any batch."""
        return self.leader.graph_entry(c)

    def group_room(self) -> int:
        """None: a mesh sends each captured graph as its own REPLAY, fanned out to every peer as it comes."""
        return 0

    def replay_graph(self, *args: Any) -> None:
        self._check()
        with self._lock:
            self.leader.replay_graph(*args)

    def send_alone(self, msg: list[Any]) -> None:
        self._check()
        with self._lock:
            self.leader.send_alone(msg)

    def upload(self, arr: Any, progress: Any = None) -> int:
        """The same bytes to every peer, under one new id (a small array: encoded once, in the batch)."""
        if getattr(arr, "nbytes", len(arr) if isinstance(arr, (bytes, bytearray, memoryview)) else 1 << 30) \
                <= m.INLINE_DATA:
            self._check()
            with self._lock:
                tid = self._given[0].value = next(self.ids)
                self.leader.upload(arr, progress)
            return tid
        return self.upload_each([arr] * len(self.peers), progress)

    def upload_each(self, arrays: Sequence[Any], progress: Any = None) -> int:
        """``arrays[i]`` to peer i, all under one new id."""
        self._check()
        with self._lock:
            tid = next(self.ids)
            for g in self._given:
                g.value = tid
            self.leader.upload_own(arrays[0], progress)  # (not fanned out: a batch's own message)
            for s, a in zip(self.peers[1:], arrays[1:]):
                s.upload(a, progress)  # (queued before the next batch fanned out to it)
        return tid

    def request(self, kind: int, *fields: Any, timeout: float | None = None, progress: Any = None,
                nbytes: int = 0) -> Any:
        """Ask rank 0 (a read answers its value); a lost peer answers :class:`MeshPeerLost`."""
        self._check()
        if kind == m.SYNC:
            self.leader.flush()
            for s in self.peers:
                self._ask(s, kind, fields, timeout, progress, nbytes)
            return None
        return self._ask(self.leader, kind, fields, timeout, progress, nbytes)

    def _ask(self, s: ClientSession, kind: int, fields: Any, timeout: Any, progress: Any, nbytes: int) -> Any:
        try:
            return s.request(kind, *fields, timeout=timeout, progress=progress, nbytes=nbytes)
        except EmberError as e:
            self._check()  # a peer's end explains a failed collective better than its poison
            if "torch.dist." in e.message:
                self._probe(e)
            raise

    def _probe(self, failed: EmberError) -> None:
        """A collective failed (gloo saw a peer's connection reset) before this client learnt of a peer's end (over
        iroh, its heartbeat takes seconds): a peer that does not answer a ping within PROBE_S is named as lost."""
        for name, s in zip(self.names, self.peers):
            try:
                s.request(m.PING, timeout=PROBE_S)
            except EmberError as e:
                raise MeshPeerLost(f"mesh peer {name} is gone (it does not answer: {e.message}); a collective "
                                   f"failed: {failed.message}", hint=_LOST_HINT) from failed

    def sync(self, timeout: float | None = None) -> None:
        self.request(m.SYNC, timeout=timeout)

    def unfan(self) -> None:
        """Send what waits to every peer, then stop fanning out (each session then closes on its own)."""
        try:
            self.leader.flush()
        except EmberError:
            pass
        self.leader._fan = None

    def close(self) -> None:
        self.unfan()
        for s in self.peers:
            s.close()


class Mesh(Device):
    """Several torch peers as one Ember device; ``with mesh:`` makes ``"ember"`` tensors there."""

    def __init__(self, devices: list[Device], backend: str, timeout: float) -> None:  # noqa: D107
        self.devices, self.backend, self.timeout = devices, backend, timeout
        self.address = "mesh(" + ", ".join(d.address for d in devices) + ")"
        self.index = devices[0].index
        self.admin = False
        self._lock = threading.Lock()
        self._session = MeshSession([d.session for d in devices], [d.address for d in devices])  # type: ignore[assignment]
        self.group = secrets.token_hex(16)
        self._handles = itertools.count(1)
        self._reserved = itertools.count(1 << 32)  # handles reused every step (DataParallel's buckets)
        self._form()

    @property
    def size(self) -> int:
        return len(self.devices)

    @property
    def session(self) -> Any:  # type: ignore[override]
        s = self._session
        e = s.lost
        if e is not None:
            raise e
        return s

    def _form(self) -> None:
        """Host the store on rank 0, join every peer to the group, wait until all of them are in it."""
        ms: MeshSession = self._session  # type: ignore[assignment]
        first = ms.peers[0]
        sid = next(ms.ids)
        with first.own():
            first.record([_OP, "torch.dist.store", [], 0, [sid], None])
        try:
            store = bytes(_read_value(first, sid)).decode()
        except EmberError as e:
            raise MeshError(f"{ms.names[0]} cannot host the mesh's store: {e.message}",
                            hint="serve every mesh peer with `ember serve --device torch:... --collectives`") from None
        first.record_own([m.DROP, [sid]])  # (the address only: the store lives on with the group)
        jid = next(ms.ids)
        ms.record_each([[_OP, "torch.dist.join", [], 0, [jid], {"g": self.group, "store": store, "rank": rank,
                                                               "size": self.size, "timeout": float(self.timeout),
                                                               "backend": self.backend}]
                        for rank in range(self.size)])
        for rank, (name, s) in enumerate(zip(ms.names, ms.peers)):
            try:
                got = _read_value(s, jid, self.timeout + 30)
            except EmberError as e:
                others = [n for n in ms.names if n != name]
                raise MeshError(f"mesh peer {name} (rank {rank}) could not form a group with {', '.join(others)} "
                                f"(store {store}): {e.message}",
                                hint="the peers must reach each other's --dist-host and serve --collectives") from None
            if int(torch.frombuffer(bytearray(got), dtype=torch.int64)[0]) != rank:
                raise MeshError(f"mesh peer {name} joined as the wrong rank")
        ms.release(jid)

    # ---- data ---------------------------------------------------------------------
    def shard(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Split a CPU tensor in ``size`` equal slices along ``dim``; slice i goes to peer i."""
        if x.device.type != "cpu":
            raise TypeError("mesh.shard takes a CPU tensor")
        n = self.size
        if x.shape[dim] % n:
            raise ValueError(f"mesh.shard: dim {dim} of size {x.shape[dim]} does not split in {n} equal slices")
        ms: MeshSession = self.session
        shape = list(x.shape)
        shape[dim] //= n
        if dim == 0 or all(s == 1 for s in x.shape[:dim]):  # slices of the bytes: no copy per slice
            rows = _bytes_of(x.detach().contiguous()).reshape(n, -1)
            arrays = [rows[i] for i in range(n)]
        else:
            arrays = [_bytes_of(p.detach().contiguous()) for p in x.chunk(n, dim)]
        sid = ms.upload_each(arrays, choose(None, arrays[0].nbytes))
        return new_tensor(x.dtype, torch.Size(shape), tuple(_contiguous(shape)), 0, ref=StorageRef(sid, ms, self))  # type: ignore[arg-type]

    def mean(self, t: torch.Tensor) -> torch.Tensor:
        """The mean over the peers of ``t`` (a new tensor; its read answers the mean)."""
        with torch.no_grad():
            c = t.detach().clone()
            self.all_reduce(c)
            return c.div_(self.size)

    # ---- collectives ----------------------------------------------------------------
    def reserve_handles(self, n: int) -> list[int]:
        """``n`` async handles of one's own, to reuse every step (each waited for before its next use):
        the same ops every step replay as one graph on the peers (an op-graph's keywords must match)."""
        return [next(self._reserved) for _ in range(n)]

    def _collective(self, name: str, tensors: list[torch.Tensor], async_op: bool = False, handle: int | None = None,
                    **kw: Any) -> "Work | None":
        from ._devices import materialize
        refs = [ref_of(t) for t in tensors]
        for r in refs:
            if r.session is not self._session:
                raise ValueError(f"{name}: every operand must be a tensor of this mesh")
            if r.pending is not None:
                materialize(r)
        kw["g"] = self.group
        kw["l"] = [layout_of(t) for t in tensors]
        h = (next(self._handles) if handle is None else handle) if async_op else None
        kw["h"] = h
        self.session.record([_OP, "torch.dist." + name, [r.sid for r in refs], 0, [], kw])
        return Work(self, tensors, h) if h is not None else None

    def all_reduce(self, *tensors: torch.Tensor, op: str = "sum", async_op: bool = False,
                   handle: int | None = None) -> "Work | None":
        """Reduce each of ``tensors`` (contiguous; several: of one dtype, coalesced in one collective)
        in place over the peers."""
        return self._collective("all_reduce", list(tensors), async_op, handle, op=op)

    def broadcast(self, *tensors: torch.Tensor, src: int = 0, async_op: bool = False,
                  handle: int | None = None) -> "Work | None":
        """Every peer's ``tensors`` become rank ``src``'s."""
        return self._collective("broadcast", list(tensors), async_op, handle, src=src)

    def all_gather_into_tensor(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False) -> "Work | None":
        return self._collective("all_gather", [out, inp], async_op, None)

    def reduce_scatter_tensor(self, out: torch.Tensor, inp: torch.Tensor, op: str = "sum",
                              async_op: bool = False) -> "Work | None":
        return self._collective("reduce_scatter", [out, inp], async_op, None, op=op)

    def barrier(self) -> None:
        """Wait until every peer reached this point of the recording."""
        self.session.record([_OP, "torch.dist.barrier", [], 0, [], {"g": self.group}])
        self.session.sync()

    def close(self) -> None:
        """Leave the group and end every peer's session (their memory is freed)."""
        s: MeshSession = self._session  # type: ignore[assignment]
        if s.lost is None:
            try:
                s.record([_OP, "torch.dist.leave", [], 0, [], {"g": self.group}])
            except EmberError:
                pass
        s.unfan()
        for d in self.devices:
            d.close()

    def __repr__(self) -> str:
        return f"Mesh({[d.address for d in self.devices]!r}, {self.backend!r})"


class Work:
    """An asynchronous collective in flight on the peers; :meth:`wait` orders later ops after it."""

    def __init__(self, mesh: Mesh, tensors: list[torch.Tensor], handle: int) -> None:
        self.mesh, self.tensors, self.handle = mesh, tensors, handle

    def wait(self) -> None:
        mesh = self.mesh
        refs = [ref_of(t) for t in self.tensors]
        mesh.session.record([_OP, "torch.dist.wait", [r.sid for r in refs], 0, [],
                             {"g": mesh.group, "h": self.handle, "l": [layout_of(t) for t in self.tensors]}])


def _read_value(s: ClientSession, tid: int, timeout: float | None = None) -> Any:
    _dt, _shape, _off, data, _total = s.request(m.READ, tid, timeout=timeout)
    return data


def mesh(addresses: Sequence[str | Device], backend: str = "gloo", timeout: float = 30.0,
         **connect_options: Any) -> Mesh:
    """Connect to every peer (or take connected devices) and form the mesh's process group.

    ``backend``: ``"gloo"`` (CPU peers) or ``"nccl"`` (CUDA peers); ``timeout``: how long a collective
    waits for the others before it fails (a dead peer is reported within it)."""
    if len(addresses) < 1:
        raise ValueError("a mesh needs at least one peer")
    devs = [a if isinstance(a, Device) else connect(a, **connect_options) for a in addresses]
    for d in devs:
        if d.info.get("backend") != "torch":
            raise MeshError(f"mesh peer {d.address} is a {d.info.get('backend')} device, not a torch one")
    try:
        return Mesh(devs, backend, timeout)
    except BaseException:
        for d in devs:
            if not isinstance(d, Device) or d not in addresses:
                d.close()
        raise


__all__ = ["mesh", "Mesh", "MeshSession", "MeshPeerLost", "MeshError", "Work"]
