"""ATen ops on torch devices: the vetted whitelist and one kernel per overload.

The PyTorch frontend sends ATen calls as ``OP`` messages (the wire format is in
:mod:`ember.protocol.aten`). On the peer a session's *storages* are flat ``uint8``
torch tensors in the interpreter's ordinary id -> value store; a kernel rebuilds each
operand as a typed view ``(storage, size, stride, offset, dtype)`` after checking
that the layout stays inside its storage, runs the overload, and stores each fresh
result in the layout the client inferred (adopting the result's memory when its
layout already matches, copying otherwise). Written operands are updated in place.

Only *vetted* overloads run (:func:`refusal`): every argument must be of a kind
in :data:`ember.protocol.aten.CATEGORY` (tensors, scalars, ints, bools, dtypes...),
so nothing taking a storage, a stream or a file can be named, and a deny list
removes what reads files, maps or leaves memory uninitialised, skips bounds checks,
or is about pinned memory, sparse, quantized or nested tensors. Random ops draw from
the session's own generator (``torch.seed`` reseeds it; :mod:`.session_random`), never from
another session's stream nor the process-wide one.
"""

from __future__ import annotations

import math
import threading
from typing import Any, Callable

import torch

from ...protocol import aten as A
from . import declared, device_gaps, internal_calls, positions, rnn_cells, rnn_layer, rnn_recompute, sparse_mm
from .backends import UnknownOp
from .eager import GENERIC, plan_for
from .session_random import SessionRandom
from .tight import adoptable, tight

DTYPES: dict[str, torch.dtype] = {n: getattr(torch, n) for n in A.DTYPES if isinstance(getattr(torch, n, None),
                                                                                      torch.dtype)}
ITEMSIZE = {n: d.itemsize for n, d in DTYPES.items()}
MEMORY_FORMATS = {n: getattr(torch, n) for n in A.MEMORY_FORMATS}


_RESIZE = frozenset({"resize_", "resize_as_"})
rnn_cells.install("CPU")  # nn.LSTM / nn.GRU on an ember tensor take torch's fused cells: CUDA-only kernels


#: The intra-op thread count this process's peer kernels run with, or None (each thread's own). An embedded
#: peer follows its user: the main thread's count when ``ember.torch`` was imported, or of the thread that
#: made the default device (and the main thread's later ``torch.set_num_threads``), never one another thread
#: set process-wide (a pin-memory ``DataLoader`` thread sets 1), so its reductions and GEMMs split work as the
#: user's CPU ops do and stay bit-equal to them.
THREADS: list[int | None] = [None]
_tls = threading.local()


def _follow_threads() -> None:
    n = THREADS[0]
    if n is not None and getattr(_tls, "threads", None) != n:
        torch.set_num_threads(n)
        _tls.threads = n


def refusal(name: str) -> str | None:
    """Why ``name`` may not run on a peer, or None for a vetted overload."""
    parts = name.split(".")
    if len(parts) != 3 or parts[0] != "aten" or not parts[1] or not parts[2]:
        return f"{name[:80]!r} is not an ATen overload name (aten.<op>.<overload>)"
    op = _overload(parts[1], parts[2])
    if op is None:
        return f"there is no ATen overload {name[:80]!r} in torch {torch.__version__}"
    if _implicit_only(op) and parts[1] not in _IMPLICIT_SENT:
        return (f"ATen op {name} is a composite (CompositeImplicitAutograd): a client sends the ops it decomposes "
                f"into, each checked on the peer")
    return A.refusal(name, [(a.name, str(a.real_type)) for a in op._schema.arguments],
                     [str(r.real_type) for r in op._schema.returns])


_IMPLICIT_SENT = frozenset({"conj_physical", "_scaled_dot_product_attention_math"})
"""Composites the client itself sends (``_conj`` made physical; SDPA's math path): their parts need no check."""


def _implicit_only(op: Any) -> bool:
    """Whether ``op`` has only a CompositeImplicitAutograd kernel: torch decomposes it before any backend, so
    a client never sends it, and on a peer its parts would run without the checks of :mod:`.positions`."""
    has, q = torch._C._dispatch_has_kernel_for_dispatch_key, op._schema.name + (
        f".{op._schema.overload_name}" if op._schema.overload_name else "")
    return has(q, "CompositeImplicitAutograd") and not has(q, "CPU") and not has(q, "CompositeExplicitAutograd")


def _overload(op: str, overload: str) -> Any:
    try:
        r = getattr(getattr(torch.ops.aten, op), overload)
    except (AttributeError, RuntimeError):
        return None
    return r if isinstance(r, torch._ops.OpOverload) else None  # (aten.__class__.__init__ is a Python attribute)


def _literal_ok(t: str, v: Any) -> bool:
    if v is None:
        return t.startswith("Optional")
    if t.endswith("bool]") or t == "bool":
        return type(v) is bool or (type(v) is list and len(v) <= A.MAX_LIST and all(type(b) is bool for b in v))
    if type(v) is int:  # an int also fills an int[1]
        return A.INT64[0] <= v <= A.INT64[1]
    return type(v) is list and "List" in t and len(v) <= A.MAX_LIST and all(
        type(i) is int and A.INT64[0] <= i <= A.INT64[1] for i in v)


def _scalar(v: Any) -> Any:
    t = type(v)
    if t is int or t is float or t is bool:
        return v
    if t is list and len(v) == 2 and all(type(x) in (int, float) for x in v):
        return complex(v[0], v[1])
    raise ValueError(f"a scalar argument must be a number, got {str(v)[:40]}")


def storage_bytes(buf: Any) -> Any:
    """The untyped storage behind a storage value; ValueError if ``buf`` is not a storage."""
    if not isinstance(buf, torch.Tensor) or buf.dtype is not torch.uint8 or buf.dim() != 1 \
            or buf.storage_offset() != 0:
        raise ValueError("an ATen operand must name a storage (this id holds an array)")
    return buf.untyped_storage()


def operand(buf: Any, layout: Any, device: Any) -> torch.Tensor:
    """The typed view ``layout`` of storage ``buf``, after checking it stays inside the storage."""
    st = storage_bytes(buf)
    need = A.layout_extent(layout, ITEMSIZE)
    if need > st.nbytes():
        raise ValueError(f"layout {layout[0]}/{layout[1]}+{layout[2]} {layout[3]} reaches byte {need} of a "
                         f"storage of {st.nbytes()} bytes")
    return torch.empty((0,), dtype=DTYPES[layout[3]], device=device).set_(st, layout[2], layout[0], layout[1])


def as_storage(t: torch.Tensor) -> torch.Tensor:
    """A storage value sharing ``t``'s memory (all of its storage)."""
    return torch.empty((0,), dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


class AtenKernel:
    """One vetted overload: binds a message's template to the schema, runs it, stores the results."""

    def __init__(self, name: str, op: Any, device: torch.device, rng: SessionRandom,
                 plans: dict[bytes, Any] | None = None, memory: Any = None) -> None:
        self.name, self.op, self.device, self.rng = name, op, device, rng
        self.base = base = name.split(".")[1]
        args = op._schema.arguments
        self.args = [(a.name, A.category(str(a.real_type)), str(a.real_type), a.kwarg_only) for a in args]
        marked = [bool(a.alias_info is not None and a.alias_info.is_write) for a in args]
        unmarked = A.UNMARKED_WRITES.get(name, ())
        #: the operands a call writes: as its schema marks them, and the ones it writes unmarked (a read never
        #: overtakes the call, a failure poisons them)
        self.writes = [w or a.name in unmarked for w, a in zip(marked, args)]
        self.writes_any = any(self.writes)
        self.seeded = torch.Tag.nondeterministic_seeded in op.tags and not any(c == A.GENERATOR
                                                                                for _, c, _, _ in self.args)
        self.resize = base in _RESIZE
        self.draw = rng.runner(op) if self.seeded else None
        #: operands whose values or sizes the CPU kernel trusts as memory positions: checked before it runs
        self.check = positions.checker(op) or rnn_layer.checker(op)
        #: how the kernel runs when not as ``op(*args, **kwargs)`` (the LSTM layer: in a grad mode, rnn_layer.py;
        #: a call CUDA takes and this CPU kernel refuses: device_gaps.py; CTC's partly written log_alpha: positions.py)
        self.special = rnn_layer.runner(op) or device_gaps.runner(op) or positions.ctc_written(op)
        self.unsafe_ok = self.check is not None and base in positions.UNSAFE_CHECKED
        #: the bytes an op whose output is sized by operand values allocates (``positions.SIZED``), and the session's
        #: memory it is charged to while the kernel runs
        self.sized, self.memory = positions.sizer(op), memory
        #: call shapes whose declared outputs hold what the call makes (:meth:`check_declared`); an output shaped by
        #: scalar values (``arange``'s end) is checked for each
        self.declared_ok: set[bytes] = set()
        self.value_shaped = base in declared.VALUE_SHAPED
        costed = declared.value_costed(base)  # (work per element grows with a value: never inline)
        #: elementwise or a reduction (work linear in its operands), no random stream, no resize: on small
        #: operands, cheap enough for the network loop (``x.sum().item()``, an accuracy's ``(p == y).sum()``)
        self.loop_ok = (torch.Tag.pointwise in op.tags or torch.Tag.reduction in op.tags) and not self.seeded \
            and not self.resize and not costed
        #: no resize, no RNN layer (a loop over time): on small operands, bounded enough for a caller's own thread
        self.bounded = not self.resize and self.special is None and not costed
        self.foreach = base.startswith("_foreach_")
        #: elementwise (a TensorIterator kernel): its outputs are its operands' broadcast (:meth:`check_outputs`)
        self.pointwise = torch.Tag.pointwise in op.tags and not self.foreach
        #: the session's call shapes bound once (:mod:`.eager`), for an overload that writes no operand and
        #: needs no position check; else None
        self.plans = None if self.resize or self.check is not None or any(marked) or self.special is not None \
            or self.sized is not None else plans

    def written(self, kwargs: Any) -> list[int]:
        """Positions (among the message's args: the scalar list, then the operands) of the operands this
        call writes."""
        if not self.writes_any:
            return []
        tmpl = kwargs.get("a") if isinstance(kwargs, dict) else None
        out: list[int] = []
        k = 1
        for (_, cat, _, _), w, entry in zip(self.args, self.writes, tmpl or ()):
            items = entry if cat == A.TENSOR_LIST and isinstance(entry, list) else [entry] if cat == A.TENSOR else []
            for e in items:
                if e == 0 and type(e) is int:
                    if w:
                        out.append(k)
                    k += 1
        return out

    def __call__(self, scalars: Any, *bufs: Any, a: Any, l: Any, o: Any) -> Any:  # noqa: E741
        if not isinstance(l, list) or not isinstance(a, list) or len(a) != len(self.args) \
                or len(l) != len(bufs) or not isinstance(scalars, list):
            raise ValueError(f"malformed ATen call of {self.name}: the template does not match its schema")
        plans = self.plans
        if plans is not None:  # a call shape seen before: bound and checked once (eager.py)
            p = plan_for(self, plans, a, l, o, DTYPES, ITEMSIZE, _scalar)
            if p is not None:
                r = p.run(self, scalars, bufs)
                if r is not GENERIC:
                    return r
        dev = self.device
        tensors = [operand(b, lay, dev) for b, lay in zip(bufs, l)]
        self.check_outputs(l, o)
        sized = self.check_declared(a, tensors, scalars, o)
        args, kwargs, before = self._bind(a, tensors, scalars)
        res = self.run(args, kwargs, sized)
        dynamic = o is None  # data-dependent: the outputs (a written one cloned) are taken before zeroing
        stored = self._results(res, o, tensors) if dynamic else None
        if before:  # (the written operands' storages and layouts: only asked for when there are some)
            for (t, nbytes), b, lay in zip(before, self._written_bufs(a, bufs), self._written_bufs(a, l)):
                if not dynamic and not self.resize:
                    self._keep_layout(t, b, lay)
                self._zero_growth(t, nbytes)
            self.respan(bufs)
        return stored if dynamic else self._results(res, o, tensors)

    def check_outputs(self, layouts: list[Any], specs: Any) -> None:
        """An elementwise call's declared outputs hold its operands' broadcast: memory is charged by the outputs the
        client declares, and three operands of 4,096 elements broadcast to 1 GiB (the result, refused after it ran,
        had already been allocated past the session's budget)."""
        if self.pointwise and specs and layouts:
            want = A.broadcast_numel(layouts)
            for spec in specs:
                if type(spec) is list and len(spec) == 6 and type(spec[1]) is list and math.prod(spec[1]) < want:
                    raise ValueError(f"{self.name}: an output of {spec[1]} declared where its operands broadcast to "
                                     f"{want} elements")

    #: what a call makes and how far it grows what it writes, sized before it runs (:mod:`.declared`)
    check_declared = declared.check_declared
    growth = declared.growth

    def run(self, args: list[Any], kwargs: dict[str, Any], sized: int = 0) -> Any:
        """The kernel itself (on the session's random stream when it draws), after the position check of
        an op whose kernel trusts operand values as memory positions (:mod:`.positions`)."""
        if self.check is not None:
            self.check(args, kwargs)
        if THREADS[0] is not None:
            _follow_threads()
        need = sized + (self.sized(args, kwargs) if self.sized is not None else 0) + self.growth(args)
        if need and self.memory is not None:
            self.memory.charge(need, lambda: f"{self.name}'s output, sized by its operands' values")
        try:
            if self.special is not None:
                return self.special(args, kwargs)
            return self.draw(args, kwargs) if self.draw is not None else self.op(*args, **kwargs)
        finally:
            if need and self.memory is not None:
                self.memory.release(need)

    def follow_and_call(self, call: Callable[[list[Any], list[Any]], Any], tensors: list[Any], S: list[Any]) -> Any:
        """A bound call (:mod:`.eager`) with this process's peer thread count, as :meth:`run` makes it."""
        if THREADS[0] is not None:
            _follow_threads()
        return call(tensors, S)

    @staticmethod
    def respan(bufs: Any) -> None:
        """After a kernel that wrote operands: a storage that grew (``resize_``, ``out=``) is spanned again
        by its uint8 value."""
        for b in bufs:
            st = b.untyped_storage()
            if b.numel() != st.nbytes():
                b.set_(st)

    def _bind(self, tmpl: list[Any], tensors: list[torch.Tensor], scalars: list[Any]) -> Any:
        args: list[Any] = []
        kwargs: dict[str, Any] = {}
        ti = si = 0
        before: list[tuple[torch.Tensor, int]] = []
        for (name, cat, rtype, kwonly), w, e in zip(self.args, self.writes, tmpl):
            if cat == A.TENSOR or cat == A.TENSOR_LIST:
                items = e if cat == A.TENSOR_LIST else [e]
                if cat == A.TENSOR_LIST and (type(e) is not list or len(e) > A.MAX_LIST):
                    raise ValueError(f"argument {name} of {self.name} must be a list of tensors")
                vals = []
                for x in items:
                    if x is None:
                        if cat == A.TENSOR and not rtype.startswith("Optional") or \
                                cat == A.TENSOR_LIST and "Optional" not in rtype:
                            raise ValueError(f"argument {name} of {self.name} may not be None")
                        vals.append(None)
                    elif x == 0 and type(x) is int:
                        t = tensors[ti]
                        ti += 1
                        if w:
                            before.append((t, t.untyped_storage().nbytes()))
                        vals.append(t)
                    elif x == 1 and type(x) is int:
                        vals.append(self._scalar_at(scalars, si))
                        si += 1
                    else:
                        raise ValueError(f"argument {name} of {self.name}: bad tensor entry {str(x)[:40]}")
                v: Any = vals if cat == A.TENSOR_LIST else vals[0]
            elif cat == A.SCALAR:
                if e is None:
                    v = None
                elif e == 1 and type(e) is int:
                    v = self._scalar_at(scalars, si)
                    si += 1
                else:
                    raise ValueError(f"argument {name} of {self.name}: bad scalar entry {str(e)[:40]}")
            elif cat == A.SCALAR_LIST:
                if e is None:
                    v = None
                elif type(e) is int and 0 <= e <= len(scalars) - si:
                    v = [_scalar(s) for s in scalars[si:si + e]]
                    si += e
                else:
                    raise ValueError(f"argument {name} of {self.name}: bad scalar-list entry {str(e)[:40]}")
            elif cat == A.LITERAL:
                if not _literal_ok(rtype, e):
                    raise ValueError(f"argument {name} of {self.name} must be {rtype}, got {str(e)[:60]}")
                # bounds checks are never skipped on a peer (unless positions.py makes the same ones)
                v = e if name != "unsafe" or self.unsafe_ok else False
            elif cat == A.STRING:
                if not (e is None and rtype.startswith("Optional") or type(e) is str and len(e) <= 256):
                    raise ValueError(f"argument {name} of {self.name} must be {rtype}")
                v = e
            elif cat == A.DTYPE:
                v = None if e is None and rtype.startswith("Optional") else DTYPES.get(e) if type(e) is str else 0
                if v == 0 or (v is None and e is not None):
                    raise ValueError(f"argument {name} of {self.name}: unknown dtype {str(e)[:40]}")
            elif cat == A.MEMORY_FORMAT:
                v = None if e is None and rtype.startswith("Optional") else MEMORY_FORMATS.get(e) if type(e) is str else 0
                if v == 0 or (v is None and e is not None):
                    raise ValueError(f"argument {name} of {self.name}: unknown memory format {str(e)[:40]}")
            elif cat == A.LAYOUT:
                if e not in (None, "strided"):
                    raise ValueError(f"argument {name} of {self.name}: only the strided layout is served")
                v = None if e is None else torch.strided
            elif cat == A.DEVICE:
                if e not in (None, 1):
                    raise ValueError(f"argument {name} of {self.name}: a device is None or 1 (this peer's)")
                v = None if e is None else self.device
            else:  # GENERATOR
                if e is not None:
                    raise ValueError(f"argument {name} of {self.name}: generators cannot be sent")
                v = self.rng.generator
            if kwonly:
                kwargs[name] = v
            else:
                args.append(v)
        if ti != len(tensors) or si != len(scalars):
            raise ValueError(f"malformed ATen call of {self.name}: {len(tensors)} tensors and {len(scalars)} "
                             f"scalars sent, the template uses {ti} and {si}")
        if "pin_memory" in kwargs:
            kwargs["pin_memory"] = None
        if self.foreach:  # (the kernels index every list by the first's length: each one as long)
            lens = {len(v) for v in (*args, *kwargs.values()) if isinstance(v, list)}
            if len(lens) > 1:
                raise ValueError(f"{self.name}: its lists must be equally long, not {sorted(lens)}")
        return args, kwargs, before

    def _scalar_at(self, scalars: list[Any], k: int) -> Any:
        if k >= len(scalars):
            raise ValueError(f"malformed ATen call of {self.name}: {len(scalars)} scalars sent, the template "
                             f"uses more")
        return _scalar(scalars[k])

    def _written_bufs(self, tmpl: list[Any], items: Any) -> list[Any]:
        """The entries of ``items`` (the message's storages, or their layouts) this call writes."""
        return [items[k - 1] for k in self.written({"a": tmpl})]

    def _keep_layout(self, t: torch.Tensor, buf: Any, layout: list[Any]) -> None:
        """A written operand must end in the layout the client recorded (the client sizes ``out=`` before the
        op): a kernel that restrided it has its values copied back into that layout; one that reshaped it
        fails, so the operand is poisoned instead of read wrongly."""
        size, stride, offset, _dt = layout
        if list(t.shape) == size and list(t.stride()) == stride and t.storage_offset() == offset:
            return
        if list(t.shape) != size:
            raise RuntimeError(f"{self.name} resized a written operand to {tuple(t.shape)} on the peer where the "
                               f"client recorded {tuple(size)}")
        value = t.clone()
        operand(buf, layout, self.device).copy_(value)

    @staticmethod
    def _zero_growth(t: torch.Tensor, nbytes: int) -> None:
        """A written storage grew (resize_, out=): never let the client see uninitialised memory (the client's
        layout of a written operand lies in the bytes it had; a data-dependent result was taken already)."""
        st = t.untyped_storage()
        new = st.nbytes()
        start = nbytes
        if start < new:
            torch.empty((0,), dtype=torch.uint8, device=t.device).set_(st, start, (new - start,), (1,)).zero_()

    def _results(self, res: Any, specs: Any, operands: list[torch.Tensor]) -> Any:
        flat = list(res) if isinstance(res, (tuple, list)) else [res]
        if specs is None:  # data-dependent outputs: stored as they came, their layouts in a last value
            return self._dynamic(flat, operands)
        if not isinstance(specs, list):
            raise ValueError(f"malformed ATen call of {self.name}: output specs")
        stored = []
        ptrs = {o.untyped_storage().data_ptr() for o in operands} if len(specs) > 1 else None
        for spec in specs:
            if not isinstance(spec, list) or len(spec) != 6 or type(spec[0]) is not int \
                    or not 0 <= spec[0] < len(flat):
                raise ValueError(f"malformed output spec of {self.name}: {str(spec)[:80]}")
            stored.append(self._store(flat[spec[0]], spec, operands, ptrs))
        return stored[0] if len(stored) == 1 else tuple(stored)

    def _dynamic(self, flat: list[Any], operands: list[torch.Tensor]) -> tuple[Any, ...]:
        """Each output as the op made it (a storage, or a 0-d value), then one int64 vector describing them:
        per output ``-1`` (undefined), ``-2`` (a value) or ``ndim, *size, *stride, offset, dtype index``."""
        out: list[Any] = []
        desc: list[int] = []
        for r in flat:
            if r is None:
                desc.append(-1)
                out.append(torch.zeros(0, dtype=torch.uint8, device=self.device))
            elif isinstance(r, torch.Tensor):
                if any(o.untyped_storage().data_ptr() == r.untyped_storage().data_ptr() for o in operands):
                    r = r.clone()
                r = tight(r)
                desc += [r.dim(), *r.shape, *r.stride(), r.storage_offset(), A.DTYPES.index(str(r.dtype)[6:])]
                out.append(as_storage(r))
            else:
                desc.append(-2)
                out.append(torch.tensor(r, device=self.device))
        out.append(torch.tensor(desc, dtype=torch.int64, device=self.device))
        return tuple(out)

    def _store(self, r: Any, spec: list[Any], operands: list[torch.Tensor],
               ptrs: set[int] | None = None) -> torch.Tensor:
        """``r`` kept (its memory adopted) or copied in the layout ``spec`` names (an output sharing an operand's
        memory is copied); ``ptrs``: the operands' storage addresses when the caller has them."""
        _, size, stride, offset, dtype, nbytes = spec
        layout = [size, stride, offset, dtype]
        need = A.layout_extent(layout, ITEMSIZE)
        if type(nbytes) is not int or not need <= nbytes <= A.INT64[1]:
            raise ValueError(f"output spec of {self.name}: {nbytes!r} bytes cannot hold layout {layout}")
        if not isinstance(r, torch.Tensor):
            r = torch.tensor(r, device=self.device)
        if list(r.shape) != size and (r.numel() == 0 or 0 in size) and self.base in declared.LENIENT:
            r = torch.zeros(size, dtype=DTYPES[dtype], device=self.device)
        if list(r.shape) != size or r.dtype is not DTYPES[dtype]:
            raise RuntimeError(f"{self.name} returned {tuple(r.shape)} {r.dtype} on the peer where the client "
                               f"inferred {tuple(size)} {dtype}")
        if ptrs is None:
            ptrs = {o.untyped_storage().data_ptr() for o in operands}
        if list(r.stride()) == stride and r.storage_offset() == offset and adoptable(r, nbytes, ptrs):
            return as_storage(r)
        buf = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        operand(buf, layout, self.device).copy_(r)
        return buf


def internal_ops(device: torch.device, rng: SessionRandom, max_tensor: int) -> dict[str, Callable[..., Any]]:
    """Ember's own torch ops (:data:`ember.protocol.aten.INTERNAL`)."""

    def alloc(*, n: Any) -> torch.Tensor:
        if type(n) is not int or not 0 <= n <= max_tensor:
            raise ValueError(f"a storage of {n!r} bytes is outside this peer's limit of {max_tensor} bytes")
        return torch.zeros(n, dtype=torch.uint8, device=device)

    def seed(value: Any) -> tuple[()]:
        if type(value) is not int or not 0 <= value < 1 << 64:
            raise ValueError(f"a seed is an int in [0, 2**64), got {value!r}")
        rng.generator.manual_seed(value)
        return ()

    def storage_of(x: Any) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise ValueError("storage_of needs an array value")
        x = x.detach().resolve_conj().resolve_neg()
        if not x.is_contiguous() or x.storage_offset() or x.untyped_storage().nbytes() != x.numel() * x.element_size():
            x = x.clone(memory_format=torch.contiguous_format)
        return as_storage(x)

    def array_of(buf: Any, *, l: Any) -> torch.Tensor:  # noqa: E741
        if not isinstance(l, list) or len(l) != 1:
            raise ValueError("array_of takes one layout")
        return operand(buf, l[0], device).clone(memory_format=torch.contiguous_format)

    return {"torch.alloc": alloc, "torch.seed": seed, "torch.storage_of": storage_of, "torch.array_of": array_of,
            **{name: internal_calls.call(run, device, operand, as_storage) for name, run in (
                ("torch.rnn_layer", rnn_recompute.layer), ("torch.rnn_layer_backward", rnn_recompute.layer_backward),
                ("torch.sparse_mm", sparse_mm.sparse_mm), ("torch.sparse_add", sparse_mm.sparse_add),
                ("torch.rng_state", rng.state),
                ("torch.set_rng_state", rng.set_state))}}


class Refused:
    """What a refused name resolves to: raises why; ``written`` says what the call would have written."""

    def __init__(self, why: str, written: Callable[[Any], list[int]] | None) -> None:
        self.why = why
        if written is not None:
            self.written = written

    def __call__(self, *a: Any, **k: Any) -> Any:
        raise UnknownOp(self.why)


#: A device table's key (a tuple: no op name equals it) for a maker of per-session ops (collectives.py).
SESSION_OPS = ("session ops",)


class AtenOps(dict):  # type: ignore[type-arg]
    """A session's op table on a torch device: the device's Array API table, Ember's own torch ops,
    and on first use one kernel per vetted ATen overload (a refused name gets a kernel that says why)."""

    def __init__(self, base: dict[str, Callable[..., Any]], device: torch.device, max_tensor: int,
                 memory: Any = None) -> None:
        super().__init__(base)
        self.device, self.memory = device, memory
        self.rng = SessionRandom(device)
        self.plans: dict[bytes, Any] = {}  # eager call shapes bound once (eager.py), for all its kernels
        self.update(internal_ops(device, self.rng, max_tensor))
        make = base.get(SESSION_OPS)  # type: ignore[call-overload]
        if make is not None:
            self.update(make(device, memory))  # (collectives charge what they hold to the session)

    def __missing__(self, name: Any) -> Callable[..., Any]:
        if not isinstance(name, str) or not name.startswith("aten."):
            raise KeyError(name)
        why = refusal(name)
        p = name.split(".")
        op = _overload(p[1], p[2]) if len(p) == 3 else None
        fn: Callable[..., Any]
        if why is None:
            fn = AtenKernel(name, op, self.device, self.rng, self.plans, self.memory)
        elif op is not None:  # refused, but what it would write is known: that gets the poison
            fn = Refused(why, AtenKernel(name, op, self.device, self.rng).written)
        else:
            fn = Refused(why, None)
        if len(self) < 1 << 14:
            self[name] = fn
        return fn

    def get(self, name: Any, default: Any = None) -> Any:  # type: ignore[override]
        try:
            return self[name]
        except KeyError:
            return default


__all__ = ["AtenOps", "AtenKernel", "refusal", "operand", "as_storage", "storage_bytes"]
