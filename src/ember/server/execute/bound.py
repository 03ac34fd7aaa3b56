"""Pre-bound ATen steps: a registered graph's ATen call lowered once, replayed without re-checking its template.

:func:`lower` turns one graph step's ``AtenKernel`` and its private keyword arguments (the template
``a``, the operand layouts ``l``, the output specs ``o``) into a :class:`BoundAten`. What depends only on
the template is checked once, at registration: the binding against the schema, every layout's byte
extent, every output spec. A replay then does only what depends on the values bound: each storage is
checked (a uint8 storage whose bytes reach the layout's extent), its typed view made, the kernel run,
each result checked against its spec and stored. Anything unusual (a storage too small or not a
storage, another scalar count, a result that needs copying) runs the generic kernel, which raises the
same error or does the same work as the op sent alone. Views are never cached across replays: a view
would keep a storage the client freed alive past its charge.
"""

from __future__ import annotations

import sys
from typing import Any

_NONE = object()


def lower(fn: Any, kw: Any) -> BoundAten | None:
    """The bound step of an ATen call, or None: not an ATen kernel, data-dependent, resizing, or a
    template the generic kernel must refuse (it then runs, and fails, as sent alone)."""
    aten = sys.modules.get("ember.server.execute.aten")  # no ATen kernel exists unless it was imported
    if aten is None or type(fn) is not aten.AtenKernel or fn.resize or not isinstance(kw, dict) \
            or set(kw) != {"a", "l", "o"} or not isinstance(kw["o"], list):
        return None
    try:
        return BoundAten(fn, kw["a"], kw["l"], kw["o"], aten)
    except Exception:  # noqa: BLE001 - the generic kernel says what is wrong, at replay
        return None


class BoundAten:
    """One ATen call of a graph, its template bound once; called as the kernel is (``scalars, *storages``)."""

    __slots__ = ("kernel", "kw", "n_bufs", "n_scal", "need", "views", "plan", "kwplan", "written_pos", "outs",
                 "wlay", "torch", "scalar", "as_storage")

    def __init__(self, k: Any, a: Any, l: Any, o: Any, aten: Any) -> None:  # noqa: E741
        import torch
        if not isinstance(l, list) or not isinstance(a, list) or len(a) != len(k.args):
            raise ValueError("template does not match its schema")
        self.kernel, self.kw, self.torch = k, {"a": a, "l": l, "o": o}, torch
        self.scalar, self.as_storage = aten._scalar, aten.as_storage
        self.n_bufs = len(l)
        self.need = [aten.A.layout_extent(lay, aten.ITEMSIZE) for lay in l]
        self.views = [(aten.DTYPES[lay[3]], lay[2], tuple(lay[0]), tuple(lay[1])) for lay in l]
        # bind once with markers: each tensor slot is a distinct empty tensor, each scalar a distinct float
        marks = [torch.empty(0) for _ in l]
        n_scal = _scalar_count(k, a, aten.A)
        smarks = [float(i) + 0.5 for i in range(n_scal)]
        args, kwargs, before = k._bind(a, marks, smarks)
        tid = {id(t): i for i, t in enumerate(marks)}
        sid = {id(s): i for i, s in enumerate(smarks)}
        self.n_scal = n_scal
        self.plan = [_slot(v, tid, sid) for v in args]
        self.kwplan = {n: _slot(v, tid, sid) for n, v in kwargs.items()}
        self.written_pos = [tid[id(t)] for t, _ in before]
        self.wlay = [l[i] for i in self.written_pos]
        self.outs = []
        for spec in o:
            if not isinstance(spec, list) or len(spec) != 6 or type(spec[0]) is not int or spec[0] < 0:
                raise ValueError("malformed output spec")
            _, size, stride, offset, dtype, nbytes = spec
            need = aten.A.layout_extent([size, stride, offset, dtype], aten.ITEMSIZE)
            if type(nbytes) is not int or not need <= nbytes <= aten.A.INT64[1]:
                raise ValueError("output spec cannot hold its layout")
            self.outs.append((spec[0], torch.Size(size), tuple(stride), offset, aten.DTYPES[dtype], nbytes, spec))

    @property
    def name(self) -> str:
        return self.kernel.name

    def written(self, kwargs: Any) -> list[int]:
        """Positions of the operands this call writes (as :meth:`AtenKernel.written`)."""
        return self.kernel.written(self.kw)

    def __call__(self, scalars: Any, *bufs: Any, **_kw: Any) -> Any:
        torch, k = self.torch, self.kernel
        if type(scalars) is not list or len(scalars) != self.n_scal or len(bufs) != self.n_bufs:
            return k(scalars, *bufs, **self.kw)
        tensors = []
        u8 = torch.uint8
        dev = k.device
        for b, need, (dt, off, size, stride) in zip(bufs, self.need, self.views):
            if not isinstance(b, torch.Tensor) or b.dtype is not u8 or b.dim() != 1 or b.storage_offset() != 0:
                return k(scalars, *bufs, **self.kw)  # not a storage: the kernel says so
            st = b.untyped_storage()
            if st.nbytes() < need:
                return k(scalars, *bufs, **self.kw)  # a storage too small for the layout: refused there
            tensors.append(torch.empty((0,), dtype=dt, device=dev).set_(st, off, size, stride))
        try:
            vals = [self.scalar(s) for s in scalars]
        except ValueError:
            return k(scalars, *bufs, **self.kw)
        args = [_fill(p, tensors, vals) for p in self.plan]
        kwargs = {n: _fill(p, tensors, vals) for n, p in self.kwplan.items()}
        before = [(tensors[i], tensors[i].untyped_storage().nbytes()) for i in self.written_pos]
        res = k.run(args, kwargs)
        if before:
            for (t, nbytes), i, lay in zip(before, self.written_pos, self.wlay):
                k._keep_layout(t, bufs[i], lay)
                k._zero_growth(t, nbytes)
            k.respan(bufs)
        flat = list(res) if isinstance(res, (tuple, list)) else [res]
        stored = []
        for idx, size, stride, offset, dtype, nbytes, spec in self.outs:
            if idx >= len(flat):
                return k._results(res, self.kw["o"], tensors)  # raises why
            r = flat[idx]
            if isinstance(r, torch.Tensor) and r.dtype is dtype and r.shape == size and r.stride() == stride \
                    and r.storage_offset() == offset:
                st = r.untyped_storage()
                if st.nbytes() >= nbytes and not any(t.untyped_storage().data_ptr() == st.data_ptr()
                                                     for t in tensors):
                    stored.append(self.as_storage(r))
                    continue
            stored.append(k._store(r, spec, tensors))  # copies, zero-fills, or says what is wrong
        return stored[0] if len(stored) == 1 else tuple(stored)


def _scalar_count(k: Any, a: list[Any], A: Any) -> int:
    """How many scalars the template ``a`` takes (the generic bind checks the count matches)."""
    n = 0
    for (_, cat, _, _), e in zip(k.args, a):
        if cat == A.TENSOR_LIST and type(e) is list:
            n += sum(1 for x in e if x == 1 and type(x) is int)
        elif cat in (A.TENSOR, A.SCALAR) and e == 1 and type(e) is int:
            n += 1
        elif cat == A.SCALAR_LIST and type(e) is int and e >= 0:
            n += e
    return n


def _slot(v: Any, tid: dict[int, int], sid: dict[int, int]) -> Any:
    """What a bound argument becomes: ('t', i) a tensor operand, ('s', i) a scalar, ('l', [...]) a list
    holding either, ('c', v) a constant of the template."""
    if id(v) in tid and not isinstance(v, (int, float, bool)):
        return ("t", tid[id(v)])
    if type(v) is float and id(v) in sid:
        return ("s", sid[id(v)])
    if type(v) is list and any(id(x) in tid or (type(x) is float and id(x) in sid) for x in v):
        return ("l", [_slot(x, tid, sid) for x in v])
    return ("c", v)


def _fill(p: tuple[str, Any], tensors: list[Any], vals: list[Any]) -> Any:
    kind, x = p
    if kind == "c":
        return x
    if kind == "t":
        return tensors[x]
    if kind == "s":
        return vals[x]
    return [_fill(q, tensors, vals) for q in x]


__all__ = ["lower", "BoundAten"]
