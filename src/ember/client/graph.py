"""Op-graph caching, client side: recognise a recurring op group, register it once, replay it by id.

A *group* is the run of ``Op`` messages a session records between two
*boundaries*. A boundary is anything that is not an op: a read, sync or shape
request, an upload, a custom op, an explicit flush, close. (The idle timer and
the batch size limit split frames, not groups.) In a training loop the group
is the step: the ops recorded between two reads of the loss.

At the end of every group the session keeps it as a *candidate*, indexed by
its first op's name. When the next group starts with that name the session
*holds* its ops instead of queueing them, checking each op's name against the
candidate as it is recorded. At the boundary it canonicalises the held ops
(``canon``): tensor ids become registers (inputs in order of first use, then
positional scalars, then one register per op output), scalar values are
dropped from the structure (only their types stay), and the ids the user
released during the group tell temporaries (outputs released before the
boundary: they never get an id on the server) and consumed inputs (inputs
released: dropped by the replay). If the canonical form equals the
candidate's, the group goes out as ``REPLAY gid, inputs, kept outs, changed
scalars`` -- preceded, the first time and after an eviction, by ``GRAPH gid,
body``. Otherwise the held ops go out unchanged and the group becomes the new
candidate. Replaying is therefore always equivalent to sending the ops: the
same messages, with the same attributes, in the same order, only renamed.

The graph id is a 63-bit hash of the canonical structure (not of scalar
values), so a graph registered in one step serves every later step whatever
its ids and learning rate. The client checks every id it hands out against
its own table, so two different bodies never share an id within a session.

The server keeps a bounded LRU cache of graphs per session and announces its
size in Welcome (``limits["graph_cache"]``). The client mirrors that LRU: the
server sees GRAPH and REPLAY in exactly the order the client queued them, so
the client knows when its GRAPH has been evicted and re-sends it before the
REPLAY, at no round trip. Should the server miss anyway (a server that
evicts for its own reasons), it answers ``[0, NEED_GRAPH, gid]`` and holds
the REPLAY and everything after it; the client re-sends the GRAPH from its
table and the server resumes in order: nothing is lost, nothing reordered.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any

from ..protocol import codec
from ..protocol import messages as m

_OUT, _IN, _SCALAR = 0, 1, 2
_MASK63 = (1 << 63) - 1


class Canon:
    """The canonical form of one group plus the bindings it needs."""

    __slots__ = ("key", "n_in", "scalars", "body", "kept", "consumed", "inputs", "kept_ids", "elide")

    def __init__(self, key: bytes, n_in: int, scalars: list[Any], body: list[list[Any]], kept: list[int],
                 consumed: list[int], inputs: list[int], kept_ids: list[int] | int, elide: set[int]) -> None:
        self.key = key
        self.n_in = n_in
        self.scalars = scalars
        self.body = body
        self.kept = kept
        self.consumed = consumed
        self.inputs = inputs
        self.kept_ids = kept_ids
        self.elide = elide


def canon(ops: list[list[Any]], dropped: set[int] | frozenset[int]) -> Canon | None:
    """Canonicalise a group of OP messages; None when it cannot be a graph (odd messages)."""
    try:
        slots: dict[int, int] = {}
        inputs: dict[int, int] = {}
        scalars: list[Any] = []
        coded: list[tuple[str, list[int], int, Any]] = []
        for msg in ops:
            _, name, args, smask, outs, kwargs = msg
            refs = []
            for i, a in enumerate(args):
                if smask >> i & 1:
                    refs.append(len(scalars) * 3 + _SCALAR)
                    scalars.append(a)
                    continue
                s = slots.get(a)
                if s is not None:
                    refs.append(s * 3 + _OUT)
                    continue
                k = inputs.get(a)
                if k is None:
                    if type(a) is not int:
                        return None
                    k = inputs[a] = len(inputs)
                refs.append(k * 3 + _IN)
            for o in outs:
                if o in slots or o in inputs:
                    return None
                slots[o] = len(slots)
            coded.append((name, refs, len(outs), kwargs))
        n_in, n_s = len(inputs), len(scalars)
        base = n_in + n_s
        body = []
        for name, refs, nouts, kwargs in coded:
            regs = [r // 3 if r % 3 == _IN else n_in + r // 3 if r % 3 == _SCALAR else base + r // 3 for r in refs]
            body.append([name, regs, nouts, kwargs])
        kept, kept_ids, elide = [], [], set()
        first = next(iter(slots), 0)
        dense = True  # every kept id is first + its slot (ids allocated in order): send just `first`
        for tid, s in slots.items():
            if tid in dropped:
                elide.add(tid)
            else:
                kept.append(base + s)
                kept_ids.append(tid)
                if tid != first + s:
                    dense = False
        consumed = []
        for tid, k in inputs.items():
            if tid in dropped:
                consumed.append(k)
                elide.add(tid)
        types = [type(v).__name__ for v in scalars]
        key = codec.packb([n_in, types, body, kept, consumed])
    except (TypeError, ValueError):
        return None
    return Canon(key, n_in, scalars, body, kept, consumed, list(inputs), first if dense else kept_ids, elide)


def graph_id(key: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & _MASK63


class GraphEntry:
    """A graph this client registered (or will): its id, structure and wire body."""

    __slots__ = ("gid", "key", "defaults", "wire")

    def __init__(self, gid: int, c: Canon) -> None:
        self.gid = gid
        self.key = c.key
        self.defaults = c.scalars
        self.wire = [m.GRAPH, gid, c.n_in, c.scalars, c.body, c.kept, c.consumed]

    def overrides(self, scalars: list[Any]) -> list[Any]:
        """``[index, value, ...]`` for every scalar that differs (in value or type) from the registered one."""
        out: list[Any] = []
        for i, (v, d) in enumerate(zip(scalars, self.defaults)):
            if v != d or type(v) is not type(d):
                out.append(i)
                out.append(v)
        return out


class Candidate:
    """A group seen once: the next group starting with the same op is held and compared to it."""

    __slots__ = ("names", "n", "ops", "dropped", "_canon", "entry")

    def __init__(self, ops: list[list[Any]], dropped: set[int]) -> None:
        self.names = [msg[1] for msg in ops]
        self.n = len(ops)
        self.ops: list[list[Any]] | None = ops
        self.dropped: set[int] | None = dropped
        self._canon: Canon | None = None
        self.entry: GraphEntry | None = None

    def key(self) -> bytes | None:
        if self._canon is None:
            if self.ops is None:
                return None
            self._canon = canon(self.ops, self.dropped or set())
            self.ops = self.dropped = None  # keep only the canonical form
            if self._canon is None:
                return None
        return self._canon.key


class GraphTable:
    """The client's graphs by id (bounded) and its mirror of the server's LRU cache."""

    def __init__(self, server_capacity: int, capacity: int = 4096) -> None:
        self.server_capacity = server_capacity
        self.capacity = max(capacity, 4 * server_capacity)
        self.entries: OrderedDict[int, GraphEntry] = OrderedDict()
        self.mirror: OrderedDict[int, None] = OrderedDict()

    def entry_for(self, c: Canon) -> GraphEntry | None:
        """The entry for this structure (new or known); None on an id collision."""
        gid = graph_id(c.key)
        e = self.entries.get(gid)
        if e is not None:
            if e.key != c.key:
                return None
            self.entries.move_to_end(gid)
            return e
        e = self.entries[gid] = GraphEntry(gid, c)
        if len(self.entries) > self.capacity:
            self.entries.popitem(last=False)
        return e

    def touch(self, e: GraphEntry) -> None:
        """Keep a replayed graph's body (it may be asked for again while its REPLAY is in flight)."""
        self.entries[e.gid] = e
        self.entries.move_to_end(e.gid)
        if len(self.entries) > self.capacity:
            self.entries.popitem(last=False)

    def needs_register(self, gid: int) -> bool:
        """Queue-time model of the server cache: True when a GRAPH must precede this REPLAY."""
        mirror = self.mirror
        if gid in mirror:
            mirror.move_to_end(gid)
            return False
        mirror[gid] = None
        if len(mirror) > self.server_capacity:
            mirror.popitem(last=False)
        return True

    def wire(self, gid: int) -> list[Any] | None:
        e = self.entries.get(gid)
        return None if e is None else e.wire
