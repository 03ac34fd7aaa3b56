"""Op-graph caching on the recording side of a :class:`~ember.client.session.ClientSession`.

A mixin of the session, run under its lock: holding a group of ops while it matches the previous
group's candidate (:mod:`ember.client.graph`), cutting a long boundary-free run at its period with
soft boundaries, and queueing a matched group as one ``REPLAY`` (with its ``GRAPH`` the first time).
It relies on the session's ``_pending``, ``_held``, ``_cand``, ``_graphs`` and flush methods.
"""

from __future__ import annotations

import time
from typing import Any

from ..protocol import messages as m
from .graph import Candidate, canon, written_inputs


#: a held group that a read at its end waits for goes out in about CHUNKS chunks of at least CHUNK_MIN ops
CHUNKS, CHUNK_MIN = 8, 16
#: at most this many of a chunked group's last ops are the read's own (``GroupHolding._read_tail``)
TAIL_MAX = 8
#: when the value read at a chunked group's end is final early (the loss), the ops up to there go in this many chunks
FORWARD_CHUNKS = 2


class GroupHolding:
    """Holding and replaying recurring op groups (a mixin of ClientSession, under its lock)."""
    def _boundary_locked(self) -> None:
        """What is recorded next starts a new op group (a read, a request, a whole graph, a message alone)."""
        g = self._grp
        if g is None or g:
            self._end_group()

    def _arm_locked(self) -> None:
        """Something waits to be sent: the idle tick sends it (and bounds a hold by graph_hold)."""
        self._active = True
        if not self._ticking:
            self._ticking = True
            self.loop.call_soon_threadsafe(self._arm_tick)

    def _start_hold(self, c: Candidate, msg: list[Any]) -> None:
        self._cand = c
        self._grp = [msg]
        self._hold_t0 = time.monotonic()
        self._arm_locked()

    def _switch_candidate(self, n: int, name: str) -> bool:
        """The held ops left the candidate at op ``n``: follow another one with the same first ``n`` ops."""
        c = self._cand
        assert c is not None
        for other in self._cands.get(c.names[0], ()):
            if other is not c and other.n > n and other.names[n] == name and other.names[:n] == c.names[:n]:
                self._cand = other
                return True
        return False

    def _soft_boundary(self) -> None:
        """End a period's group; after several periods in a row that did not replay, stop cutting."""
        replays = self.stats["replays"]
        self._end_group()
        if self.stats["replays"] != replays:
            self._misses = 0
        else:
            self._misses += 1
            if self._misses > 4:  # (an inner loop's period, not the step's: hold whole steps instead)
                self._period = -1
                self._no_period = True

    def _too_long(self, g: list[list[Any]]) -> None:
        """The group reached ``_g_cut`` ops. If the ops repeat with a period (a loop with no read in it),
        realign the group on that period so that soft boundaries cut it into equal steps; else let it grow
        (a long step: an LSTM's is ~1000 ops) up to ``_g_max``, where capturing stops until the next boundary."""
        n = len(g)
        if n >= self._g_max:
            self._grp = None
            self._grp_drops = []
            return
        if self._no_period:
            return
        names = [msg[1] for msg in g]
        for p in range(max(self._g_min, self.graph_min_period), n // 2 + 1):
            if names[n - 2 * p:n - p] == names[n - p:]:  # the last two periods are the same ops
                self._period, self._misses = p, 0
                self._grp = []  # cut here: from the next op on, every p ops are a group
                self._grp_drops = []
                return

    def _release_held(self) -> None:
        """The held group diverged from its candidate (or was held too long): send its ops as they are (those
        not sent in chunks already)."""
        self._cand = None
        g = self._grp
        assert g is not None
        start, self._cstart = self._cstart, 0
        self._spill(g[start:] if start else g)

    def _chunk_locked(self, g: list[list[Any]]) -> None:
        """The held group follows a candidate that a read at its end waits for (``Candidate.late``): its ops
        recorded since the last chunk go out now, as a graph of their own when they match the chunk seen there
        last time (else as they are), so that the peer runs them while the rest is recorded. A chunk keeps the
        results that nothing released yet (they may be used later); those released later are dropped by the
        replay that consumes them, or by a DROP."""
        c = self._cand
        assert c is not None
        start, n = self._cstart, len(g)
        self._cstart = n
        self._queue_chunk(c, start, g[start:])
        self._hold_t0 = time.monotonic()  # (what is held now is recorded since this chunk)

    def _released(self, gdrops: list[int]) -> set[int]:
        """The ids the user released while the group was recorded: those already sent (``gdrops``) and those
        waiting for the next batch."""
        dropped = set(gdrops)
        dropped.update(self._drops)
        return dropped

    def _queue_chunk(self, c: Candidate, start: int, ops: list[list[Any]], keep: Any = ()) -> None:
        """Queue a chunk of the held group (``keep``: ids that later ops use, never elided as temporaries)."""
        dropped = self._released(self._grp_drops).difference(keep)
        k = self._canon(ops, dropped)
        chunks = c.chunks
        if chunks is None:
            chunks = c.chunks = {}
        cc = chunks.get(start)
        if k is not None and cc is not None and cc.n == len(ops) and cc.matches(k) and self._queue_replay(cc, k):
            return
        chunks[start] = Candidate(ops, dropped)
        self._spill(ops)

    def _spill(self, ops: list[list[Any]]) -> None:
        """Queue held ops, in batches of at most ``max_batch`` (a group may be longer than a batch)."""
        mb = self.max_batch
        p = self._pending
        while len(p) + len(ops) > mb:
            k = max(0, mb - len(p))
            p.extend(ops[:k])
            ops = ops[k:]
            self._flush_locked(False, drops_too=False)
            p = self._pending
        p.extend(ops)
        if len(p) >= mb:  # (every caller flushes or arms the idle timer next)
            self._flush_locked(False)

    def _end_group(self) -> None:
        """A boundary: replay the held group if it matches its candidate, else remember it as one."""
        if not self._g_on:
            return
        g, c, gdrops = self._grp, self._cand, self._grp_drops
        self._grp, self._cand, self._grp_drops = [], None, []
        timed_out, self._timed_out = self._timed_out, None
        if c is not None and not self._at_read:  # (ended by an upload, a flush...: no read waited for it)
            c.late = c.late_seen = 0
        start, self._cstart = self._cstart, 0
        if start:  # the held group went out in chunks: its last one now (as ops if it ended early)
            assert c is not None and g is not None
            if len(g) == c.n:
                n, written = self._read_tail(g, self._read_tid)
                # (learnt: no chunk takes them next time; their inputs then made a chunk or more before them)
                c.tail = n if written <= len(g) - c.late else 0
                tail = min(n, len(g) - start) if c.tail and written <= start else 0
                if not tail:
                    self._queue_chunk(c, start, g[start:])
                    return
                # the ops that make the read's value alone, in a batch of their own (with the read): the peer may run
                # it ahead of queued chunks that cannot change it (server/read_ahead.py). What they use is neither
                # a temporary of the chunk nor dropped before them (a release waits until they are queued).
                used = {x for op in g[len(g) - tail:] for x in op[2] if type(x) is int}
                held = [i for i in self._drops if i in used]
                for i in held:
                    self._drops.remove(i)
                if tail < len(g) - start:
                    self._queue_chunk(c, start, g[start:len(g) - tail], used)
                self._flush_locked(False, drops_too=False)
                self._spill(g[len(g) - tail:])
                self._drops.extend(held)
            else:
                self._spill(g[start:])
            return
        if not g:
            return
        if len(g) < self._g_min:
            if c is not None:
                self._spill(g)
            return
        dropped = self._released(gdrops)
        first = g[0][1]
        cl = self._cands.get(first)
        if timed_out is not None and c is None and len(g) == timed_out.n:
            k = self._canon(g, dropped)  # it would have replayed, had it been held long enough: hold longer
            if k is not None and timed_out.matches(k):
                self._hold_s = min(self.graph_hold_max, max(self._hold_s, 2 * (time.monotonic() - self._hold_t0)))
        if c is not None:
            k = self._canon(g, dropped) if len(g) == c.n else None
            if k is not None and cl:
                for i, cand in enumerate(cl):  # same ops, maybe another aliasing or release pattern
                    if cand.n == c.n and cand.matches(k) and self._queue_replay(cand, k):
                        if i:
                            cl.insert(0, cl.pop(i))
                        return
            self._spill(g)
        if cl is None:
            cands = self._cands
            if len(cands) >= 64:
                cands.pop(next(iter(cands)))
            cl = cands[first] = []
        cl.insert(0, Candidate(g, dropped))
        if len(cl) > 4:
            cl.pop()

    def _read_tail(self, g: list[list[Any]], tid: int | None) -> tuple[int, int]:
        """(n, w): how many of the chunked group's last ops (at most ``TAIL_MAX``) only make the value ``tid`` being
        read (``torch.isnan(loss)`` after the backward): ops that write nothing but their results, each making something
        the read or a later one of them uses; and how many of the group's ops come up to the last one that may
        write their other inputs (:func:`_final_at`: the loss, made by the forward, when what the peer still runs
        of the group cannot change them). (0, 0) when there are none such, or but at a read on a network link."""
        writes = self.op_writes
        if tid is None or writes is None:
            return 0, 0
        need, made, n = {tid}, set(), 0
        for j in range(len(g) - 1, max(0, len(g) - TAIL_MAX) - 1, -1):
            op = g[j]
            if need.isdisjoint(op[4]) or writes(op[1]) is not False:
                break
            smask = op[3]
            made.update(op[4])
            need.update(a for i, a in enumerate(op[2]) if not smask >> i & 1 and type(a) is int)
            n += 1
        if not n:
            return 0, 0
        head = g[:len(g) - n]
        return n, max((_final_at(head, t, writes) for t in need - made), default=0)  # (its inputs from before it)

    def _request_locked(self, msg: list[Any]) -> None:
        """Queue the request ``msg`` (READ, SYNC, ...) at a boundary, after everything recorded before it; a READ
        of a value the held group computes early goes between the group's two parts (:meth:`_split_for_read`).
        Not on the embedded peer's link (``_direct``): its worker shares this process's GIL, so running the rest
        of a step while the caller records the next one only makes the two threads take turns (measured: a
        GPT's loop reading its loss every step, 0.61x -> 0.49x local)."""
        self._after_read = 0
        if msg[0] != m.READ or self._cand is None or self.op_writes is None or self._direct is not None \
                or not self._split_for_read(msg):
            self._at_read = True  # (the held group ends at a read: _end_group keeps what _split_for_read learned)
            self._read_tid = msg[2] if msg[0] == m.READ and self._direct is None and len(msg) == 3 else None
            try:
                self._boundary_locked()
            finally:
                self._at_read = False
                self._read_tid = None
            self._pending.append(msg)

    def _split_for_read(self, msg: list[Any]) -> bool:
        """A read of a value that the held group's last ops leave alone (``loss.item()`` after the backward and
        the optimizer's step: they read the loss, none writes it): replay the group as two graphs, the ops up to
        the value's last write and the rest, with the READ between them. The peer answers once the first part
        has run and runs the rest while the caller goes on: the caller waits for the forward, not the step. A value
        the group does not write at all is read before the group.

        The same ops in the same order; only the answer overtakes the ops that cannot change it (which ops may
        write their arguments is the frontend's ``op_writes``; an unknown one may). The first time a group
        splits here it goes out whole, as before; from the next time on, if both parts match, split. False:
        nothing was queued (the caller ends the group as usual)."""
        g, c = self._grp, self._cand
        assert c is not None and g is not None
        if len(g) != c.n or self._poisoned:
            return False
        k = _final_at(g, msg[2], self.op_writes)
        if 4 * k > 3 * len(g):  # the read waits for (nearly) all of the group: the second time in a row, the
            c.late_seen += 1  # group goes out in chunks as it is recorded from then on (_chunk_locked)
            if c.late_seen >= 2 and not c.late:
                size, c.cut = self._chunk_plan(g, msg)
                c.late = max(CHUNK_MIN, size)
        else:
            c.late = c.late_seen = 0
        if k >= len(g) or self._cstart:
            return False
        self.stats["split_reads"] += 1  # (reads that need not wait for the whole step: torch/_compile.py)
        if not k:  # the group does not write the value: the read goes first, the group after it
            self._pending.append(msg)
            self._boundary_locked()
            return True
        a, b = g[:k], g[k:]
        dropped = self._released(self._grp_drops)
        used = {x for op in b for x in op[2] if type(x) is int}  # (what the rest uses stays for it)
        ka, kb = self._canon(a, dropped - used), self._canon(b, dropped)
        if ka is None or kb is None:
            return False
        pair = c.split
        if pair is None or pair[0] != k or not (pair[1].matches(ka) and pair[2].matches(kb)):
            c.split = (k, Candidate(a, dropped - used), Candidate(b, dropped))
            return False
        ea, eb = self._entry(pair[1], ka), self._entry(pair[2], kb)
        if ea is None or eb is None:  # id collision with another body: not split
            c.split = None
            return False
        self._grp, self._cand, self._grp_drops, self._timed_out = [], None, [], None
        self._replay_held(ea, k, ka)
        p = self._pending
        p.append(msg)
        self._replay_held(eb, len(b), kb)
        self._after_read = len(b) + 2  # (the work sent after the read: client/exchange.py's estimate of its wait)
        if self._drops:
            self._drops_after(p, ka.elide | kb.elide)
        return True

    def _chunk_plan(self, g: list[list[Any]], msg: list[Any]) -> tuple[int, int]:
        """(size, cut): how the group goes out in chunks once a read at its end waits for it. In general, chunks of
        about a CHUNKS-th of it, and no cut (0). When the value read is made by a tail of ops whose inputs are final
        well before (``torch.isnan(loss)`` after the backward: :meth:`_read_tail`), the ops up to that point (the
        forward) go in FORWARD_CHUNKS chunks, the last ending there (the cut), and the rest (the backward) at the
        read: the read then waits for the forward alone (the peer runs it between two steps of the backward:
        server/read_ahead.py), the peer starts the forward while the caller records it, and few chunks cut the
        step (each costs the peer its kept values' bookkeeping)."""
        size = len(g) // CHUNKS
        n, written = self._read_tail(g, msg[2] if len(msg) == 3 else None)
        if not n or not 0 < written < len(g) - n:
            return size, 0
        return -(-written // FORWARD_CHUNKS), written

    def _queue_replay(self, c: Candidate, k: Any) -> bool:
        if self._poisoned and any(i in self._poisoned for i in k.inputs):
            return False  # sent as ops instead: they inherit the poison here (client/batch.py)
        e = self._entry(c, k)
        if e is None:  # id collision with another body: this group is not cached
            return False
        p = self._replay_held(e, c.n, k)
        if k.elide:
            self._drops_after(p, k.elide)
        if len(p) >= self.max_batch:  # (every caller flushes or arms the idle timer next)
            self._flush_locked(False)
        else:  # sent with what the boundary adds (a read, the next step's batch upload), at the next op
            self._send_soon = True  # (or by the idle timer): one frame and one write for them, not two
        return True

    def _entry(self, c: Candidate, k: Any) -> Any:
        """The graph entry of candidate ``c`` (registered from ``k``, its canonical form, the first time); None
        when its id collides with another body's."""
        if c.entry is None:
            c.entry = self._gtable.entry_for(k)
        return c.entry

    def _drops_after(self, p: list[list[Any]], elide: set[int]) -> None:
        """The releases recorded so far, as a DROP after a replay, less what the replay elides (temporaries never
        exist on the peer; consumed inputs are dropped by the replay itself)."""
        drops = self._drops
        ids = []
        while drops:
            ids.append(drops.popleft())
        rest = [i for i in ids if i not in elide]
        if rest:
            p.append([m.DROP, rest])

    def _canon(self, ops: list[list[Any]], dropped: set[int]) -> Any:
        """A held group's canonical form (:func:`~ember.client.graph.canon`), movable when the peer takes moving
        layouts."""
        k = canon(ops, dropped, check_kws=False)
        if k is not None:
            k.movable = self._g_offsets
        return k

    def _replay_held(self, e: Any, n_ops: int, k: Any) -> list[Any]:
        """Append a REPLAY of graph entry ``e`` for held ops whose canonical form is ``k`` (its bindings: inputs,
        kept ids, changed scalars and offsets); returns the batch."""
        return self._append_replay(e, n_ops, k.inputs, k.kept_ids, e.overrides(k.scalars), e.moved(k.offsets))

    def _append_replay(self, e: Any, n_ops: int, inputs: list[int], outs: list[Any], overrides: list[Any],
                       offsets: list[int] | None = None) -> list[Any]:
        """Append a REPLAY of graph entry ``e`` to the pending batch (its GRAPH first when the peer's cache
        lacks it); returns the batch. ``offsets``: a graph's moving layouts' (``GraphEntry.moved``)."""
        table = self._gtable
        table.touch(e)
        p = self._pending
        if table.needs_register(e.gid):
            p.append(e.wire)
            self.stats["graphs"] += 1
        p.append([m.REPLAY, e.gid, inputs, outs, overrides] if offsets is None else
                 [m.REPLAY, e.gid, inputs, outs, overrides, offsets])
        self.stats["replays"] += 1
        self.stats["replayed_ops"] += n_ops
        return p

    # ---- whole graphs captured by a frontend (ember.torch.capture, torch.compile) -------------
    def group_room(self) -> int:
        """How many more ops the op group being recorded can take and still be replayed as one graph (0: none,
        the session groups no ops now). A frontend with a captured graph of fewer ops records them into the group
        rather than replaying its graph alone, so that the step's graphs and the eager ops between them become one
        graph: what one of them hands the next (a forward's tensors saved for the backward) never gets an id."""
        g = self._grp
        return 0 if g is None else self._g_max - len(g)

    def graph_entry(self, c: Any) -> Any:
        """The registration of a captured graph (a :class:`~ember.client.graph.Canon`), or None when this
        session cannot replay graphs (the peer caches none) or its id collides with another body."""
        if not self._g_on or len(c.shape) > m.MAX_GRAPH_OPS:
            return None
        with self._lock:
            return self._gtable.entry_for(c)

    def replay_graph(self, e: Any, n_ops: int, inputs: list[int], outs: list[int], overrides: list[Any]) -> None:
        """Queue one REPLAY of a captured graph (its GRAPH first when the peer's cache lacks it): a
        boundary, as a read is. ``outs`` may name ids the session already holds: the peer replaces them.
        ``overrides``: ``e.overrides(scalars)`` for the scalars this replay runs with."""
        if self.lost is not None:
            raise self._lost_error()
        if self.known:  # (what the graph writes: the inputs its ops may write, and the held ids it replaces)
            w = e.written
            if w is None:
                w = e.written = written_inputs(e.shape, self.op_writes, self.op_written)
            self._unknow([m.REPLAY, [x for k, x in enumerate(inputs) if k in w], outs])
        with self._lock:
            self._boundary_locked()
            p = self._append_replay(e, n_ops, inputs, outs, overrides)
            self._arm_locked()
            if len(p) >= self.max_batch:
                self._flush_locked(False)
            else:
                self._send_now_locked()


def _final_at(g: list[list[Any]], tid: int, writes: Any) -> int:
    """How many of the group's ops come up to the last one that may write storage ``tid`` (its output, or
    an argument of an op that may write its arguments): 0 when none does."""
    for j in range(len(g) - 1, -1, -1):
        op = g[j]
        if tid in op[4] or tid in op[2] and writes(op[1]) is not False:
            return j + 1
    return 0
