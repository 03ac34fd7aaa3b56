"""Graph protocol, sans I/O: the interpreter's GRAPH/REPLAY handling, LRU, stalls, validation."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from ember.client.graph import GraphTable, canon
from ember.protocol import codec
from ember.protocol import messages as m
from ember.server.execute.backends import make_backend
from ember.server.execute.graph_cache import GraphCache, compile_graph
from ember.server.execute.interpreter import Interpreter, build_table

OP, UPLOAD, READ, GRAPH, REPLAY, DROP = m.OP, m.UPLOAD, m.READ, m.GRAPH, m.REPLAY, m.DROP


class Peer:
    """An interpreter fed through the codec, collecting its responses."""

    def __init__(self, graph_cache: int = 4) -> None:
        backend = make_backend("cpu")
        self.responses: list[list[Any]] = []
        limits = {"max_frame": 1 << 26, "chunk": 1 << 24, "max_tensor": 1 << 40, "graph_cache": graph_cache}
        self.interp = Interpreter(backend, build_table(backend), {}, self._respond, limits)

    def _respond(self, out: list[list[Any]]) -> None:
        self.responses.extend(codec.unpackb(codec.packb(out)))

    def send(self, *msgs: list[Any]) -> None:
        self.interp.run_batch(codec.decode_batch(codec.packb(list(msgs)), 1 << 27))

    def upload(self, tid: int, arr: np.ndarray) -> list[Any]:
        return [UPLOAD, tid, arr.dtype.name, list(arr.shape), 0, arr.tobytes(), arr.nbytes]

    def value(self, req: int) -> Any:
        for r, status, payload in self.responses:
            if r == req:
                if status != m.OK:
                    return ("error", payload["op"], payload["message"])
                dt, shape, _, data, _ = payload
                return np.frombuffer(data, dtype=dt).reshape(shape).tolist()
        raise AssertionError(f"no response {req}: {self.responses}")


def group(x: int, first_out: int, lr: float) -> list[list[Any]]:
    """y = exp(x) * lr + x ; z = y - 1 (y a temporary, z kept)."""
    return [[OP, "exp", [x], 0, [first_out], None],
            [OP, "multiply", [first_out, lr], 2, [first_out + 1], None],
            [OP, "add", [first_out + 1, x], 0, [first_out + 2], None],
            [OP, "subtract", [first_out + 2, 1.0], 2, [first_out + 3], None]]


def graph_of(ops: list[list[Any]], dropped: set[int], table: GraphTable | None = None) -> tuple[list[Any], Any]:
    k = canon(ops, dropped)
    assert k is not None
    e = (table or GraphTable(4)).entry_for(k)
    assert e is not None
    return e.wire, [REPLAY, e.gid, k.inputs, k.kept_ids, e.overrides(k.scalars)]


def test_replay_equals_the_ops_it_stands_for() -> None:
    raw, cached = Peer(), Peer()
    x = np.arange(4.0)
    for p in (raw, cached):
        p.send(p.upload(1, x))
    ops = group(1, 10, 0.5)
    raw.send(*ops, [DROP, [10, 11, 12, 1]], [READ, 1, 13])
    table = GraphTable(4)
    wire, rep = graph_of(ops, dropped={10, 11, 12, 1}, table=table)
    assert rep[3] == 10  # dense ids: just the id of the first output; kept z is 10 + its slot (3)
    cached.send(wire, rep, [READ, 1, 13])
    assert raw.value(1) == cached.value(1)
    assert cached.interp.held() == raw.interp.held() == 1  # z: temporaries never existed, x was consumed
    # a second step with another scalar: only the changed scalar travels
    ops2 = group(13, 20, 0.25)
    _, rep2 = graph_of(ops2, dropped={20, 21, 22, 13}, table=table)
    assert rep2[1] == rep[1] and rep2[4] == [0, 0.25]
    raw.send(*ops2, [DROP, [20, 21, 22, 13]], [READ, 2, 23])
    cached.send(rep2, [READ, 2, 23])
    assert raw.value(2) == cached.value(2)
    assert cached.interp.held() == raw.interp.held() == 1  # 13 was consumed by the replay


def test_unknown_graph_stalls_everything_after_it_until_the_graph_arrives() -> None:
    p = Peer(graph_cache=4)
    p.send(p.upload(1, np.arange(3.0)))
    ops = group(1, 10, 2.0)
    wire, rep = graph_of(ops, dropped={10, 11, 12})
    # the replay misses; later batches are already in flight and depend on its output
    p.send([OP, "negative", [1], 0, [5], None], [READ, 1, 5], rep, [READ, 2, 13])
    p.send([OP, "multiply", [13, 10.0], 2, [14], None], [READ, 3, 14])
    assert [r[1] for r in p.responses] == [m.OK, m.NEED_GRAPH]  # work before the replay ran
    assert p.responses[1] == [0, m.NEED_GRAPH, rep[1]]
    p.send([OP, "add", [14, 1.0], 2, [15], None], [READ, 4, 15])
    assert len(p.responses) == 2
    p.send(wire, [READ, 5, 1])  # the client's re-sent GRAPH (it arrives after the in-flight batches)
    z = (np.exp(np.arange(3.0)) * 2.0 + np.arange(3.0) - 1.0)
    assert p.value(2) == z.tolist()
    assert p.value(3) == (z * 10).tolist()
    assert p.value(4) == (z * 10 + 1).tolist()
    assert [r[0] for r in p.responses[2:]] == [2, 3, 4, 5]  # in order


def test_lru_evicts_least_recently_used_and_the_client_mirror_agrees() -> None:
    cache, table = GraphCache(2), GraphTable(2)
    backend = make_backend("cpu")
    tbl = build_table(backend)
    wires = []
    for name in ("exp", "sin", "cos"):
        k = canon([[OP, name, [1], 0, [2], None], [OP, name, [2], 0, [3], None]], set())
        assert k is not None
        e = table.entry_for(k)
        assert e is not None
        wires.append(e.wire)
    seq = [0, 1, 0, 2, 1, 0, 0, 2]  # replays, in order
    for i in seq:
        gid = wires[i][1]
        if table.needs_register(gid):
            cache.put(compile_graph(wires[i], tbl, backend))
        assert cache.get(gid) is not None  # the mirror registered whatever the peer lacked
    assert cache.evictions > 0


def test_malformed_graphs_are_a_session_error_and_bad_replays_answer_nothing() -> None:
    p = Peer()
    p.send([GRAPH, 7, 1, [], [["exp", [5], 1, None]], [1], []])  # register 5 does not exist yet
    assert p.responses[-1][:2] == [0, m.ERROR] and "register" in p.responses[-1][2]["message"]
    p.send([GRAPH, 8, 0, [], "nope", [], []])
    assert p.responses[-1][:2] == [0, m.ERROR]
    p.send([GRAPH, 9, 1, [], [["exp", [0], 1, None]], [1], []])
    n = len(p.responses)
    p.send([REPLAY, 9, [1, 2], [3], []], [REPLAY, 9, [1], [3], [5, 1.0]])  # wrong arity, bad override
    assert len(p.responses) == n


def test_compiled_kwargs_are_private_and_converted_once() -> None:
    backend = make_backend("cpu")
    kwargs = {"dtype": "float32"}
    g = compile_graph([GRAPH, 1, 1, [], [["astype", [0], 1, kwargs]], [1], []], build_table(backend), backend)
    assert kwargs == {"dtype": "float32"}  # the message is untouched
    assert g.steps[0][3]["dtype"] is backend.dtype("float32")
    p = Peer()
    p.send(p.upload(1, np.arange(3.0)), [GRAPH, 1, 1, [], [["astype", [0], 1, {"dtype": "float32"}]], [1], []])
    for i in range(3):
        p.send([REPLAY, 1, [1], 10 + i, []], [READ, i + 1, 10 + i])
        assert p.value(i + 1) == [0.0, 1.0, 2.0]
    bad = Peer()
    bad.send(bad.upload(1, np.arange(3.0)), [GRAPH, 1, 1, [], [["astype", [0], 1, {"dtype": "float99"}]], [1], []],
             [REPLAY, 1, [1], 10, []], [READ, 1, 10], [OP, "astype", [1], 0, [11], {"dtype": "float99"}],
             [READ, 2, 11])
    assert bad.value(1) == bad.value(2) and bad.value(1)[0] == "error"  # same failure as the op sent alone


@pytest.mark.parametrize("dropped", [set(), {10}, {10, 11, 12, 13}])
def test_canon_ignores_ids_and_scalar_values_but_not_structure(dropped: set[int]) -> None:
    a = canon(group(1, 10, 0.5), dropped)
    b = canon(group(100, 110, 0.7), {d + 100 for d in dropped})
    c = canon(group(1, 10, 1), dropped)  # an int scalar instead of a float: another graph
    assert a is not None and b is not None and c is not None
    assert a.same(b) and not a.same(c) and a.key() == b.key() != c.key()
    assert a.scalars == [0.5, 1.0] and b.scalars == [0.7, 1.0]


def _chain(x: int, first: int, n: int) -> list[list[Any]]:
    """n ops, each on the previous result: every result but the last a temporary of x's size."""
    ops, prev = [], x
    for k in range(n):
        ops.append([OP, "exp" if k % 2 else "negative", [prev], 0, [first + k], None])
        prev = first + k
    return ops


@pytest.mark.parametrize("n, refused", [(50, False), (120, True)])
def test_a_replays_small_temporaries_are_charged_in_slack_sized_lots(n: int, refused: bool) -> None:
    from ember.server.guard.memory import DeviceMemory
    from ember.server.execute.replay import SLACK, SMALL_RESULT
    p = Peer()
    budget = 2 << 20
    p.interp.mem = mem = DeviceMemory(None, "test").session(budget, "s")
    x = np.full(4096, 0.5)  # 32 KiB: below SMALL_RESULT, so its results are charged together
    assert x.nbytes < SMALL_RESULT and n * x.nbytes > SLACK
    p.send(p.upload(1, x))
    ops = _chain(1, 10, n)
    wire, rep = graph_of(ops, dropped={1, *range(10, 10 + n - 1)})
    p.send(wire, rep, [READ, 1, 10 + n - 1])
    got = p.value(1)
    if refused:  # 120 x 32 KiB of temporaries: over the 2 MiB budget, refused like the ops sent alone
        assert got[0] == "error" and "session memory budget" in got[2]
    else:
        want = x.copy()
        for k in range(n):
            want = np.exp(want) if k % 2 else -want
        assert np.allclose(got, want)
    assert mem.peak <= budget  # the overshoot of the uncharged lot never passes the budget's check
    p.send([DROP, [10 + n - 1]])
    assert mem.held() == 0


def test_a_read_followed_by_more_work_is_answered_before_that_work_runs() -> None:
    """[ops, READ, more ops, READ] in one batch (a step split at its loss, client/grouping.py): the first
    READ's answer goes out on its own, before the ops after it have run; the second with the batch's end."""
    peer = Peer()
    seen: list[tuple[list[int], bool]] = []
    respond = peer._respond

    def watch(out: list[list[Any]]) -> None:
        seen.append(([a[0] for a in out], 3 in peer.interp.tensors))
        respond(out)
    peer.interp.respond = watch
    x = np.arange(4, dtype=np.float32)
    peer.send(peer.upload(1, x), [OP, "exp", [1], 0, [2], None], [READ, 7, 2],
              [OP, "multiply", [2, 2.0], 2, [3], None], [READ, 8, 3])
    assert seen == [([7], False), ([8], True)]
    assert np.allclose(peer.value(7), np.exp(x)) and np.allclose(peer.value(8), 2 * np.exp(x))


def test_a_read_runs_inside_a_replay_only_when_the_replay_cannot_change_it() -> None:
    """``read_ahead.take_during``: what may run between two steps of a replay under way (the replay and the rest of
    its batch ``rest``), sans I/O. A read of an untouched value may; a read of what the replay makes, consumes or
    is handed may not; a batch it cannot judge (malformed, an unknown op) never runs ahead, and never raises there
    (the worker reports it in order)."""
    from collections import deque

    from ember.server import read_ahead
    p = Peer()
    x, w = np.arange(4.0), np.ones(4)
    p.send(p.upload(1, x), p.upload(2, w))
    wire, rep = graph_of(group(1, 10, 0.5), dropped={10, 11, 12, 1})  # (consumes x, makes z = 13)
    p.send(wire)
    rest = [rep, [DROP, [5]]]

    left: list[Any] = []

    def during(*batch: list[Any]) -> Any:
        pending = deque([(list(batch), 0.0, 1)])
        got = read_ahead.take_during(pending, rest, p.interp)
        left[:] = list(pending)  # (what stays queued)
        return got

    good = [[OP, "add", [2, 1.0], 2, [30], None], [READ, 7, 30]]
    assert during(*good) == (good, 0.0, 1) and not left  # w: the replay neither reads nor writes it
    assert during([READ, 7, 13]) is None  # z: the replay makes it
    assert during([READ, 7, 1]) is None  # x: the replay consumes it
    assert during([OP, "add", [1, 1.0], 2, [31], None], [READ, 7, 31]) is None  # reads x
    assert during([READ, 7, 2], [DROP, [5]]) == ([[READ, 7, 2]], 0.0, None)  # its drop alone collides: it runs
    assert left == [([[DROP, [5]]], 0.0, 1)]  # without it, and the drop stays queued, with the batch's cost
    for bad in ([READ, 7, [2]], [READ, "x"], [OP, "add", [[2], 1.0], 2, [32], None], [OP, "nope", [2], 0, [33]]):
        assert during(bad) is None
    assert read_ahead.may_read(good) and not read_ahead.may_read([rep]) and not read_ahead.may_read(good * 9)
