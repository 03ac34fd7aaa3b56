"""Keeping a batch clean: one message that cannot be encoded never poisons the others.

``ClientSession`` encodes a pending batch in one call. When that fails (a value MessagePack
cannot carry reached a message past the argument checks), when the frame would exceed the
peer's frame limit, or while some ids are poisoned on this side, :func:`sift` encodes the
batch message by message instead: a message that fails to encode is dropped and its outputs
poisoned with the reason; a message that consumes a poisoned id is dropped and its outputs
take the same poison (as the peer would do); a read or shape request of a poisoned id is
answered here with the error; a drop of a poisoned id forgets it. What remains goes out, in order, in as many frames as the
frame limit needs.
"""

from __future__ import annotations

from typing import Any

from ..errors import EmberError, LimitExceeded, ProtocolError
from ..protocol import codec
from ..protocol import messages as m

_OP, _CUSTOM, _UPLOAD, _FETCH, _READ, _SHAPE, _DROP = m.OP, m.CUSTOM, m.UPLOAD, m.FETCH, m.READ, m.SHAPE, m.DROP


def inputs(msg: list[Any]) -> list[Any]:
    """The tensor ids a message consumes (those whose poison it would inherit on the peer)."""
    try:
        kind = msg[0]
        if kind == _OP:
            smask = msg[3]
            return [a for i, a in enumerate(msg[2]) if not (smask >> i & 1)] if smask else list(msg[2])
        if kind == _CUSTOM:
            return list(msg[2])
    except (IndexError, TypeError):
        pass
    return []


def outputs(msg: list[Any]) -> list[Any]:
    """The tensor ids a message creates (poisoned when it is dropped)."""
    try:
        kind = msg[0]
        if kind == _OP:
            return list(msg[4])
        if kind == _CUSTOM:
            return list(msg[3])
        if kind in (_UPLOAD, _FETCH):
            return [msg[1]]
    except (IndexError, TypeError):
        pass
    return []


def describe(msg: list[Any]) -> str:
    kind = msg[0] if msg and type(msg[0]) is int and 0 <= msg[0] < len(m.KIND_NAMES) else None
    if kind in (_OP, _CUSTOM) and len(msg) > 1 and type(msg[1]) is str:
        return f"op {msg[1][:80]}"
    return f"a {m.KIND_NAMES[kind]} message" if kind is not None else "a message"


def _hashable_ids(ids: list[Any]) -> list[Any]:
    return [i for i in ids if type(i) is int]


def sift(batch: list[list[Any]], poisoned: dict[int, EmberError], max_frame: int,
         address: str) -> tuple[list[bytes], list[tuple[int, EmberError]], int, int]:
    """Encode ``batch`` message by message: ``(frames, answers, sent, unsendable)``.

    ``poisoned`` (id -> error) is read and extended in place. ``answers`` are ``(req, error)`` for
    the read and shape requests of poisoned ids, answered here; ``sent`` counts the messages kept,
    ``unsendable`` those dropped because they could not be encoded or exceed the frame limit.
    """
    frames: list[bytes] = []
    answers: list[tuple[int, EmberError]] = []
    chunk: list[bytes] = []
    size = 0
    sent = unsendable = 0
    budget = max_frame - 64  # the array header of the frame
    for msg in batch:
        if poisoned:
            kind = msg[0] if msg else None
            if kind in (_READ, _SHAPE) and len(msg) == 3 and type(msg[2]) is int and msg[2] in poisoned:
                if type(msg[1]) is int:  # a fresh error each time: a raised one holds the reader's frames
                    e = poisoned[msg[2]]
                    answers.append((msg[1], type(e)(e.message, hint=e.hint)))
                continue
            if kind == _DROP and len(msg) == 2 and type(msg[1]) is list:  # released: the poison is not needed
                for i in _hashable_ids(msg[1]):
                    poisoned.pop(i, None)
            upstream = next((poisoned[i] for i in _hashable_ids(inputs(msg)) if i in poisoned), None)
            if upstream is not None:
                for o in _hashable_ids(outputs(msg)):
                    poisoned[o] = upstream
                continue
        try:
            enc = codec.packb(msg)
        except Exception as e:  # whatever the value, it cannot travel: this message only is dropped
            err: EmberError = ProtocolError(
                f"{describe(msg)} was not sent to {address}: one of its arguments cannot be encoded "
                f"({type(e).__name__}: {e})",
                hint="only None, bools, ints of at most 64 bits, floats, strings, bytes and lists of them "
                     "travel; the code that built this message let another value through")
            for o in _hashable_ids(outputs(msg)):
                poisoned[o] = err
            unsendable += 1
            continue
        if len(enc) > budget:
            err = LimitExceeded(f"{describe(msg)} was not sent to {address}: it encodes to {len(enc)} bytes, "
                                f"more than the peer's frame limit of {max_frame} bytes",
                                hint="pass large data as an array (uploads are sent in chunks)")
            for o in _hashable_ids(outputs(msg)):
                poisoned[o] = err
            unsendable += 1
            continue
        if size + len(enc) > budget and chunk:
            frames.append(codec.batch_frame(chunk))
            chunk, size = [], 0
        chunk.append(enc)
        size += len(enc)
        sent += 1
    if chunk:
        frames.append(codec.batch_frame(chunk))
    return frames, answers, sent, unsendable
