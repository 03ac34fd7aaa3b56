"""A bound ATen call made once as a small Python function: the fast steps of a graph's program
(:mod:`.program`) and the eager plans (:mod:`.eager`) call their overload's C++ handle through it.

:func:`_maker` generates, per call shape, ``f(V)`` (or ``f(V, S)``: scalars given per call) that takes its
operands from a register file; :func:`_slot` says what each bound argument becomes; :func:`_scalar_count`
how many scalars a template takes; :func:`_layouts_pass` whether a checked op's step may run unchecked.
"""

from __future__ import annotations

import keyword
from typing import Any, Callable

_MISS = object()  # a fast step's operand is not available as a typed tensor: run the generic step
_MAKERS: dict[str, Any] = {}  # compiled step makers, by generated source (shared by all programs)


def _maker(plan: list[Any], kwplan: dict[str, Any], op: Any, draw: Any, baked: list[Any] | None,
           n_ops: int, check: Any = None) -> Callable[[list[int]], Any]:
    """A maker of a step's function ``f(V)`` (or ``f(V, S)``: scalars given per call) from its typed
    registers; with ``check`` (an op's position check, :mod:`.positions`), ``check(args, kwargs)`` runs on
    the bound call before the kernel, at every call. The source names only generated identifiers; every
    value is passed in, never printed."""
    consts: list[Any] = []

    def expr(p: tuple[str, Any]) -> str:
        kind, x = p
        if kind == "t":
            return f"a{x}"
        if kind == "s":
            return f"s{x}" if baked is not None else f"S[{x}]"
        if kind == "l":
            return "[" + "".join(expr(q) + ", " for q in x) + "]"
        consts.append(x)
        return f"c{len(consts) - 1}"

    pos = [expr(p) for p in plan]
    named = [(n, expr(p)) for n, p in kwplan.items()]
    args = "[" + ", ".join(pos) + "]"  # (the bound call as lists, for a check or a draw)
    kwargs = "{" + ", ".join(f"{n!r}: {e}" for n, e in named) + "}"
    checked = []
    if check is not None:  # the bound call checked, then made from the same lists
        checked = [f"        A = {args}", f"        K = {kwargs}", "        check(A, K)"]
        call = "draw(A, K)" if draw is not None else "op(*A, **K)"
    elif draw is not None:
        call = f"draw({args}, {kwargs})"
    else:
        plain = [f"{n}={e}" for n, e in named if n.isidentifier() and not keyword.iskeyword(n)]
        odd = [f"{n!r}: {e}" for n, e in named if not (n.isidentifier() and not keyword.iskeyword(n))]
        call = "op(" + ", ".join(pos + plain + (["**{" + ", ".join(odd) + "}"] if odd else [])) + ")"
    n_s = len(baked) if baked is not None else 0
    params = ", ".join(["op", "draw", "MISS", "check"] + [f"t{j}" for j in range(n_ops)]
                       + [f"c{j}" for j in range(len(consts))] + [f"s{j}" for j in range(n_s)])
    lines = [f"def make({params}):", "    def f(V" + (", S" if baked is None else "") + "):"]
    lines += [f"        a{j} = V[t{j}]" for j in range(n_ops)]
    if n_ops:
        lines.append("        if " + " or ".join(f"a{j} is None" for j in range(n_ops)) + ":")
        lines.append("            return MISS")
    lines += checked + [f"        return {call}", "    return f"]
    src = "\n".join(lines) + "\n"
    make = _MAKERS.get(src)
    if make is None:
        ns: dict[str, Any] = {}
        exec(compile(src, "<ember program step>", "exec"), ns)  # noqa: S102 - generated from identifiers only
        make = ns["make"]
        if len(_MAKERS) < 1 << 14:
            _MAKERS[src] = make
    tail = consts + list(baked or ())
    return lambda trs: make(op, draw, _MISS, check, *trs, *tail)


def _layouts_pass(fn: Any, a: list[Any], lays: list[Any], aten: Any, torch: Any) -> bool:
    """May a step of checked op ``fn`` run as a fast step (unchecked at replay)? Only when its check reads
    the operands' layouts and literals alone (``positions.LAYOUT_CHECKS``: every replay binds the same layouts,
    and a scalar a replay overrides is no input to it), and the check passes here, once, on meta tensors in
    those layouts."""
    if fn.base not in aten.positions.LAYOUT_CHECKS:
        return False
    try:
        meta = torch.device("meta")
        metas = [aten.operand(torch.empty(aten.A.layout_extent(lay, aten.ITEMSIZE), dtype=torch.uint8, device=meta),
                              lay, meta) for lay in lays]  # (each layout over a storage that just holds it)
        args, kwargs, _ = fn._bind(a, metas, [0.0] * _scalar_count(fn, a, aten.A))  # (markers: never read)
        fn.check(args, kwargs)
    except Exception:  # noqa: BLE001 - refused (or malformed): the generic step runs the check and says why
        return False
    return True


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


__all__ = ["_maker", "_slot", "_scalar_count", "_layouts_pass"]
