"""Hypothesis strategies for the protocol fuzzer: hostile frames of every kind.

Every strategy draws *structured* hostility: each message kind with each field
replaced, now and then, by a hostile value (huge and negative ids, shapes and
totals, wrong types, unknown op names and keyword arguments, bad index keys,
malformed graphs and replays), next to raw random bytes, random MessagePack
values and mutations of frames a real client sent. ``FETCH`` sources are only
ever ``None``, loopback addresses or strings that cannot be an address: the
fuzzer never makes the peer dial anything beyond this host.
"""

from __future__ import annotations

from typing import Any

import hypothesis.strategies as st
import msgpack

from ..protocol import messages as m
from ..protocol import ops

EDGE_INTS = [0, 1, -1, 2, 7, 255, 256, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**62, 2**63 - 1, 2**64 - 1,
             -2**31, -2**63]
DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float32",
          "float64", "complex64", "complex128"]
BAD_DTYPES = ["O", "V8", "S3", ">f8", "<i2", "float16", "float128", "datetime64", "object", "", "f8,i4"]
KWARGS = ["shape", "dtype", "axis", "axes", "keepdims", "key", "n", "s", "norm", "num", "endpoint", "k",
          "fill_value", "correction", "full_matrices", "mode", "side", "indexing", "copy", "out", "where",
          "stable", "descending", "repeats", "offset", "upper", "rtol", "ord", "include_initial", "d", "x"]
NAMES = sorted(ops.ALL - ops.INTERNAL) + sorted(ops.INTERNAL)
SAFE_TEXT = st.text(alphabet="xyz:/!?.- ", max_size=12)  # can never spell an address

ints = st.one_of(st.integers(-3, 40), st.sampled_from(EDGE_INTS), st.integers(-2**63, 2**64 - 1))
leaf = st.one_of(st.none(), st.booleans(), ints, st.floats(allow_nan=True, allow_infinity=True),
                 SAFE_TEXT, st.binary(max_size=40))
anything = st.recursive(leaf, lambda c: st.one_of(st.lists(c, max_size=5),
                                                  st.dictionaries(st.one_of(SAFE_TEXT, ints), c, max_size=4)),
                        max_leaves=10)


def either(valid: Any, odds: float = 0.15) -> Any:
    """Mostly ``valid``, sometimes anything at all."""
    return st.one_of(valid, anything) if odds else valid


class Cases:
    """Strategies for one fuzz target: ``live`` are ids its session holds, ``own`` its own address."""

    def __init__(self, live: list[int], own: str, graph_ids: list[int], real_frames: list[bytes]) -> None:
        self.live = live
        self.own = own
        self.graph_ids = graph_ids
        self.real_frames = real_frames or [msgpack.packb([[m.SYNC, 1]])]
        self.id = st.one_of(st.sampled_from(live), st.integers(100, 140), ints)
        self.out = st.one_of(st.integers(100, 140), st.sampled_from(live), ints)
        self.shape = st.lists(st.one_of(st.integers(0, 9), st.sampled_from([0, 1, 2**20, 2**31, 2**62, 2**63 - 1]),
                                        st.integers(-3, -1)), max_size=6)
        self.dtype = st.one_of(st.sampled_from(DTYPES), st.sampled_from(BAD_DTYPES), anything)
        self.key = st.lists(st.one_of(
            ints, st.builds(lambda a, b, c: [m.KEY_SLICE, a, b, c], st.none() | ints, st.none() | ints, st.none() | ints),
            st.just([m.KEY_NONE]), st.just([m.KEY_ELLIPSIS]), st.builds(lambda i: [m.KEY_ARRAY, i], ints),
            st.lists(anything, max_size=3), anything), max_size=5)
        kwarg_value = st.one_of(anything, self.shape, self.dtype, ints, st.lists(ints, max_size=4), self.key)
        self.kwargs = st.one_of(st.none(), st.dictionaries(st.sampled_from(KWARGS), kwarg_value, max_size=3),
                                st.fixed_dictionaries({"shape": self.shape, "dtype": self.dtype}),
                                st.fixed_dictionaries({"key": self.key}), anything)
        self.name = st.one_of(st.sampled_from(NAMES), st.sampled_from(["__import__", "eval", "os.system", ""]),
                              SAFE_TEXT, anything)
        self.scalar = st.one_of(ints, st.floats(allow_nan=True), st.booleans(), st.none())
        self.source = st.one_of(st.none(), st.sampled_from(["ws://127.0.0.1:1", own, "", "nonsense"]), SAFE_TEXT,
                                ints, st.binary(max_size=8))
        self.secret = st.one_of(st.binary(min_size=32, max_size=32), st.binary(max_size=70), ints, anything)
        self.number = st.one_of(st.floats(min_value=0, max_value=2), st.floats(allow_nan=True), ints, anything)
        self.message = st.one_of([self._kind(k) for k in range(len(m.KIND_NAMES))] + [
            st.lists(anything, max_size=7).map(lambda v: [st_kind_of(v)] + v)])

    # ---- one message of each kind ------------------------------------------------------
    def _kind(self, kind: int) -> Any:
        f = either
        b = {
            m.OP: st.tuples(f(self.name), f(st.lists(st.one_of(self.id, self.scalar), max_size=4)),
                            f(st.integers(0, 15) | ints), f(st.lists(self.out, min_size=1, max_size=3)),
                            self.kwargs),
            m.UPLOAD: st.tuples(f(self.out), f(self.dtype), f(self.shape), f(st.integers(0, 64) | ints),
                                f(st.binary(max_size=64)), f(st.integers(0, 64) | ints)),
            m.DROP: st.tuples(f(st.lists(self.id, max_size=4))),
            m.READ: st.tuples(f(ints), f(self.id)),
            m.SYNC: st.tuples(f(ints)),
            m.CUSTOM: st.tuples(f(self.name | st.just("scale")), f(st.lists(self.id, max_size=3)),
                                f(st.lists(self.out, max_size=3)),
                                f(st.dictionaries(st.sampled_from(["factor", "x", "out"]), self.scalar, max_size=2)),
                                f(st.lists(st.tuples(self.shape, self.dtype).map(list), max_size=3))),
            m.CLOSE: st.tuples(),
            m.PING: st.tuples(f(ints)),
            m.SHAPE: st.tuples(f(ints), f(self.id)),
            m.GRAPH: self._graph(),
            m.REPLAY: st.tuples(f(st.sampled_from(self.graph_ids) | ints), f(st.lists(self.id, max_size=4)),
                                f(st.integers(100, 140) | st.lists(self.out, max_size=3) | ints),
                                f(st.lists(st.one_of(st.integers(0, 3), self.scalar), max_size=4))),
            m.EXPOSE: st.tuples(f(self.id), self.secret, f(st.none() | SAFE_TEXT | st.just("ab" * 32)),
                                f(st.integers(0, 3) | ints), self.number),
            m.FETCH: st.tuples(f(self.out), self.source, self.secret, self.number),
            m.MOVE: st.tuples(f(self.id), self.secret),
            m.ATEN: st.lists(anything, max_size=4).map(tuple),
            m.STATS: st.lists(anything, max_size=2).map(tuple),
        }[kind]
        trim = st.sampled_from([None] * 8 + list(range(8)))  # mostly whole, sometimes cut or padded
        return st.tuples(b, trim, st.lists(anything, max_size=2)).map(
            lambda t: ([kind, *t[0]][:1 + (t[1] if t[1] is not None else 99)] + (t[2] if t[1] == 7 else [])))

    def _graph(self) -> Any:
        op = st.tuples(st.one_of(st.sampled_from(sorted(ops.ELEMENTWISE)[:12] + ["matmul", "sum", "reshape",
                                                                                   "getitem", "astype"]), self.name),
                       st.lists(st.integers(0, 6) | ints, max_size=3), st.integers(1, 2) | ints, self.kwargs).map(list)
        return st.tuples(st.sampled_from(self.graph_ids) | ints, st.integers(0, 3) | ints,
                         st.lists(self.scalar, max_size=3), either(st.lists(op, max_size=6)),
                         either(st.lists(st.integers(0, 9), max_size=3)), either(st.lists(st.integers(0, 3), max_size=2)))

    # ---- frames ------------------------------------------------------------------------------------
    def batch(self) -> Any:
        return st.lists(self.message, min_size=1, max_size=6).map(_pack)

    def frame(self) -> Any:
        """One hostile session frame."""
        return st.one_of(self.batch(), self.batch(), self.batch(), st.binary(max_size=200),
                         anything.map(_pack), self.mutated(), self.respliced())

    def mutated(self) -> Any:
        """A real client frame with bytes flipped, cut or repeated."""
        def mutate(frame: bytes, ops_: list[tuple[int, int, int]]) -> bytes:
            b = bytearray(frame)
            for how, at, val in ops_:
                if not b:
                    break
                at %= len(b)
                if how == 0:
                    b[at] = val & 0xFF
                elif how == 1:
                    del b[at:at + 1 + val % 8]
                elif how == 2:
                    b[at:at] = b[at:at + 1 + val % 16]
                else:
                    b = b[:at]
            return bytes(b)
        return st.builds(mutate, st.sampled_from(self.real_frames),
                         st.lists(st.tuples(st.integers(0, 3), st.integers(0, 1 << 20), st.integers(0, 255)),
                                  min_size=1, max_size=4))

    def respliced(self) -> Any:
        """A real client batch with one value deep inside replaced by a hostile one."""
        def splice(frame: bytes, path: list[int], value: Any) -> bytes:
            try:
                doc = msgpack.unpackb(frame, raw=False, strict_map_key=False)
            except Exception:  # noqa: BLE001
                return frame
            node = doc
            for p in path:
                if isinstance(node, list) and node:
                    i = p % len(node)
                    if isinstance(node[i], list) and node[i]:
                        node = node[i]
                        continue
                    node[i] = value
                    break
            return _pack(doc)
        return st.builds(splice, st.sampled_from(self.real_frames), st.lists(st.integers(0, 50), min_size=1,
                                                                                max_size=4), anything)

    def first_frame(self) -> Any:
        """The first frame of a stream: a (mutated) Hello, a transfer request, or garbage."""
        hello = st.fixed_dictionaries({
            "type": either(st.just("hello")), "protocol": either(st.just(m.PROTOCOL_VERSION)),
            "session_id": either(st.binary(min_size=16, max_size=16)), "device": either(st.integers(0, 2)),
            "credential": either(st.binary(max_size=8)), "client": either(SAFE_TEXT)})
        transfer = st.fixed_dictionaries({"type": st.just("transfer"), "capability": self.secret,
                                          "wait": self.number, "protocol": either(st.just(1))})
        return st.one_of(hello.map(_pack), transfer.map(_pack), st.binary(max_size=100), anything.map(_pack))

    def stream_bytes(self) -> Any:
        """Raw bytes for an iroh stream: a header (valid or not) and frames, length prefixes included."""
        header = st.one_of(st.sampled_from([_pack({"kind": "session", "version": 1}),
                                            _pack({"kind": "transfer", "version": 1})]),
                           st.fixed_dictionaries({"kind": either(st.sampled_from(["session", "transfer"])),
                                                  "version": either(st.just(1))}).map(_pack),
                           st.binary(max_size=40))
        body = st.lists(st.one_of(self.first_frame(), self.frame()), max_size=3)
        prefix = st.one_of(st.just(None), st.integers(0, 2**32 - 1))
        return st.tuples(header, body, prefix).map(lambda t: _framed(t[0], t[1], t[2]))


class Corpus:
    """What hypothesis drew once: messages by kind, hostile values, first frames, iroh streams.

    :class:`Mutator` recombines it into any number of cases at the speed of ``random``
    (drawing every case from hypothesis costs ~10 ms; recombining, microseconds).
    """

    def __init__(self) -> None:
        self.messages: list[list[Any]] = []
        self.values: list[Any] = []
        self.first: list[bytes] = []
        self.streams: list[bytes] = []
        self.frames: list[bytes] = []  # whole hostile frames (random bytes, mutated real frames...)


def draw_corpus(cases: Cases, seed: int, size: int) -> Corpus:
    """About ``size`` items drawn by hypothesis, seeded: half messages, the rest hostile values,
    first frames, iroh streams and whole frames."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    corpus = Corpus()
    per = 10
    groups = [(corpus.messages, cases.message)] * 5 + [
        (corpus.values, anything), (corpus.values, anything), (corpus.first, cases.first_frame()),
        (corpus.streams, cases.stream_bytes()), (corpus.frames, cases.frame())]

    @settings(max_examples=max(len(groups), size // per), database=None, deadline=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @hseed(seed)
    @given(st.data())
    def collect(data: Any) -> None:
        target, strategy = groups[data.draw(st.integers(0, len(groups) - 1))]
        for _ in range(per):
            target.append(data.draw(strategy))

    collect()
    defaults = [(corpus.messages, [m.SYNC, 1]), (corpus.values, 0), (corpus.first, _pack({"type": "hello"})),
                (corpus.streams, _framed(_pack({"kind": "session", "version": 1}), [], None)),
                (corpus.frames, _pack([[m.SYNC, 1]]))]
    for target, default in defaults:
        if not target:
            target.append(default)
    return corpus


class Mutator:
    """Cases from a :class:`Corpus`: batches of drawn messages with fields swapped, cut, padded,
    crossed over between messages, or bytes flipped; seeded (``random.Random``)."""

    def __init__(self, corpus: Corpus, rng: Any, real_frames: list[bytes]) -> None:
        self.c, self.rng, self.real = corpus, rng, real_frames or [_pack([[m.SYNC, 1]])]
        self.by_kind: dict[int, list[list[Any]]] = {}
        for msg in corpus.messages:
            if msg and type(msg[0]) is int:
                self.by_kind.setdefault(msg[0], []).append(msg)

    def message(self) -> list[Any]:
        r = self.rng
        msg = list(r.choice(self.c.messages))
        roll = r.random()
        if roll < 0.25 and len(msg) > 1:    # a field from the hostile pool
            msg[r.randrange(1, len(msg))] = r.choice(self.c.values)
        elif roll < 0.45 and len(msg) > 1:  # a field from another message of the same kind
            other = r.choice(self.by_kind.get(msg[0], [msg]))
            i = r.randrange(1, len(msg))
            if i < len(other):
                msg[i] = other[i]
        elif roll < 0.5:                    # cut or padded
            msg = msg[:r.randrange(1, len(msg) + 1)] if r.random() < 0.5 else msg + [r.choice(self.c.values)]
        return msg

    def session_frame(self) -> bytes:
        r = self.rng
        roll = r.random()
        if roll < 0.8:
            return _pack([self.message() for _ in range(r.randint(1, 6))])
        if roll < 0.9:
            return self.flip(r.choice(self.real + self.c.frames))
        return r.choice(self.c.frames)

    def data_frame(self) -> bytes:
        """A data frame (a small head, then raw bytes): mostly an Upload head with hostile fields."""
        from ..protocol import codec
        r = self.rng
        msgs = self.by_kind.get(m.UPLOAD) or [[m.UPLOAD, 9, "uint8", [8], 0, None, 8]]
        head = list(self.message() if r.random() < 0.2 else r.choice(msgs))
        if len(head) == 7 and r.random() < 0.8:
            head[5] = None  # the payload's slot
        payload = bytes(r.randrange(256) for _ in range(r.choice((0, 1, 8, 64, 1024))))
        frame = codec.data_prefix(head) + payload
        return self.flip(frame) if r.random() < 0.2 else frame

    def first_frame(self) -> bytes:
        return self.flip(self.rng.choice(self.c.first)) if self.rng.random() < 0.3 else self.rng.choice(self.c.first)

    def stream(self) -> bytes:
        return self.flip(self.rng.choice(self.c.streams)) if self.rng.random() < 0.3 else self.rng.choice(self.c.streams)

    def flip(self, frame: bytes) -> bytes:
        r = self.rng
        b = bytearray(frame)
        for _ in range(r.randint(1, 4)):
            if not b:
                break
            at = r.randrange(len(b))
            how = r.randrange(4)
            if how == 0:
                b[at] = r.randrange(256)
            elif how == 1:
                del b[at:at + r.randint(1, 8)]
            elif how == 2:
                b[at:at] = b[at:at + r.randint(1, 16)]
            else:
                del b[at:]
        return bytes(b)


def st_kind_of(v: list[Any]) -> int:
    return len(v) % len(m.KIND_NAMES)


def _pack(v: Any) -> bytes:
    return msgpack.packb(v, use_bin_type=True)


def _framed(header: bytes, frames: list[bytes], bad_prefix: int | None) -> bytes:
    out = bytearray(len(header).to_bytes(4, "big") + header)
    for f in frames:
        out += len(f).to_bytes(4, "big") + f
    if bad_prefix is not None:  # a length prefix promising more than will ever come
        out += bad_prefix.to_bytes(4, "big")
    return bytes(out)


__all__ = ["Cases", "Corpus", "Mutator", "draw_corpus", "anything", "EDGE_INTS"]
