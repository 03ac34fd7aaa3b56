"""A registered graph lowered once into a flat program: the peer's replay of ATen steps at near kernel speed.

At a graph's first replay :class:`Program` lowers it. Every ATen step whose template binds (the same
checks as the generic kernel: :meth:`AtenKernel._bind`, each layout's extent, each output spec) becomes
a *fast step*: a small function made once for its template that takes its operands from a file of
*typed registers* and calls the overload's C++ handle directly (``OpOverload._op``; a random op through
the session's stream). A typed register holds one register in one layout:

* a graph input in a layout its consumers read: a view of the input's storage, *cached* across replays
  keyed on the identity of the storage value the session holds (a replay with the same storages makes
  no view at all). The views are dropped when that value leaves the session (:meth:`Program.unbind`,
  called by ``Holdings.forget``) or another value is bound, so a cached view never keeps a freed,
  uncharged storage alive;
* a *moving* layout of an input (GRAPH's ``moving``: a window a loop slides over a tensor): a view of its
  own, made again when a replay moves its offset (:meth:`Program._move`), checked against the storage
  as every input view is;
* a fast step's result, in the layout its output spec names (the result itself, adopted), and each
  other layout a later step reads it in (a view, made once the result exists).

A fast step's results are checked against their specs (layout, bytes, no aliasing of an operand) until
one run has shown they match exactly: from then on, for an overload whose schema returns fresh tensors
and writes nothing, they are adopted unchecked (a kernel's output layout depends only on its operands'
layouts and its template, both fixed). A replay that overrides a step's scalars checks it again, until
one such replay with scalars of the same types was exact, for an overload whose results the scalars'
values cannot shape (pointwise, ``_foreach_``: an optimizer's bias corrections change every step).

The bytes of the fast steps' declared outputs are charged once per replay, up front (what the generic
replay charges step by step); when that is over the budget, or a step's operand is poisoned, missing,
or not a storage that holds its layout, the step runs as the generic replay runs it
(:meth:`GraphReplay._step`: the same errors, the same poison), as does every step that is not a vetted
ATen call. Storage values are made only where one is needed (a generic step's operand, a kept output).
An op whose position check reads operand values (:mod:`.positions`: embedding backward's indices) is a
fast step too: its function runs the check on the bound call at every replay, before the kernel, and
raises what the generic step raises (the same poison); the compiled prefix (compiled.py) stops before it.

A trusted step whose result is large (``POOL_MIN``) and never leaves the replay (not kept, read by fast
steps only) writes it with the overload's ``out=`` twin into a buffer the program keeps across replays
(charged to the session while kept, returned when the graph leaves the cache): no allocation, so no
fresh pages to fault in, per replay (glibc maps such buffers afresh each time: issue 21's page faults).
"""

from __future__ import annotations

import math
import sys
from typing import Any, Callable

from .sizes import THRESHOLD
from .step_maker import _MISS, _layouts_pass, _maker, _scalar_count, _slot

#: Results of at least this many bytes that never leave a replay get a buffer kept across replays.
POOL_MIN = 1 << 20
TYPED = "_ember_result"  # the attribute of a storage value that holds the typed result it spans (span)


class FastStep:
    """One ATen step of a program (see the module docstring)."""

    __slots__ = ("i", "kernel", "fc", "fd", "trs", "sreg", "n_scal", "outs", "one", "touts", "wtrs", "wregs",
                 "wlays", "trustable", "trusted", "nbytes", "name", "kw", "oregs", "plan", "kwplan", "baked",
                 "otypes", "sfree", "fviews", "vcheck")


class Program:
    """A graph's steps lowered once; :meth:`run` replays them over a register file (see the module docstring)."""

    def __init__(self, g: Any, it: Any) -> None:
        aten = sys.modules["ember.server.execute.aten"]
        import torch
        self.torch, self.aten, self.device, self.views = torch, aten, it.backend.device, it._views
        n_in, first_out = g.n_in, g.n_in + g.n_s
        self.n_in = n_in
        self.trmap: dict[tuple[int, Any], int] = {}          # (register, layout) -> typed register
        self.lays: dict[int, list[tuple[int, Any]]] = {}      # register -> [(typed register, layout)]
        self.in_lays: dict[int, list[tuple[int, Any, int]]] = {}  # input -> [(typed register, layout, extent)]
        self.prod: dict[int, int] = {}  # register a fast step makes -> its typed register (the spec's layout)
        self.derive: dict[int, list[tuple[int, Any, int]]] = {}  # such a register -> other layouts read
        self.fast: list[FastStep | None] = []
        #: moving layouts (GRAPH's ``moving``) fast steps read: (index, input, typed register, layout); the
        #: offset each one's cached view was made at (-1: none yet)
        self.mv: list[tuple[int, int, int, Any]] = []
        self.mv_at: list[int] = []
        moving = {(i, t): j for j, (i, t, _) in enumerate(g.moving)}
        for i, s in enumerate(g.steps):
            try:
                fs = self._lower(i, s, g, n_in, first_out)
            except Exception:  # noqa: BLE001 - the generic step says what is wrong, at replay
                fs = None
            if fs is None:
                for r in s[2]:
                    self.prod.pop(r, None)
            else:
                fs.trs = [self._source(r, lay) if (i, t) not in moving else self._moving(moving[(i, t)], r, lay)
                          for t, (r, lay) in enumerate(fs.trs)]
                fs.wtrs = [fs.trs[j] for j in fs.wtrs]
                for _, oreg, lay in fs.outs:
                    self.prod[oreg] = self._tr(oreg, lay)
                fs.outs = [(spec, self.prod[oreg], oreg) for spec, oreg, _ in fs.outs]
                fs.fc = fs.fc(fs.trs) if fs.fc is not None else None
                fs.fd = fs.fd(fs.trs)
            self.fast.append(fs)
        for fs in self.fast:
            if fs is not None:
                fs.touts = [(spec[0], tro, self.derive.get(oreg)) for spec, tro, oreg in fs.outs]
                fs.fviews = [None] * len(fs.touts)
        self.V0: list[Any] = [None] * len(self.trmap)
        self.bound: list[Any] = [None] * n_in  # the storage value each input's cached views are of
        self.need = sum(fs.nbytes for fs in self.fast if fs is not None)
        self.n_fast = sum(1 for fs in self.fast if fs is not None)
        self.comp: Any = None  # its compiled prefix (compiled.py), False when there is none to compile
        self.pooled: list[tuple[FastStep, int]] = []  # steps writing into a buffer kept across replays
        self.escapes: set[int] | None = None  # registers kept or read by generic steps
        self.mem: Any = None
        self.replays = 0

    # ---- lowering ----------------------------------------------------------------------------
    def _tr(self, r: int, lay: Any) -> int:
        key = (r, lay)
        tr = self.trmap.get(key)
        if tr is None:
            tr = self.trmap[key] = len(self.trmap)
            self.lays.setdefault(r, []).append((tr, lay))
        return tr

    def _source(self, r: int, lay: Any) -> int:
        """The typed register step operands read ``r`` in ``lay`` from (made where it is first needed)."""
        if (r, lay) in self.trmap:
            return self.trmap[(r, lay)]
        tr = self._tr(r, lay)
        need = self.aten.A.layout_extent(_list(lay), self.aten.ITEMSIZE)
        if r < self.n_in:
            self.in_lays.setdefault(r, []).append((tr, lay, need))
        elif r in self.prod:
            self.derive.setdefault(r, []).append((tr, lay, need))
        return tr  # a generic step's result: its typed registers are made after it ran (:meth:`_generic`)

    def _lower(self, i: int, s: Any, g: Any, n_in: int, first_out: int) -> FastStep | None:
        aten, torch = self.aten, self.torch
        fn, regs, oregs, kw, name, _, err = s
        if err is not None or type(fn) is not aten.AtenKernel or fn.resize \
                or not isinstance(kw, dict) or set(kw) != {"a", "l", "o"} or not isinstance(kw["o"], list):
            return None
        a, lays, specs = kw["a"], kw["l"], kw["o"]
        if not isinstance(lays, list) or not isinstance(a, list) or len(a) != len(fn.args) \
                or len(regs) != 1 + len(lays) or len(oregs) != len(specs):
            return None
        if fn.special is not None:
            return None  # (an RNN layer, a call CUDA takes and the CPU kernel refuses: AtenKernel.run, generic)
        vcheck = None  # a position check that reads operand values: run by the step, at every call
        if fn.check is not None and not _layouts_pass(fn, a, lays, aten, torch):
            vcheck = fn.check
        sreg = regs[0]
        if not n_in <= sreg < first_out or any(n_in <= r < first_out for r in regs[1:]):
            return None
        beyond = 0  # what the layouts describe beyond the bytes they reach (a stride-0 view): from THRESHOLD on, a
        #             generic step, which charges it while it runs (sizes.expanded, as for a call sent alone)
        for lay in lays:
            reach = aten.A.layout_extent(lay, aten.ITEMSIZE)  # raises: generic
            beyond += math.prod(lay[0]) * aten.ITEMSIZE[lay[3]] - reach
        if fn.value_shaped or beyond >= THRESHOLD:
            return None  # (arange-like: its outputs' sizes come from its scalars; checked by the generic kernel)
        n_scal = _scalar_count(fn, a, aten.A)
        consts = g.scalars[sreg - n_in]
        metas = [torch.empty_strided(lay[0], lay[1], dtype=aten.DTYPES[lay[3]], device="meta") for lay in lays]
        fn.check_declared(a, metas, consts if type(consts) is list and len(consts) == n_scal else
                          [float(j) + 0.5 for j in range(n_scal)], specs)  # raises: generic, which says why
        fs = FastStep()
        fs.i, fs.kernel, fs.name, fs.kw, fs.sreg, fs.oregs = i, fn, name, kw, sreg, oregs
        fs.trusted = False
        fs.otypes = None  # the scalars' types of an overriding replay it was shown exact under (then trusted so)
        # bind once with markers: each tensor slot a distinct empty tensor, each scalar a distinct float
        marks = [torch.empty(0, device="cpu") for _ in lays]
        smarks = [float(j) + 0.5 for j in range(n_scal)]
        args, kwargs, before = fn._bind(a, marks, smarks)
        tid = {id(t): j for j, t in enumerate(marks)}
        sid = {id(x): j for j, x in enumerate(smarks)}
        plan = [_slot(v, tid, sid) for v in args]
        kwplan = {n: _slot(v, tid, sid) for n, v in kwargs.items()}
        fs.n_scal = n_scal
        fs.wtrs = [tid[id(t)] for t, _ in before]
        fs.wregs = [regs[1 + j] for j in fs.wtrs]
        fs.wlays = [lays[j] for j in fs.wtrs]
        fs.trs = [(r, _key(lay)) for r, lay in zip(regs[1:], lays)]
        op = fn.op._op if fn.draw is None else None
        try:
            baked = [aten._scalar(x) for x in consts] if type(consts) is list and len(consts) == n_scal else None
        except ValueError:
            baked = None
        fs.plan, fs.kwplan, fs.baked, fs.vcheck = plan, kwplan, baked, vcheck
        fs.fc = _maker(plan, kwplan, op, fn.draw, baked, len(lays), vcheck) if baked is not None else None
        fs.fd = _maker(plan, kwplan, op, fn.draw, None, len(lays), vcheck)
        fs.outs = []
        nbytes = 0
        for spec, oreg in zip(specs, oregs):
            if not isinstance(spec, list) or len(spec) != 6 or type(spec[0]) is not int or spec[0] < 0:
                return None
            _, size, stride, offset, dtype, nb = spec
            lay = [size, stride, offset, dtype]
            if type(nb) is not int or not aten.A.layout_extent(lay, aten.ITEMSIZE) <= nb <= aten.A.INT64[1]:
                return None
            fs.outs.append(((spec[0], torch.Size(size), tuple(stride), offset, aten.DTYPES[dtype], nb, spec),
                            oreg, _key(lay)))
            nbytes += nb
        fs.nbytes = nbytes
        # results adopted unchecked once shown exact: fresh tensors (or none: an in-place op whose written
        # operands kept their layout and bytes, which depends on their layouts only)
        fs.trustable = not specs or all(r.alias_info is None for r in fn.op._schema.returns)
        # results shaped by the operands alone, whatever the scalars' values (not so: arange's end)
        fs.sfree = torch.Tag.pointwise in fn.op.tags or fn.name.startswith("aten._foreach_")
        fs.one = -1
        return fs

    def _moving(self, j: int, r: int, lay: Any) -> int:
        """The typed register of moving layout ``j`` (input ``r`` in ``lay``, whose offset each replay sets): its
        own, shared with no other operand; its view is made again when the offset changes (:meth:`_move`)."""
        tr = self.trmap[(r, ("moving", j))] = len(self.trmap)
        self.lays.setdefault(r, []).append((tr, lay))
        self.in_lays.setdefault(r, []).append((tr, lay, self.aten.A.layout_extent(_list(lay), self.aten.ITEMSIZE)))
        self.mv.append((j, r, tr, lay))
        self.mv_at.append(-1)
        return tr

    def _move(self, R: list[Any], offs: list[int]) -> None:
        """The moving layouts' views at this replay's offsets (None past the storage's end: that step runs
        generically, where the layout is checked and the op poisoned as if sent alone)."""
        at, V0, bound = self.mv_at, self.V0, self.bound
        for x, (j, r, tr, (size, stride, _, dt)) in enumerate(self.mv):
            off = offs[j]
            if at[x] == off:
                continue
            at[x] = off
            b = bound[r]
            if b is None or b is not R[r]:
                V0[tr] = None
                continue
            lay = (size, stride, off, dt)
            self._derive(V0, b, [(tr, lay, self.aten.A.layout_extent(_list(lay), self.aten.ITEMSIZE))], self.device)

    # ---- inputs: views cached on the storage value --------------------------------------------
    def _bind_input(self, k: int, b: Any) -> None:
        """Views of input ``k``'s storage value ``b`` in each layout its fast consumers read (None where
        ``b`` is not a storage or too small: those steps run generically and say why)."""
        self.unbind(k, self.bound[k])
        torch, V0 = self.torch, self.V0
        for x, mv in enumerate(self.mv):
            if mv[1] == k:
                self.mv_at[x] = -1  # (its view is made at this replay's offset by _move)
        ok = isinstance(b, torch.Tensor) and b.dtype is torch.uint8 and b.dim() == 1 and b.storage_offset() == 0
        entries = self.in_lays.get(k, ())
        if not ok:
            for tr, _, _ in entries:
                V0[tr] = None
        else:
            base = b.__dict__.get(TYPED)  # the typed result it spans (:func:`span`): read as itself
            if base is not None and entries:
                entries = self._reuse(V0, b, base, entries)
            if entries:
                self._derive(V0, b, entries, self.device)
            self.bound[k] = b
            self.views.setdefault(id(b), set()).add((self, k))

    def _reuse(self, V0: list[Any], b: Any, base: Any, entries: Any) -> list[Any]:
        """Input views made of ``base`` (a typed tensor on ``b``'s very storage, on this device): ``base``
        itself in its own layout, a view of it in another of its dtype (``as_strided`` checks the extent); the
        entries left to :meth:`_derive`."""
        if base.device != self.device or base.untyped_storage()._cdata != b.untyped_storage()._cdata:
            return entries
        dtype = base.dtype
        have = (tuple(base.shape), base.stride(), base.storage_offset(), dtype)
        DT, left = self.aten.DTYPES, []
        for e in entries:
            size, stride, off, dt = e[1]
            if DT[dt] is not dtype:
                left.append(e)
            elif (size, stride, off, dtype) == have:
                V0[e[0]] = base
            else:
                try:
                    V0[e[0]] = base.as_strided(size, stride, off)
                except RuntimeError:  # past the storage: _derive says so
                    left.append(e)
        return left

    def unbind(self, k: int, b: Any) -> None:
        """Input ``k``'s cached views are of ``b``, which the session no longer holds: drop them."""
        if b is None or self.bound[k] is not b:
            return
        self.bound[k] = None
        for tr, _, _ in self.in_lays.get(k, ()):
            self.V0[tr] = None
        for x, mv in enumerate(self.mv):
            if mv[1] == k:
                self.mv_at[x] = -1

    def release(self) -> None:
        """Drop every cached view (the graph left the cache, or a kernel restrided a view)."""
        for k, b in enumerate(self.bound):
            self.unbind(k, b)

    # ---- replay ----------------------------------------------------------------------------------
    def run(self, it: Any, g: Any, R: list[Any], ovr: Any, st: Any, offs: list[int] | None = None) -> None:
        """Replay the graph over ``R`` (inputs and scalars set; ``offs``: the moving layouts' offsets); kept
        registers hold storage values after."""
        if self.aten.THREADS[0] is not None:  # (the fast steps call kernels directly: AtenKernel.run follows it)
            self.aten._follow_threads()
        bound = self.bound
        for k in self.in_lays:
            if R[k] is not bound[k]:
                self._bind_input(k, R[k])
        if self.mv:
            self._move(R, offs)  # type: ignore[arg-type]
        V = self.V0.copy()
        fast: Any = self.fast
        if self.need:
            try:
                it.mem.charge(self.need, lambda: f"the {self.n_fast} ATen steps of graph {g.gid}")
                st.temps += self.need
            except Exception:  # noqa: BLE001 - over the budget: each step charged (and refused) on its own
                fast = [None] * len(fast)
        start = 0
        if it.compiler is not None and fast is self.fast:  # the session agreed on compiled graphs
            c = self.comp
            if c is None and self.replays:  # (its steps are trusted after one replay)
                c = self.comp = it.compiler.lookup(self, g) or False
            if c and c.state == "ready" and not (ovr and not c.sregs.isdisjoint(ovr)):
                start = c.run(self, V)
        self.replays += 1
        generic, checked = self._generic, self._checked
        for i in range(start, len(fast)):
            if it.poked:  # a batch came: a small read may run now, between two steps (server/read_ahead.py)
                it.poke()
            fs = fast[i]
            if fs is None:
                generic(it, g, R, V, st, i, None)
            elif fs.trusted and not (ovr and fs.sreg in ovr):
                try:
                    res = fs.fc(V)
                except Exception as e:  # noqa: BLE001 - the kernel's own error: the op's poison
                    self._failed(it, R, V, st, fs, e)
                    continue
                if res is _MISS:
                    generic(it, g, R, V, st, i, fs)
                elif fs.one >= 0:
                    V[fs.one] = res
                else:
                    self._adopt(V, fs, res)
            else:
                checked(it, g, R, V, st, fs, ovr)
        mat = self._mat
        for r in g.kept:
            mat(R, V, r)

    def _adopt(self, V: list[Any], fs: FastStep, res: Any) -> None:
        """A trusted step's results into their typed registers, and the other layouts later steps read them
        in: views made at once where :meth:`_views_of` found them of the result's dtype and within its spec's
        bytes (``as_strided`` checks the extent itself: one that does not fit is made by :meth:`_derive`)."""
        for (idx, tro, d), f in zip(fs.touts, fs.fviews):
            r = res if idx < 0 else res[idx]
            V[tro] = r
            if f is not None:
                try:
                    for tr, size, stride, off in f:
                        V[tr] = r.as_strided(size, stride, off)
                    continue
                except RuntimeError:
                    pass
            if d:
                self._derive(V, r, d)

    def _views_of(self, fs: FastStep) -> list[Any]:
        """Per result of ``fs`` (once trusted): the layouts later steps read it in as ``(typed register, size,
        stride, offset)``, when each is of the result's dtype and within its spec's bytes; else None."""
        DT, out = self.aten.DTYPES, []
        specs = {tro: (dt, nb) for (_, _, _, _, dt, nb, _), tro, _ in fs.outs}
        for _, tro, d in fs.touts:
            dt, nb = specs[tro]
            ok = bool(d) and all(DT[lay[3]] is dt and need <= nb for _, lay, need in d)
            out.append([(tr, lay[0], lay[1], lay[2]) for tr, lay, _ in d] if ok else None)
        return out

    def _mat(self, R: list[Any], V: list[Any], r: int) -> Any:
        """Register ``r``'s storage value (made from its typed register if only that exists)."""
        v = R[r]
        if v is None and r in self.prod:
            t = V[self.prod[r]]
            if t is not None:
                v = R[r] = span(t, self.aten.as_storage, self.torch.uint8)
        return v

    def _derive(self, V: list[Any], r: Any, d: Any, dev: Any = None) -> None:
        """Views of ``r``'s storage (on ``dev``, default ``r``'s device) in the layouts ``d`` (typed register,
        layout, bytes it needs) into ``V``: None where the storage is too small (that step runs generically
        and says why)."""
        st = r.untyped_storage()
        n = st.nbytes()
        empty, DT = self.torch.empty, self.aten.DTYPES
        same = dev is None or dev == r.device
        dev = r.device if dev is None else dev
        for tr, (size, stride, off, dt), need in d:
            if need > n:
                V[tr] = None
            elif same and r.dtype is DT[dt]:  # (half the cost of a fresh tensor set_ on the storage)
                V[tr] = r.as_strided(size, stride, off)
            else:
                V[tr] = empty((0,), dtype=DT[dt], device=dev).set_(st, off, size, stride)

    def _generic(self, it: Any, g: Any, R: list[Any], V: list[Any], st: Any, i: int, fs: FastStep | None) -> None:
        """Step ``i`` as the generic replay runs it; then its results' typed registers."""
        if fs is not None and fs.nbytes:  # charged up front: the generic step charges its own
            it.mem.release(fs.nbytes)
            st.temps -= fs.nbytes
        _, regs, oregs, kw, _, _, _ = g.steps[i]
        for r in regs:
            if r >= self.n_in and R[r] is None:
                self._mat(R, V, r)
        p = it._step(g, i, R, st)
        if p is not None:
            for r in regs:  # a written operand may be poisoned now
                if type(R[r]) is type(p):
                    for tr, _ in self.lays.get(r, ()):
                        V[tr] = None
        operand = self.aten.operand
        for o in oregs:
            lays = self.lays.get(o)
            if lays:
                b = R[o]
                for tr, lay in lays:
                    try:
                        V[tr] = operand(b, _list(lay), self.device)
                    except Exception:  # noqa: BLE001 - poisoned, or not a storage for this layout: generic
                        V[tr] = None

    def _failed(self, it: Any, R: list[Any], V: list[Any], st: Any, fs: FastStep, e: Exception) -> None:
        """A fast step's kernel raised: its outputs and what it writes get the op's poison."""
        p = it._replay_poison(fs.name, [], e, fs.kw)
        for o in fs.oregs:
            R[o] = p
        for r in fs.wregs:
            R[r] = p
            for tr, _ in self.lays.get(r, ()):
                V[tr] = None
            if r < self.n_in:
                st.spoiled[st.ins[r]] = p
        st.bad = True

    def _checked(self, it: Any, g: Any, R: list[Any], V: list[Any], st: Any, fs: FastStep, ovr: Any) -> None:
        """A fast step with every result checked against its spec (and trusted after an exact match)."""
        torch, k = self.torch, fs.kernel
        over = bool(ovr) and fs.sreg in ovr
        if over:
            s = R[fs.sreg]
            try:
                if type(s) is not list or len(s) != fs.n_scal:
                    raise ValueError(s)
                S = [self.aten._scalar(x) for x in s]
            except ValueError:
                return self._generic(it, g, R, V, st, fs.i, fs)
            types = tuple(map(type, S))
            if types == fs.otypes:  # shown exact with scalars of these types: adopted unchecked (see _trust)
                try:
                    res = fs.fd(V, S)
                except Exception as e:  # noqa: BLE001 - the kernel's own error: the op's poison
                    return self._failed(it, R, V, st, fs, e)
                if res is _MISS:
                    return self._generic(it, g, R, V, st, fs.i, fs)
                return self._adopt(V, fs, res)
        elif fs.fc is None:
            return self._generic(it, g, R, V, st, fs.i, fs)
        tensors = [V[t] for t in fs.trs]
        if any(t is None for t in tensors):  # (not `None in`: tensor == None raises inside torch, slowly)
            return self._generic(it, g, R, V, st, fs.i, fs)
        exact = True
        try:
            before = [(V[t], V[t].untyped_storage().nbytes()) for t in fs.wtrs]
            res = fs.fd(V, S) if over else fs.fc(V)
            for (t, nb), r, lay in zip(before, fs.wregs, fs.wlays):
                size, stride, off, _ = lay
                if t.untyped_storage().nbytes() != nb:
                    exact = False
                if list(t.shape) != size or list(t.stride()) != stride or t.storage_offset() != off:
                    exact = False
                    b = self._mat(R, V, r)
                    k._keep_layout(t, b, lay)  # raises when reshaped
                    self.release()  # the cached view was restrided: views are made again
                    for tr, lay2 in self.lays.get(r, ()):
                        V[tr] = self.aten.operand(b, _list(lay2), self.device)
                k._zero_growth(t, nb)
                b = R[r]
                if b is not None and b.numel() != t.untyped_storage().nbytes():
                    k.respan([b])
            flat = list(res) if isinstance(res, (tuple, list)) else [res]
            ptrs = None
            for (idx, size, stride, off, dtype, nb, spec), tro, oreg in fs.outs:
                if idx >= len(flat):
                    k._results(res, fs.kw["o"], tensors)  # raises why
                r = flat[idx]
                if isinstance(r, torch.Tensor) and r.dtype is dtype and r.shape == size and r.stride() == stride \
                        and r.storage_offset() == off:
                    if ptrs is None:
                        ptrs = {t.untyped_storage().data_ptr() for t in tensors}
                    if self.aten.adoptable(r, nb, ptrs):  # (a storage holding nothing but r: tight.py)
                        V[tro] = r
                        continue
                exact = False
                b = R[oreg] = k._store(r, spec, tensors)  # copies, zero-fills, or says what is wrong
                V[tro] = self.aten.operand(b, spec[1:5], self.device)
        except Exception as e:  # noqa: BLE001 - as the generic kernel fails: the op's poison
            return self._failed(it, R, V, st, fs, e)
        for idx, tro, d in fs.touts:
            if d:
                self._derive(V, V[tro], d)
        if exact and fs.trustable:
            self._trust(it, g, fs, res, types if over else None)

    def _trust(self, it: Any, g: Any, fs: FastStep, res: Any, types: tuple[type, ...] | None) -> None:
        """Step ``fs``'s results matched their specs exactly: later replays adopt them unchecked. A result's
        layout depends only on the operands' layouts, the template and the scalars' types (promotion: an int
        tensor plus a float is a float tensor), and for a pointwise or ``_foreach_`` overload never on the
        scalars' values (``sfree``; ``arange``'s end is a scalar), so a replay overriding such a step's scalars
        is trusted too once one with scalars of the same types was exact (``types``)."""
        if not isinstance(res, (tuple, list)) and any(idx >= 0 for idx, _, _ in fs.touts):
            fs.touts = [(-1, tro, d) for _, tro, d in fs.touts]
            if len(fs.touts) == 1 and not fs.touts[0][2]:
                fs.one = fs.touts[0][1]
        fs.fviews = self._views_of(fs)
        if types is not None:
            fs.otypes = types if fs.sfree else None
        elif fs.fc is not None:
            fs.trusted = True
            if fs.one >= 0 and fs.nbytes >= POOL_MIN:
                self._pool(it, g, fs)

    # ---- output buffers kept across replays --------------------------------------------------------
    def _pool(self, it: Any, g: Any, fs: FastStep) -> None:
        """A trusted step's large result that never leaves the replay (not kept, read by fast steps only)
        is written by the overload's ``out=`` twin into one buffer the program keeps across replays: no
        allocation, so no page faults, per replay. The buffer is charged to the session while kept."""
        oreg = fs.oregs[0]
        if self.escapes is None:
            self.escapes = set(g.kept)
            for f, s in zip(self.fast, g.steps):
                if f is None:
                    self.escapes.update(s[1])
        op = fs.kernel.op
        twin = getattr(op.overloadpacket, "out", None)
        names = [a.name for a in op._schema.arguments]
        if oreg in self.escapes or fs.kernel.draw is not None or fs.fc is None or twin is None \
                or [a.name for a in twin._schema.arguments] != names + ["out"]:
            return
        (_, size, stride, off, dt, nb, _), _, _ = fs.outs[0]
        try:
            it.mem.charge(nb, lambda: f"an output buffer of graph {g.gid}")
        except Exception:  # noqa: BLE001 - no room: the step allocates its result each replay
            return
        torch = self.torch
        buf = torch.zeros(nb, dtype=torch.uint8, device=self.device)
        out = torch.empty((0,), dtype=dt, device=self.device).set_(buf.untyped_storage(), off, size, stride)
        fs.fc = _maker(fs.plan, {**fs.kwplan, "out": ("c", out)}, twin._op, None, fs.baked, len(fs.trs),
                       fs.vcheck)(fs.trs)
        self.pooled.append((fs, nb))
        self.mem = it.mem

    def drop(self) -> None:
        """The graph left the cache: cached views and kept output buffers go (their charges returned)."""
        self.release()
        for fs, nb in self.pooled:
            fs.trusted = False  # (a program is not replayed after this; its steps would be checked again)
            self.mem.release(nb)
        self.pooled = []


def span(t: Any, as_storage: Callable[[Any], Any], u8: Any) -> Any:
    """A storage value of result ``t``: ``t``'s own bytes as a flat ``uint8`` view when ``t`` covers all of
    its storage from offset 0 (a fresh contiguous result: no new tensor set on a storage; ``t`` is kept on it,
    ``TYPED``, and a later graph reads it as itself: :meth:`Program._reuse`); else :func:`aten.as_storage`."""
    try:
        u = t.view(-1).view(u8)
        if u.storage_offset() == 0 and u.is_contiguous() and u.numel() == u.untyped_storage().nbytes():
            u.__dict__[TYPED] = t
            return u
    except RuntimeError:  # not viewable flat (strided, a conjugate or negative bit): spanned by set_
        pass
    return as_storage(t)


def _key(lay: Any) -> tuple[Any, ...]:
    return (tuple(lay[0]), tuple(lay[1]), lay[2], lay[3])


def _list(key: Any) -> list[Any]:
    return [list(key[0]), list(key[1]), key[2], key[3]]


__all__ = ["Program", "FastStep", "span", "TYPED"]
