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

A read need not wait for the whole held group (``grouping.GroupHolding._split_for_read``): when
the group's ops after the value's last write do not write it (the backward and the optimizer's
step after the loss), the group replays as two graphs with the READ between them, and the peer
answers after the first. A group that a read at its end waits for goes out in chunks, each a
replayed graph, as it is recorded (``_chunk_locked``).

A loop that slices a tensor held on the peer at a moving position (``x = data[i:i+n]``) makes groups
that differ only in the offset of an input's layout (a view's offset is in the next op's ``"l"``). When the
peer takes moving layouts (feature ``"offsets"``), two such groups match in their *moved* form
(:meth:`Canon.moved`: every input layout's offset a value, not structure): the graph is registered with
those layouts moving and each REPLAY sends the offsets that differ from the registered ones; the peer
checks each against its storage at every replay.

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
import operator
from collections import OrderedDict
from typing import Any

from ..protocol import codec
from ..protocol import messages as m
from .known import written_args

_MASK63 = (1 << 63) - 1


class Canon:
    """The canonical form of one group (what must match) plus the bindings it needs (what may differ).

    ``shape`` holds one ``[name, smask, refs, n_outs]`` per op, where a tensor argument is
    ``s >= 0`` (the output of the group's s-th output slot) or ``~k`` (the group's k-th
    input) and a scalar argument is ``None``; ``kws`` the ops' keyword arguments; ``types``
    the scalars' types. Two groups are the same graph when all of these, ``kept`` and
    ``consumed`` are equal (keyword arguments compared by their encoding, so True != 1).
    """

    __slots__ = ("shape", "kws", "types", "kept", "consumed", "scalars", "inputs", "kept_ids", "elide",
                 "n_slots", "_kwb", "movable", "moving", "offsets", "raw_kws", "_moved")

    def __init__(self, shape: list[list[Any]], kws: list[Any], scalars: list[Any], kept: list[int],
                 consumed: list[int], inputs: list[int], kept_ids: list[int] | int, elide: set[int],
                 n_slots: int) -> None:
        self.shape = shape
        self.kws = kws
        self.scalars = scalars
        self.types = [type(v) for v in scalars]
        self.kept = kept
        self.consumed = consumed
        self.inputs = inputs
        self.kept_ids = kept_ids
        self.elide = elide
        self.n_slots = n_slots
        self._kwb: bytes | None = None
        self.movable = False  # the peer takes moving layouts (feature "offsets"): :meth:`moved` may be tried
        #: a moved form's flat [op, operand, ...] of the inputs' layouts whose offsets are values, not structure
        self.moving: list[int] | None = None
        self.offsets: list[int] = []  # their offsets in this group
        self.raw_kws = kws  # the keyword arguments with those offsets in place (what a GRAPH carries)
        self._moved: Canon | None = None

    def kw_bytes(self) -> bytes:
        if self._kwb is None:
            self._kwb = codec.packb(self.kws)
        return self._kwb

    def same(self, other: "Canon") -> bool:
        if not self.same_frame(other):
            return False
        if all(map(operator.is_, self.kws, other.kws)):  # the very objects (a cached plan's keyword arguments):
            return self._kwb is not None or other._kwb is not None  # encoded alike, and one side was shown encodable
        try:
            return self.kw_bytes() == other.kw_bytes()
        except Exception:  # noqa: BLE001 - a value the protocol cannot carry: not this graph
            return False

    def same_frame(self, other: "Canon") -> bool:
        """The same ops on the same registers (keyword arguments aside)."""
        return self.shape == other.shape and self.types == other.types and self.kept == other.kept \
            and self.consumed == other.consumed

    def moved(self) -> "Canon | None":
        """This group with the offsets of its inputs' layouts as values (GRAPH's ``moving``): a loop that reads a
        tensor on the peer through a view at a moving position (``data[i:i+n]``) is one graph. None when no ATen
        op reads an input through a layout. Every input layout moves, whatever its offset, so that two groups'
        moved forms compare alike; a REPLAY sends the offsets that differ from the registered ones."""
        if self._moved is not None or self.moving is not None:
            return self._moved if self.moving is None else self
        kws = list(self.kws)
        moving: list[int] = []
        offsets: list[int] = []
        for i, (_, smask, refs, _) in enumerate(self.shape):
            kw = kws[i]
            if smask != 1 or type(kw) is not dict:
                continue
            lays = kw.get("l")
            if type(lays) is not list or len(lays) != len(refs) - 1:
                continue
            masked = None
            for t, lay in enumerate(lays):
                r = refs[t + 1]
                if r is not None and r < 0 and type(lay) is list and len(lay) == 4 and type(lay[2]) is int:
                    if masked is None:
                        masked = list(lays)
                    masked[t] = [lay[0], lay[1], None, lay[3]]
                    moving += (i, t)
                    offsets.append(lay[2])
            if masked is not None:
                kw = dict(kw)
                kw["l"] = masked
                kws[i] = kw
        if not moving:
            return None
        c = Canon(self.shape, kws, self.scalars, self.kept, self.consumed, self.inputs, self.kept_ids, self.elide,
                  self.n_slots)
        c.movable, c.moving, c.offsets, c.raw_kws = True, moving, offsets, self.kws
        self._moved = c
        return c

    def take(self, c: "Canon") -> None:
        """Become ``c``, this group's moved form (matched as such: registered and replayed so)."""
        self.kws, self._kwb, self.moving, self.offsets, self.raw_kws = c.kws, c._kwb, c.moving, c.offsets, c.raw_kws

    @property
    def n_in(self) -> int:
        return len(self.inputs)

    def key(self) -> bytes:
        """The structure's encoding: what the graph id is a hash of."""
        return codec.packb([self.shape, [t.__name__ for t in self.types], self.kept, self.consumed, self.kws])

    def wire_body(self) -> tuple[list[list[Any]], list[int]]:
        """(body, kept registers) in the register numbering of the GRAPH message."""
        n_in, n_s = len(self.inputs), len(self.scalars)
        base = n_in + n_s
        body = []
        j = n_in
        for (name, _smask, refs, nouts), kw in zip(self.shape, self.raw_kws):
            regs = []
            for r in refs:
                if r is None:
                    regs.append(j)
                    j += 1
                else:
                    regs.append(base + r if r >= 0 else ~r)
            body.append([name, regs, nouts, kw])
        return body, [base + s for s in self.kept]


def canon(ops: list[list[Any]], dropped: set[int] | frozenset[int], check_kws: bool = True) -> Canon | None:
    """Canonicalise a group of OP messages; None when it cannot be a graph (odd messages, or values
    that cannot be encoded: a GRAPH and its REPLAYs are then always encodable). ``check_kws=False``: the
    keyword arguments are encoded only when compared (:meth:`Canon.same`): a held group whose ops carry
    the candidate's own keyword objects, as cached plans' do, is never encoded.

    Runs once per held group at its boundary, so it is written for speed: one pass,
    no comprehension frames, dict lookups through bound methods.
    """
    slots: dict[int, int] = {}
    inputs: dict[int, int] = {}
    scalars: list[Any] = []
    shape: list[list[Any]] = []
    kws: list[Any] = []
    sget, iget = slots.get, inputs.get
    n = 0
    try:
        for _, name, args, smask, outs, kwargs in ops:
            refs: list[Any] = []
            i = 0
            for a in args:
                if smask and smask >> i & 1:
                    scalars.append(a)
                    refs.append(None)
                else:
                    r = sget(a)
                    if r is None:
                        r = iget(a)
                        if r is None:
                            if type(a) is not int:
                                return None
                            r = inputs[a] = len(inputs)
                        r = ~r
                    refs.append(r)
                i += 1
            for o in outs:
                slots[o] = n
                n += 1
            shape.append([name, smask, refs, len(outs)])
            kws.append(kwargs)
    except (TypeError, ValueError):
        return None
    if len(slots) != n:
        return None  # an id used twice as an output
    try:  # a value the protocol cannot carry: not a graph (sent as ops, the batch drops that one alone)
        kwb = codec.packb(kws) if check_kws else None
        codec.packb(scalars)
    except Exception:
        return None
    first = next(iter(slots), 0)
    if dropped:
        kept: list[int] = []
        kept_ids: list[int] = []
        elide: set[int] = set()
        dense = True  # every kept id is first + its slot (ids allocated in order): send just `first`
        for tid, sl in slots.items():
            if tid in dropped:
                elide.add(tid)
            else:
                kept.append(sl)
                kept_ids.append(tid)
                if tid != first + sl:
                    dense = False
        consumed = []
        for tid, k in inputs.items():
            if tid in dropped:
                consumed.append(k)
                elide.add(tid)
    else:
        kept, kept_ids, elide, consumed = list(range(n)), list(slots), set(), []
        dense = kept_ids[-1] - first == n - 1 and all(tid == first + sl for tid, sl in slots.items()) if n else True
    c = Canon(shape, kws, scalars, kept, consumed, list(inputs), first if dense else kept_ids, elide, n)
    c._kwb = kwb
    return c


def graph_id(key: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & _MASK63


class GraphEntry:
    """A graph this client registered (or will): its id, structure and wire body."""

    __slots__ = ("gid", "key", "defaults", "wire", "offsets", "shape", "written")

    def __init__(self, gid: int, key: bytes, c: Canon) -> None:
        self.gid = gid
        self.key = key
        self.shape = c.shape
        self.written: frozenset[int] | None = None  # the inputs its ops may write (ClientSession.replay_graph)
        self.defaults = c.scalars
        body, kept = c.wire_body()
        self.wire = [m.GRAPH, gid, c.n_in, c.scalars, body, kept, c.consumed]
        self.offsets = c.offsets  # (moving layouts: their offsets as registered)
        if c.moving is not None:
            self.wire.append(c.moving)

    def overrides(self, scalars: list[Any]) -> list[Any]:
        """``[index, value, ...]`` for every scalar that differs (in value or type) from the registered one."""
        return _changes(scalars, self.defaults)

    def moved(self, offsets: list[int]) -> list[int] | None:
        """A REPLAY's ``offsets`` (``[index, offset, ...]`` for each that differs from the registered one), or
        None for a graph that moves no layout."""
        return _changes(offsets, self.offsets) if self.offsets else None


def written_inputs(shape: list[list[Any]], op_writes: Any, op_written: Any) -> frozenset[int]:
    """The inputs (by index) a graph's ops may write (:func:`.known.written_args` of each op over its canonical
    references: an input is ``~index``)."""
    return frozenset(~r for name, smask, refs, _n in shape
                     for r in written_args(name, refs, smask, op_writes, op_written) if r < 0)


def _changes(values: list[Any], registered: list[Any]) -> list[Any]:
    """``[index, value, ...]`` for every value that differs (in value or type) from the registered one."""
    out: list[Any] = []
    for i, (v, d) in enumerate(zip(values, registered)):
        if v != d or type(v) is not type(d):
            out.append(i)
            out.append(v)
    return out


class Candidate:
    """A group seen once: the next group starting with the same op is held and compared to it."""

    __slots__ = ("names", "n", "ops", "dropped", "_canon", "entry", "split", "late", "late_seen", "chunks", "tail",
                 "cut")

    def __init__(self, ops: list[list[Any]], dropped: set[int]) -> None:
        self.names = [msg[1] for msg in ops]
        self.n = len(ops)
        self.ops: list[list[Any]] | None = ops
        self.dropped: set[int] | None = dropped
        self._canon: Canon | None = None
        self.entry: GraphEntry | None = None
        #: (k, first k ops, the rest) when a read split this group at op k (``GroupHolding._split_for_read``)
        self.split: tuple[int, Candidate, Candidate] | None = None
        #: > 0: reads at this group's end wait for (nearly) all of it (``late_seen``: so many times in a row):
        #: held, it goes out in chunks of this many ops (``GroupHolding._chunk_locked``), each a graph of its
        #: own, kept in ``chunks`` by its first op's index
        self.late = self.late_seen = 0
        #: > 0: the last chunk ends at this op, where the value read is final (the forward's end); chunks of ``late``
        #: ops come before it, none after (``GroupHolding._chunk_plan``)
        self.cut = 0
        self.chunks: dict[int, Candidate] | None = None
        #: how many of its last ops made the value read at its end last time (``GroupHolding._read_tail``): no
        #: chunk takes them, so that they go after the last chunk with the read, in a batch of their own
        self.tail = 0

    def matches(self, k: Canon) -> bool:
        """Is ``k`` (a held group) this candidate's graph? (canonicalises the candidate once) When the two differ
        only in the offsets of their inputs' layouts (``k.movable``: the peer takes those as values), both
        become their moved forms (:meth:`Canon.moved`): ``k`` is then registered and replayed so."""
        c = self._canon
        if c is None:
            if self.ops is None:
                return False
            c = self._canon = canon(self.ops, self.dropped or set())
            self.ops = self.dropped = None  # keep only the canonical form
            if c is None:
                return False
        if c.moving is None:
            if c.same(k):
                return True
            if not k.movable or not c.same_frame(k):
                return False
            c = c.moved()
            if c is None:
                return False
        km = k.moved()
        if km is None or not c.same(km):
            return False
        if self._canon is not c:  # (from now on the candidate is its moved form, registered anew)
            self._canon, self.entry = c, None
        k.take(km)
        return True


class GraphTable:
    """The client's graphs by id (bounded) and its mirror of the server's LRU cache."""

    def __init__(self, server_capacity: int, capacity: int = 4096) -> None:
        self.server_capacity = server_capacity
        self.capacity = max(capacity, 4 * server_capacity)
        self.entries: OrderedDict[int, GraphEntry] = OrderedDict()
        self.mirror: OrderedDict[int, None] = OrderedDict()

    def entry_for(self, c: Canon) -> GraphEntry | None:
        """The entry for this structure (new or known); None on an id collision."""
        key = c.key()
        gid = graph_id(key)
        e = self.entries.get(gid)
        if e is not None:
            if e.key != key:
                return None
            self.entries.move_to_end(gid)
            return e
        e = self.entries[gid] = GraphEntry(gid, key, c)
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
