"""What the client needs to know of one ATen overload, read once from its schema."""

from __future__ import annotations

from typing import Any

import torch

from ..protocol import aten as A
from . import _known

_VALUE_SHAPED = frozenset({"arange", "range", "linspace", "logspace"})
"""Ops whose output shape depends on the *values* of their scalar arguments."""

_EMPTY = frozenset({"empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like", "empty_permuted"})
"""Ops that only allocate: their storage stays pending until first use."""


#: wire name -> whether the overload writes any of its arguments, for every overload the client has met
#: (``ClientSession.op_writes``: which ops a value read from a held op group may go past)
WRITES: dict[str, bool] = {}
#: wire name -> (its tensor arguments, the positions among them it writes), for an overload whose every tensor
#: argument is one operand (no lists): ``ClientSession.op_written`` (a copy's source stays known)
WRITTEN: dict[str, tuple[int, tuple[int, ...]]] = {}


class OpInfo:
    """One overload: its wire name, argument categories and the flags the dispatch path needs."""

    __slots__ = ("op", "name", "base", "args", "n_pos", "writes", "inplace_view", "seeded", "by_value",
                 "alloc", "returns", "list_return", "refused", "pos_cats", "exact", "foreign")

    def __init__(self, op: Any) -> None:
        self.op = op
        schema = op._schema
        ns, base = schema.name.split("::", 1)
        self.base = base
        self.name = f"{ns}.{base}.{schema.overload_name or 'default'}"
        #: an op outside ATen (a C++ extension's, torchvision's, a torch.library custom op): never sent to a peer
        self.foreign = ns != "aten"
        self.args = [(a.name, A.category(str(a.real_type)), a.kwarg_only,
                      _default(a) if a.has_default_value() else _REQUIRED) for a in schema.arguments]
        self.n_pos = sum(1 for a in schema.arguments if not a.kwarg_only)
        self.pos_cats = tuple(c for _n, c, kwonly, _d in self.args if not kwonly)  # (the fast path's walk)
        self.writes = tuple(bool(a.alias_info is not None and a.alias_info.is_write) for a in schema.arguments)
        cats = [c for _n, c, _k, _d in self.args]
        unmarked = A.UNMARKED_WRITES.get(self.name, ())
        WRITES[self.name] = any(self.writes) or bool(unmarked)
        if A.TENSOR_LIST not in cats:
            tensors = [w or n in unmarked for (n, c, _k, _d), w in zip(self.args, self.writes) if c == A.TENSOR]
            WRITTEN[self.name] = (len(tensors), tuple(k for k, w in enumerate(tensors) if w))
        self.inplace_view = torch.Tag.inplace_view in op.tags and base not in ("resize_", "resize_as_")
        self.seeded = torch.Tag.nondeterministic_seeded in op.tags
        self.by_value = base in _VALUE_SHAPED or not any(c in (A.TENSOR, A.TENSOR_LIST) for _, c, _, _ in self.args)
        self.alloc = base in _EMPTY
        self.returns = [str(r.real_type) for r in schema.returns]
        self.list_return = self.returns == ["List[Tensor]"]
        self.refused = A.refusal(self.name, [(a.name, str(a.real_type)) for a in schema.arguments],
                                 self.returns)
        #: an integer result of a call may be known (computed here too, exactly: _known.py)
        self.exact = self.refused is None and self.returns == ["Tensor"] and \
            _known.exact(op, base, self.seeded, any(self.writes))


# c10's enums, which a schema's defaults carry as ints (``ScalarType? dtype=4`` is int64)
_SCALAR_TYPES = {0: torch.uint8, 1: torch.int8, 2: torch.int16, 3: torch.int32, 4: torch.int64, 5: torch.float16,
                 6: torch.float32, 7: torch.float64, 8: torch.complex32, 9: torch.complex64, 10: torch.complex128,
                 11: torch.bool, 15: torch.bfloat16}
_MEMORY_FORMATS = {0: torch.contiguous_format, 1: torch.preserve_format, 2: torch.channels_last,
                   3: torch.channels_last_3d}


def _default(a: Any) -> Any:
    v, cat = a.default_value, A.category(str(a.real_type))
    if type(v) is int:
        if cat == A.DTYPE:
            return _SCALAR_TYPES[v]
        if cat == A.MEMORY_FORMAT:
            return _MEMORY_FORMATS[v]
        if cat == A.LAYOUT:
            return torch.strided
    return v


class _Required:
    def __repr__(self) -> str:
        return "<required>"


_REQUIRED = _Required()
_infos: dict[int, OpInfo] = {}


def info(op: Any) -> OpInfo:
    """The overload's OpInfo (keyed by identity: overloads are immortal, and their hash is Python code)."""
    i = _infos.get(id(op))
    if i is None:
        i = _infos[id(op)] = OpInfo(op)
    return i


def bound(i: OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """Every schema argument's value, in schema order (defaults filled in)."""
    out: list[Any] = []
    n = len(args)
    for k, (name, _cat, kwonly, default) in enumerate(i.args):
        if not kwonly and k < n:
            v = args[k]
        elif name in kwargs:
            v = kwargs[name]
        elif default is _REQUIRED:
            raise TypeError(f"{i.name}: missing argument {name!r}")
        else:
            v = default
        out.append(v)
    return out


def call(i: OpInfo, values: list[Any]) -> Any:
    """Call the overload with schema-ordered ``values`` (positional, then keyword-only)."""
    pos = values[:i.n_pos]
    kw = {name: v for (name, _c, kwonly, _d), v in zip(i.args, values) if kwonly}
    return i.op(*pos, **kw)


__all__ = ["OpInfo", "info", "bound", "call"]
