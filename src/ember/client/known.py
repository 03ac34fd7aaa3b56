"""Ids whose value a frontend knows without asking the peer, and when the session forgets them.

``ClientSession.known`` maps a storage id to its exact bytes as the frontend holds them (``ember.torch``'s
``_known``: small integer tensors made from constants or uploads). The session forgets an id whenever a
message it sends may write that id, so that a read of a known id is always the peer's value: an op's
arguments unless the frontend says the op writes none (``op_writes``) or which it writes
(``op_written``), every id of any other message but a
request that only reads, a captured graph's inputs and outputs (``replay_graph``), and a released id.
"""

from __future__ import annotations

from typing import Any

from ..protocol import messages as m

#: Requests that write nothing.
READS_ONLY = frozenset({m.READ, m.SYNC, m.SHAPE, m.PING, m.STATS})


def written_args(name: str, args: list[Any], smask: int, op_writes: Any, op_written: Any) -> list[Any]:
    """The id arguments (those ``smask`` does not mark as scalars) an ``OP`` of ``name`` may write: none when the
    frontend says it writes none (``op_writes``), those it names when it says which (``op_written``: how many ids
    its call names and the positions of the written ones, used only when the count agrees: no operand left out or
    added), else all."""
    if op_writes is not None and op_writes(name) is False:
        return []
    ids = [a for j, a in enumerate(args) if not smask >> j & 1]
    exact = op_written(name) if op_written is not None else None
    if exact is not None and exact[0] == len(ids):
        return [ids[k] for k in exact[1]]
    return ids


class Knowing:
    """Forgetting known ids (a mixin of ClientSession, which holds ``known`` and ``op_writes``)."""

    known: dict[int, Any]
    op_writes: Any
    #: the frontend's ``name -> (how many ids its call names, which of them it writes)`` where its schema says
    #: exactly (``aten.copy_``: 2, (0,): the source stays known); None: every argument may be written
    op_written: Any = None
    #: op names the frontend said write none of their arguments (``record``'s quick test while ids are known)
    pure: set[str]

    def _unknow(self, msg: list[Any]) -> None:
        """Forget the known value (``known``) of every id ``msg`` may write: an op's arguments unless the
        frontend says it writes none (``op_writes``), every id any other message names except a request's
        that only reads."""
        known = self.known
        kind = msg[0]
        if kind == m.OP:
            w = self.op_writes
            if w is not None and w(msg[1]) is False:
                self.pure.add(msg[1])
                return
            for a in written_args(msg[1], msg[2], msg[3], None, self.op_written):
                if type(a) is int:
                    known.pop(a, None)
            return
        if kind in READS_ONLY:
            return
        if kind == m.UPLOAD:  # (a new id; its other fields are a shape, an offset, a size: not ids)
            known.pop(msg[1], None)
            return
        for f in msg[1:]:
            if type(f) is int:
                known.pop(f, None)
            elif type(f) is list:
                for x in f:
                    if type(x) is int:
                        known.pop(x, None)
