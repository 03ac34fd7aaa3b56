"""Values the client knows exactly, so that reading them asks the peer nothing.

Real training code reads small integer tensors that it made from constants or from its own CPU data:
Hugging Face's masks check ``position_ids`` (an ``arange``) for packed sequences and an uploaded
``attention_mask`` for padding before every forward; a loop checks ``(labels == -100).all()``. Each such
read used to be a round trip that waited for everything sent before it (the previous step's optimizer
step), and a boundary that cut the step's op group in two.

A storage is *known* when the client holds its exact bytes (``ClientSession.known``: id -> those bytes, as
``bytes`` or, once used, a CPU ``uint8`` tensor): a small upload of integer or boolean data (of float data too,
for comparisons only: :data:`FLOAT_EXACT_OPS`), or the dense
result of a call of an *exact* overload (``OpInfo.exact``: pointwise, or a creation, a reduction or a data
movement whose integer result does not depend on the device, and that writes and draws nothing) with an
integer or boolean result whose every tensor operand is known and integer or boolean. That call also runs
on CPU torch here, at record time, on views of the known bytes; the op still goes to the peer as always.
``.item()`` / ``bool()`` / ``.cpu()`` of a known storage read those bytes: no round trip, no boundary.

Knowledge never outlives the bytes it mirrors: the session forgets an id whenever a message might write it
(an op that may write its arguments, a replay, a transfer: ``client/known.py``) or it is released.
Integer arithmetic is exact on every device, so the bytes are the peer's. One difference remains: an op the
peer refuses (over its memory budget, say) poisons the id there, and a read of the known value still returns
it here; the error comes with the next read of what depends on it.
"""

from __future__ import annotations

from typing import Any

import torch

from ..protocol import aten as A
from ._storage import StorageRef

#: dtypes whose arithmetic is exact on every device (the only ones known)
EXACT = frozenset({torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64})
#: Float dtypes, known when uploaded small, for :data:`FLOAT_EXACT_OPS` only (float arithmetic may round otherwise
#: from device to device; an IEEE comparison never does)
FLOATS = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
#: Overloads (by base name) whose boolean result from float operands is the same on every device: an uploaded float
#: tensor is known for them (torchdiffeq compares its solver's constant coefficients, ``alpha == 1.``, every stage).
FLOAT_EXACT_OPS = frozenset({"eq", "ne", "lt", "le", "gt", "ge", "isnan", "isinf", "isfinite", "isposinf",
                             "isneginf", "signbit", "logical_not", "logical_and", "logical_or", "logical_xor",
                             "all", "any"})
#: Overloads (by base name) whose float results are exact on every device: a fill. Their results are known (a
#: BART-family decoder's ``torch.ones`` mask, checked through ``.bool()`` before every forward).
FLOAT_FACTORIES = frozenset({"ones", "zeros", "full", "scalar_tensor", "ones_like", "zeros_like", "full_like",
                             "new_ones", "new_zeros", "new_full"})
#: A known storage is at most this many bytes, and a session knows at most MAX_ENTRIES of them.
KNOWN_MAX = 1 << 14
MAX_ENTRIES = 1024
#: Overloads (by base name) besides pointwise ones whose integer results are the same on every device.
EXACT_OPS = frozenset({
    "arange", "zeros", "ones", "full", "scalar_tensor", "zeros_like", "ones_like", "full_like", "eye", "tril", "triu",
    "cumsum", "cumprod", "sum", "prod", "all", "any", "amax", "amin", "max", "min", "count_nonzero",
    "cat", "stack", "clone", "_to_copy", "contiguous", "repeat", "flip", "roll", "index_select", "gather", "index",
    "constant_pad_nd", "masked_fill", "where", "lift_fresh", "alias_copy",
    "new_ones", "new_zeros", "new_full",
})
#: Of those, the ones that take only their operands' layouts and dtypes, not their values: an unknown operand
#: stands in, uninitialised (a padding-mask check's ``mask.new_ones(())``).
LAYOUT_ONLY_OPS = frozenset({"zeros_like", "ones_like", "full_like", "new_ones", "new_zeros", "new_full"})
_CPU = torch.device("cpu")


class _Unknown(Exception):
    """An operand whose bytes the client does not hold."""


#: Pointwise overloads left out: a shift by the type's width or more is the C++ compiler's to define.
_NOT_EXACT = frozenset({"bitwise_left_shift", "bitwise_right_shift", "__lshift__", "__rshift__"})


def exact(op: Any, base: str, seeded: bool, writes: bool) -> bool:
    """May a call of ``op`` make a known result? (``OpInfo.exact``)"""
    if seeded or writes or base in _NOT_EXACT:
        return False
    return torch.Tag.pointwise in op.tags or base in EXACT_OPS


def follow(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], res: torch.Tensor) -> None:
    """``res`` (an integer or boolean result of an exact call, just recorded) is known when every tensor
    operand of the call is: the call is run on CPU torch over the operands' known bytes."""
    r = getattr(res.untyped_storage(), "_ember", None)
    if r is None or r.pending is not None:
        return
    s = r.session
    known = getattr(s, "known", None)  # (a mesh's sessions know nothing)
    if known is None or r.sid in known or len(known) >= MAX_ENTRIES:
        return
    if res.untyped_storage().nbytes() > KNOWN_MAX:
        return
    base = getattr(op, "_opname", None)
    if res.dtype not in EXACT and base not in FLOAT_FACTORIES:
        return
    # (a float compared, or cast to bool -- x != 0 -- is the same on every device)
    kinds = EXACT | FLOATS if base in FLOAT_EXACT_OPS or base == "_to_copy" and res.dtype is torch.bool else EXACT
    layout_only = base in LAYOUT_ONLY_OPS
    try:
        ca = [_on_cpu(a, known, s, kinds, layout_only) for a in args]
        ck = {k: _on_cpu(v, known, s, kinds, layout_only) for k, v in kwargs.items()} if kwargs else {}
    except _Unknown:
        return
    try:
        with torch.no_grad():
            c = op(*ca, **ck)
    except Exception:  # noqa: BLE001 - what the CPU refuses, the peer judges (and the read asks it)
        return
    remember(res, c)


def _covers(t: torch.Tensor, nbytes: int) -> bool:
    """Does ``t`` (at offset 0) cover each of its storage's ``nbytes`` exactly once (contiguous in some order of its
    dims: ``nonzero``'s column-major result too)?"""
    return t.numel() * t.element_size() == nbytes and A.dense(t.shape, t.stride())


def remember(res: torch.Tensor, c: Any) -> None:
    """``res`` (a fresh ember result) holds ``c``'s values (a CPU tensor computed here): keep them when small."""
    r = getattr(res.untyped_storage(), "_ember", None)
    known = getattr(r.session, "known", None) if r is not None else None
    nb = res.untyped_storage().nbytes()
    if known is None or r.pending is not None or len(known) >= MAX_ENTRIES or res.dtype not in EXACT | FLOATS \
            or nb > KNOWN_MAX or res.storage_offset() or not _covers(res, nb) or type(c) is not torch.Tensor \
            or c.dtype is not res.dtype or c.shape != res.shape:
        return  # (the peer's bytes outside the result's layout are not the client's to know)
    buf = torch.empty(nb, dtype=torch.uint8, device="cpu")
    torch.empty(0, dtype=res.dtype, device="cpu").set_(buf.untyped_storage(), 0, res.shape, res.stride()).copy_(c)
    known[r.sid] = buf


#: Data-dependent overloads (by base name) whose output layout depends on the values of their integer or boolean
#: operands only (a boolean mask's index of a float tensor): those known, the layout is computed here.
SHAPED_BY_INDICES = frozenset({"index", "masked_select"})
#: Largest storage of an unknown operand stood in for (uninitialised) by such a call's computation here.
STAND_IN_MAX = 1 << 26


def deciding_bytes(base: str, operands: list[torch.Tensor], session: Any) -> tuple[dict[int, Any], bool] | None:
    """For a data-dependent call (``nonzero``, ``unique``, a boolean mask's index...) that writes and draws nothing:
    ``id(storage)`` -> CPU bytes for every operand, when the values that decide its outputs' layout are known
    (every integer or boolean operand; a float one only stands in, uninitialised, in :data:`SHAPED_BY_INDICES`),
    and whether every operand is known (then the results' values are too); else None."""
    known = getattr(session, "known", None)
    if not known:
        return None
    bufs: dict[int, Any] = {}
    every = True
    for t in operands:
        st = t.untyped_storage()
        r = getattr(st, "_ember", None)
        k = _bytes(known, r.sid) if r is not None and r.session is session else None
        if k is not None and t.dtype in EXACT:
            bufs[id(st)] = k
        elif t.dtype in EXACT or base not in SHAPED_BY_INDICES or st.nbytes() > STAND_IN_MAX:
            return None
        else:
            bufs.setdefault(id(st), torch.empty(st.nbytes(), dtype=torch.uint8, device="cpu"))
            every = False
    return (bufs, every) if bufs else None


def _on_cpu(a: Any, known: dict[int, Any], s: Any, kinds: frozenset[torch.dtype] = EXACT,
            layout_only: bool = False) -> Any:
    if isinstance(a, torch.Tensor):
        if a.device.type != "ember":
            return a  # (a 0-d CPU tensor mixed in, as ember's dispatch allows)
        r = getattr(a.untyped_storage(), "_ember", None)
        k = _bytes(known, r.sid) if r is not None and r.session is s and a.dtype in kinds else None
        if k is None:
            if layout_only and a.numel() * a.element_size() <= KNOWN_MAX:
                return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="cpu")
            raise _Unknown
        return _view(k, a)
    if isinstance(a, (list, tuple)):
        return type(a)(_on_cpu(x, known, s, kinds, layout_only) for x in a)
    if isinstance(a, torch.device) and a.type == "ember":
        return _CPU
    return a


def uploaded(r: StorageRef, data: Any) -> None:
    """A small upload (integer, boolean, or float for :data:`FLOAT_EXACT_OPS`) is known: ``data``, its bytes as
    sent (a NumPy ``uint8`` view), kept as ``bytes`` until a read or an op needs them as a tensor (:func:`_bytes`)."""
    known = getattr(r.session, "known", None)
    if known is not None and data.nbytes <= KNOWN_MAX and len(known) < MAX_ENTRIES:
        known[r.sid] = data.tobytes()


def _bytes(known: dict[int, Any], sid: int) -> Any:
    """The known bytes of ``sid`` as a CPU ``uint8`` tensor (made once from an upload's ``bytes``), or None."""
    k = known.get(sid)
    if type(k) is bytes:
        k = known[sid] = torch.frombuffer(bytearray(k), dtype=torch.uint8) if k else \
            torch.empty(0, dtype=torch.uint8, device="cpu")
    return k


def _view(k: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``t``'s layout (dtype, size, stride, offset) over the known bytes ``k``, a CPU tensor."""
    return torch.empty(0, dtype=t.dtype, device="cpu").set_(k.untyped_storage(), t.storage_offset(), t.shape,
                                                            t.stride())


def value(t: torch.Tensor, r: StorageRef) -> torch.Tensor | None:
    """``t``'s value as a CPU tensor when its storage is known (a view of the known bytes), else None."""
    known = getattr(r.session, "known", None)
    k = _bytes(known, r.sid) if known else None
    if k is None or r.session.lost is not None:
        return None
    try:
        v = _view(k, t)
    except RuntimeError:  # (a layout past the known bytes: the peer says what is wrong)
        return None
    r.session.stats["known_reads"] += 1
    return v


__all__ = ["EXACT", "FLOATS", "KNOWN_MAX", "follow", "uploaded", "value", "exact", "remember", "deciding_bytes"]
