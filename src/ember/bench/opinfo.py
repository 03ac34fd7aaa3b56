"""PyTorch's own OpInfo database run on ``ember`` tensors against local CPU torch.

For each OpInfo of ``torch.testing._internal.common_methods_invocations.op_db`` and each pass,
the op's sample inputs run on CPU and on ``ember`` (the current Ember device: the embedded
peer, or the peer ``--peer`` names); the results *and every input after the call* are compared.
A sample is ``pass`` (equal, or both sides raise), ``error`` (only ember raises: a clean
failure) or ``wrong`` (values differ without an error: the class that must not exist). An op
passes when all its samples pass, and is ``wrong`` when any sample is.

Passes: ``forward`` (float32), ``built`` (samples made on ember itself: views and strides as
torch's generators make them), ``variants`` (method, in-place, ``out=`` with empty outputs,
each also on a non-contiguous copy of the sample), ``grad`` (float64; each floating output
weighted by a fixed tensor before the sum), ``f64`` / ``i64`` / ``bool`` (forward).

**Canary** (``run --canary``): the process runs with glibc's ``malloc.perturb``, so every buffer malloc hands
out is filled with :data:`CANARY_FILL` instead of whatever it held (zeros, when fresh from the system, hide an
output the kernel never wrote). An ember result holding a run of it holds memory no kernel wrote: on a shared
peer, another session's bytes. Such a sample is ``wrong`` ("uninitialised"), whatever CPU torch returned (its
kernel would leave the same bytes unwritten: both sides then agree, and the values compare equal).
"""

from __future__ import annotations

import os
import signal
from typing import Any, Callable, Iterator

import torch
from torch.utils._pytree import tree_flatten, tree_map

PASSES = ("forward", "built", "variants", "grad", "f64", "i64", "bool")
_DTYPE = {"forward": torch.float32, "built": torch.float32, "variants": torch.float32, "grad": torch.float64,
          "f64": torch.float64, "i64": torch.int64, "bool": torch.bool}
_TOL = {torch.float32: (1.3e-5, 1e-4), torch.float64: (1e-7, 1e-7), torch.complex64: (1.3e-5, 1e-4),
        torch.complex128: (1e-7, 1e-7)}
_RANDOM = ("rand", "normal", "bernoulli", "multinomial", "dropout", "uniform", "exponential", "cauchy",
           "geometric", "log_normal", "poisson", "randint", "randperm", "rrelu")


_HOST_ARGS = frozenset({"tensor_split"})
#: glibc's ``malloc.perturb`` byte for a canary run (``GLIBC_TUNABLES=glibc.malloc.perturb=165``): malloc fills
#: what it hands out with its complement, 0x5A.
CANARY_PERTURB = 0xA5
CANARY_FILL = 0xFF ^ CANARY_PERTURB
#: the shortest run of the fill byte taken as unwritten memory (8 bytes: no sample computes that by chance)
CANARY_RUN = 8


def canary_on() -> bool:
    """Whether this process runs under the canary (its malloc fills buffers with :data:`CANARY_FILL`)."""
    return f"glibc.malloc.perturb={CANARY_PERTURB}" in os.environ.get("GLIBC_TUNABLES", "")


def canary_env() -> dict[str, str]:
    """The environment of a process that runs under the canary."""
    tun = os.environ.get("GLIBC_TUNABLES", "")
    return {**os.environ, "GLIBC_TUNABLES": ":".join(x for x in (tun, f"glibc.malloc.perturb={CANARY_PERTURB}") if x)}


def unwritten(x: Any) -> str | None:
    """Where an (ember) result holds a run of :data:`CANARY_RUN` fill bytes (memory no kernel wrote), or None."""
    import numpy as np
    for k, t in enumerate(_leaves(x)):
        if t.layout != torch.strided or not t.numel():
            continue
        flat = torch.empty(t.numel(), dtype=t.dtype)  # (a copy: any strides, expanded ones included)
        flat.copy_(t.detach().cpu().reshape(-1))
        b = flat.view(torch.uint8).numpy()
        n = min(CANARY_RUN, b.size)
        if n < 4:
            continue
        run = np.convolve(b == CANARY_FILL, np.ones(n, np.int32), "valid")
        at = np.flatnonzero(run >= n)
        if at.size:
            return (f"uninitialised memory: result {k} ({tuple(t.shape)} {t.dtype}) holds "
                    f"{int((b == CANARY_FILL).sum())} canary bytes, from byte {int(at[0])}")
    return None


def op_db() -> list[Any]:
    from torch.testing._internal.common_methods_invocations import op_db as db
    return db


def _move(sample: Any, device: str, grad: bool = False) -> Any:
    """The SampleInput with every tensor copied to ``device``, its whole storage and layout kept (so
    ``as_strided``-like ops see the same storage on both sides, and tensors sharing one share it there)."""
    moved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def mv(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        rg, t = grad and t.requires_grad and (t.is_floating_point() or t.is_complex()), t.detach()
        if t.is_conj() or t.is_neg():
            t = t.resolve_conj().resolve_neg()
        src, whole = moved.get(id(t.untyped_storage()), (None, None))
        if whole is None or whole.dtype != t.dtype:
            n = t.untyped_storage().nbytes() // t.element_size()
            whole = torch.as_strided(t, [n], [1], 0).to(device, copy=True)
            moved[id(t.untyped_storage())] = (t, whole)
        out = torch.as_strided(whole, t.shape, t.stride(), t.storage_offset()).detach()
        return out.requires_grad_(rg)
    out = sample.transform(mv)
    if "device" in out.kwargs:  # a factory's own device follows the sample (as the test suite's device does)
        out.kwargs = {**out.kwargs, "device": device}
    return out


def _leaves(x: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]


def _same(a: Any, b: Any, layout_only: bool = False) -> str | None:
    """None when ``a`` (CPU) and ``b`` (ember) hold equal values, else what differs."""
    fa, fb = tree_flatten(a)[0], tree_flatten(b)[0]
    if len(fa) != len(fb):
        return f"{len(fa)} vs {len(fb)} results"
    for x, y in zip(fa, fb):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return f"a {type(x).__name__} vs a {type(y).__name__}"
        if not isinstance(x, torch.Tensor):
            if x != y and not (x != x and y != y):
                return f"{x!r} vs {y!r}"
            continue
        x, y = (t.detach().cpu() if t.device.type == "ember" else t.detach() for t in (x, y))
        if x.shape != y.shape or x.dtype != y.dtype:
            return f"{tuple(x.shape)} {x.dtype} vs {tuple(y.shape)} {y.dtype}"
        if layout_only:  # uninitialised memory (empty*): only the layout is defined
            continue
        rtol, atol = _TOL.get(x.dtype, (0, 0))
        try:
            torch.testing.assert_close(y, x, rtol=rtol, atol=atol, equal_nan=True, check_stride=False)
        except AssertionError as e:
            return str(e).strip().splitlines()[0][:160]
    return None


def _run(fn: Callable[[], Any]) -> tuple[Any, BaseException | None]:
    try:
        return fn(), None
    except Exception as e:  # noqa: BLE001 - any failure of the op is a result here
        return None, e


def compare(call: Callable[[Any], Any], cpu_sample: Any, ember_sample: Any, seed: int = 0,
            layout_only: bool = False) -> tuple[str, str]:
    """Run ``call`` on both samples (same seed); (status, detail) with status pass | error | wrong."""
    torch.manual_seed(seed)
    want, cpu_err = _run(lambda: call(cpu_sample))
    torch.manual_seed(seed)
    got, err = _run(lambda: call(ember_sample))
    if cpu_err is not None:
        return "pass", "both raise" if err is not None else "cpu raises"
    if err is not None:
        return "error", f"{type(err).__name__}: {str(err).strip()[:200]}"
    why = _same(want, got, layout_only)
    if why is None and canary_on():
        why = unwritten(got)
        if why is not None:
            return "wrong", why + (" (CPU torch's result holds it too: its kernel leaves it unwritten)"
                                   if unwritten(want) else "")
    if why is None:
        why = _same(_leaves(cpu_sample), _leaves(ember_sample), layout_only)
        if why is not None:
            why = "an input after the op: " + why
    if why is not None:
        _got, read_err = _run(lambda: [t.cpu() for t in _leaves(got)])
        if read_err is not None:  # the op failed on the peer: the error comes at the read
            return "error", f"{type(read_err).__name__}: {str(read_err).strip()[:200]}"
        return "wrong", why
    return "pass", ""


def _as_call(sample: Any) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    return sample.input, tuple(sample.args), dict(sample.kwargs)


def _calls(op: Any, pass_: str) -> Iterator[tuple[str, Callable[[Any], Any]]]:
    """(variant name, call on a (input, args, kwargs) triple) for the pass."""
    if pass_ != "variants":
        yield "op", lambda s: op(s[0], *s[1], **s[2])
        return
    if op.method_variant is not None:
        yield "method", lambda s: op.method_variant(s[0], *s[1], **s[2])
    if op.inplace_variant is not None:
        yield "inplace", lambda s: op.inplace_variant(_clone(s[0]), *s[1], **s[2])
    if op.supports_out:
        yield "out", lambda s: _with_out(op, s)


def _clone(x: Any) -> Any:
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, x)


def _with_out(op: Any, s: Any) -> Any:
    """``op(..., out=<empty tensors>)``: the outputs sized by the op (the case that resizes)."""
    res = op(s[0], *s[1], **s[2])
    dev = s[2].get("device") or next(iter(_leaves(s[0]) or _leaves(s[1])), torch.empty(0)).device
    out = tree_map(lambda t: torch.empty(0, dtype=t.dtype, device=dev) if isinstance(t, torch.Tensor) else t, res)
    ret = op(s[0], *s[1], out=out, **s[2])
    return ret, out


def _cpu_out_differs(op: Any, sample: Any) -> bool:
    """Whether CPU torch's out= variant disagrees with its own functional call (then no reference exists)."""
    a, b = _as_call(_move(sample, "cpu")), _as_call(_move(sample, "cpu"))
    torch.manual_seed(0)
    want, err = _run(lambda: op(a[0], *a[1], **a[2]))
    torch.manual_seed(0)
    got, err2 = _run(lambda: _with_out(op, b)[1])
    if err is not None or err2 is not None or "empty" in op.name:
        return False
    return _same(want, got) is not None or _same(_leaves(a), _leaves(b)) is not None


def _grad_call(s: Any) -> Any:
    res = s[3](s[0], *s[1], **s[2])
    outs = [t for t in _leaves(res) if t.requires_grad and (t.is_floating_point() or t.is_complex())]
    leaves = [t for t in _leaves((s[0], s[1], s[2])) if t.requires_grad]
    if not outs or not leaves:
        return res
    total = 0
    for k, o in enumerate(outs):
        if o.is_complex():
            o = torch.view_as_real(o)
        g = torch.Generator().manual_seed(k)
        w = torch.rand(o.shape, generator=g, dtype=o.dtype).to(o.device) + 0.5
        total = total + (o * w).sum()
    grads = torch.autograd.grad(total, leaves, allow_unused=True)
    return res, [g if g is not None else torch.zeros_like(t) for g, t in zip(grads, leaves)]  # None: zero


def samples(op: Any, pass_: str, every: bool, device: str = "cpu") -> list[Any]:
    dtype = _DTYPE[pass_]
    grad = pass_ == "grad"
    gen = op.reference_inputs if every else op.sample_inputs
    out = []
    for k, s in enumerate(gen(device, dtype, requires_grad=grad)):
        if not every and k >= 3:
            break
        out.append(s)
    if pass_ == "variants":
        out += [s.noncontiguous() for s in out if isinstance(s.input, torch.Tensor) and s.input.dim() >= 1]
    return out


def applies(op: Any, pass_: str) -> bool:
    """Whether the OpInfo takes part in the pass (its dtypes, autograd support, determinism)."""
    if any(r in op.name for r in _RANDOM):
        return False
    if pass_ == "grad" and not op.supports_autograd:
        return False
    if pass_ == "variants" and op.method_variant is None and op.inplace_variant is None and not op.supports_out:
        return False
    return _DTYPE[pass_] in op.supported_dtypes("cpu")


class _Timeout(Exception):
    pass


def _alarm(_sig: int, _frame: Any) -> None:
    raise _Timeout("the op ran past its time limit")


def run_op(op: Any, pass_: str, every: bool = False, limit_s: int = 60) -> dict[str, Any]:
    """One OpInfo under one pass: {op, pass, status, samples, detail}."""
    row: dict[str, Any] = {"op": op.name + (f".{op.variant_test_name}" if op.variant_test_name else ""),
                           "pass": pass_, "every": every}
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(limit_s)
    try:
        row.update(_run_samples(op, pass_, every))
    except _Timeout as e:
        row.update(status="error", samples=0, detail=str(e))
    except Exception as e:  # noqa: BLE001 - a sample generator that fails on ember counts as an error
        row.update(status="error", samples=0, detail=f"{type(e).__name__}: {str(e)[:200]}")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    return row


def _run_samples(op: Any, pass_: str, every: bool) -> dict[str, Any]:
    status, detail, n = "pass", "", 0
    torch.manual_seed(0)
    try:
        made = samples(op, pass_, every, device="ember" if pass_ == "built" else "cpu")
    except Exception as e:  # noqa: BLE001 - CPU torch's own generator fails: no reference
        if pass_ == "built":
            raise
        return {"status": "n/a", "samples": 0, "detail": f"CPU sample inputs: {type(e).__name__}: {e}"[:200]}
    grad = pass_ == "grad"  # both sides get leaves made the same way (a sample's views of a base are not)
    for s in made:
        for name, call in _calls(op, pass_):
            # fresh copies per call: samples may share tensors that an earlier call changed in place
            cs, es = _move(s, "cpu", grad=grad), _move(s, "ember", grad=grad)
            if op.name in _HOST_ARGS:  # arguments the op takes on CPU whatever the device (as its samples do)
                es.args = cs.args
            c, e = _as_call(cs), _as_call(es)
            if grad:
                st, why = compare(lambda s: _grad_call((*s, op)), c, e)
            elif name == "out" and _cpu_out_differs(op, cs):
                st, why = "pass", "CPU torch's own out= differs from its functional result"
            else:
                st, why = compare(call, c, e, layout_only="empty" in op.name)
            n += 1
            if st == "wrong" or st == "error" and status == "pass":
                status, detail = st, f"{name}: {why}"
            if st == "wrong":
                return {"status": status, "samples": n, "detail": detail}
    return {"status": status, "samples": n, "detail": detail}


__all__ = ["PASSES", "op_db", "run_op", "applies", "compare", "samples", "canary_on", "canary_env", "unwritten",
           "CANARY_FILL"]
