"""List the internal ATen ops (``_...``) that torch's public Python API sends a device's kernel: the allowlist a peer
runs (``src/ember/protocol/aten_internal_ops.txt``, read by ``protocol/aten.internal_ops``).

A dispatch mode sits where a PrivateUse1 kernel sees calls (below autograd, after CompositeImplicitAutograd
decompositions) while torch's own test databases run on CPU: every OpInfo (forward, backward, double backward, a few
dtypes), every ModuleInfo (train and eval), every optimizer (foreach, fused, for-loop), and the fused paths those miss
(attention's inference fast paths, RNNs packed and not, interpolation's modes). Where an op has a
CompositeExplicitAutograd kernel, ember's device runs that kernel and sees its inner calls: the mode runs it too. Only
ops the client can send are listed (``_sendable``): a composite it runs itself is never a message, and named in a
crafted one would run on the peer with arguments no caller checked (``_pack_padded_sequence`` allocates
``lengths[0]`` entries as given).

    python bench/list_aten_ops.py            # what the databases reach that the list lacks, and the reverse
    python bench/list_aten_ops.py --write --also RECORDED...   # add what is reached or recorded to the list

The list only grows by ``--write``: an op leaves it by hand (an op torch stops sending, one found unsafe).

``--also``: files of ``aten.<op>.<overload>`` names the client met (recorded over the test suite and sweeps of real
code: names in ``ember.torch._schema._infos`` at exit), which the databases do not reach (ember.torch's own paths).
"""

from __future__ import annotations

import argparse
import itertools
import os
import signal
import warnings
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from ember.protocol.aten import DENY

LIST = os.path.join(os.path.dirname(__file__), "..", "src", "ember", "protocol", "aten_internal_ops.txt")
SEEN: set[str] = set()
_CEA = torch._C.DispatchKey.CompositeExplicitAutograd


def _sendable() -> set[str]:
    """The ops ember.torch can send (by name): an overload that reaches its device's kernel (a backend kernel, no
    composite one: a composite runs on the client, and a device sees its parts) or that it claims
    (``_device._claimed_overloads``), and the composites the peer knows the client sends (``_IMPLICIT_SENT``)."""
    from ember.server.execute.aten import _IMPLICIT_SENT
    from ember.torch._device import _claimed_overloads
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    claimed = set(_claimed_overloads())
    out = set(_IMPLICIT_SENT)
    for name in torch._C._dispatch_get_all_op_names():
        if name.startswith("aten::") and (name in claimed or not has(name, "CompositeImplicitAutograd") and not has(
                name, "CompositeExplicitAutograd") and any(has(name, k) for k in ("CPU", "CUDA", _NONFUNCTIONAL))):
            out.add(name[len("aten::"):].split(".")[0])
    return out


_NONFUNCTIONAL = "CompositeExplicitAutogradNonFunctional"


def _internal(base: str) -> bool:
    """An internal op the list may hold: named ``_...`` (not ``__...__``), and not refused by name anyway."""
    return base[:1] == "_" and base[1:2] != "_" and not DENY.search(base) and not any(
        w in base for w in ("sparse", "_nested", "quantiz"))


class Record(TorchDispatchMode):
    """Records every ATen op it sees; decomposes a CompositeImplicitAutograd op and runs a CompositeExplicitAutograd
    kernel itself, so that their inner calls count (a device kernel sees those, not the op)."""

    def __init__(self) -> None:
        super().__init__()
        self.inside: list[Any] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace == "aten":
            SEEN.add(func._schema.name.split("::")[1])
        has = torch._C._dispatch_has_kernel_for_dispatch_key
        name = func.name()
        implicit, explicit = has(name, "CompositeImplicitAutograd"), has(name, "CompositeExplicitAutograd")
        if func not in self.inside and (implicit or explicit):
            self.inside.append(func)
            try:
                with self:
                    r = func.decompose(*args, **kwargs) if implicit else func._op_dk(_CEA, *args, **kwargs)
                    if r is not NotImplemented:
                        return r
            except Exception:  # noqa: BLE001 - a composite that wants a real device: the kernel itself, below
                pass
            finally:
                self.inside.pop()
        return func(*args, **kwargs)


def _grads(out: Any, inputs: list[torch.Tensor], twice: bool = False) -> None:
    outs = [o for o in tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]
    ins = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    if not outs or not ins:
        return
    total = sum((o.abs() if o.is_complex() else o).sum() for o in outs)
    g = torch.autograd.grad(total, ins, allow_unused=True, create_graph=twice)
    if twice:
        _grads([x for x in g if x is not None], ins)


def _copy(x: Any) -> Any:
    return x.detach().clone() if isinstance(x, torch.Tensor) else x


class _Late(Exception):
    pass


def _guarded(fn: Any, seconds: int = 30) -> None:
    """``fn()`` under the mode; anything it raises (CPU refuses many samples) or a run past ``seconds`` ends it."""
    def late(*_a: Any) -> None:
        raise _Late
    signal.signal(signal.SIGALRM, late)
    signal.alarm(seconds)
    try:
        with Record():
            fn()
    except Exception:  # noqa: BLE001
        pass
    finally:
        signal.alarm(0)


def opinfos() -> None:
    from torch.testing._internal import common_methods_invocations as db
    op_db = [*db.op_db, *db.foreach_unary_op_db, *db.foreach_binary_op_db, *db.foreach_pointwise_op_db,
             *db.foreach_reduce_op_db, *db.foreach_other_op_db]
    plan = [(torch.float32, 30, True), (torch.float64, 3, True), (torch.complex64, 3, True), (torch.int64, 3, False),
            (torch.bool, 2, False), (torch.bfloat16, 2, False), (torch.float16, 2, False), (torch.uint8, 1, False)]
    for op in op_db:
        for dtype, n, grad in plan:
            if dtype not in op.supported_dtypes("cpu"):
                continue
            rg = grad and op.supports_autograd and dtype in op.supported_backward_dtypes("cpu")

            def run(op: Any = op, dtype: Any = dtype, n: int = n, rg: bool = rg) -> None:
                samples = op.reference_inputs if dtype is torch.float32 else op.sample_inputs
                for s in itertools.islice(samples("cpu", dtype, requires_grad=rg), n):
                    ins = [t for t in tree_leaves((s.input, s.args, s.kwargs)) if isinstance(t, torch.Tensor)]
                    try:
                        _grads(op(s.input, *s.args, **s.kwargs), ins, twice=rg and op.supports_gradgrad)
                    except _Late:
                        raise
                    except Exception:  # noqa: BLE001 - the next sample
                        pass
                    with torch.no_grad():
                        for variant in (op, op.inplace_variant):
                            try:  # (in place on a copy: the optimizers' ``_foreach_sqrt_``...)
                                if variant is not None:
                                    variant(tree_map(_copy, s.input), *s.args, **s.kwargs)
                            except _Late:
                                raise
                            except Exception:  # noqa: BLE001
                                pass
            _guarded(run)


def modules() -> None:
    from torch.testing._internal.common_modules import module_db
    for mi in module_db:
        for training in (True, False):
            def run(mi: Any = mi, training: bool = training) -> None:
                for mo in mi.module_inputs_func(mi, device="cpu", dtype=torch.float32, requires_grad=True,
                                                training=training)[:4]:
                    if mo.forward_input is None:
                        continue
                    m = mi.module_cls(*mo.constructor_input.args, **mo.constructor_input.kwargs).train(training)
                    fi = mo.forward_input
                    with torch.no_grad() if not training else torch.enable_grad():
                        out = m(*fi.args, **fi.kwargs)
                    if training:
                        _grads(out, [*tree_leaves((fi.args, fi.kwargs)), *m.parameters()])
            _guarded(run)


def optimizers() -> None:
    names = ["SGD", "Adam", "AdamW", "Adamax", "Adadelta", "Adagrad", "ASGD", "NAdam", "RAdam", "RMSprop", "Rprop"]
    for name, how in itertools.product(names, ({"foreach": True}, {"foreach": False}, {"fused": True})):
        def run(name: str = name, how: dict[str, Any] = how) -> None:
            ps = [torch.randn(4, 3, requires_grad=True), torch.randn(3, requires_grad=True)]
            extra = {"momentum": 0.9} if name in ("SGD", "RMSprop") else {"amsgrad": True} if "Adam" in name else {}
            o = getattr(torch.optim, name)(ps, lr=0.01, weight_decay=0.1, **extra, **how)
            for _ in range(2):
                o.zero_grad()
                sum(p.pow(2).sum() for p in ps).backward()
                o.step()
        _guarded(run)


def distributions() -> None:
    """Sampling (``rsample`` where it exists), ``log_prob`` and its gradient, of the common distributions."""
    D = torch.distributions
    v = torch.rand(3, requires_grad=True)
    pos, prob = (v + 0.5), v.sigmoid()
    cov = torch.eye(3) * 2
    made = [lambda: D.Normal(v, pos), lambda: D.Bernoulli(probs=prob), lambda: D.Categorical(probs=prob),
            lambda: D.Beta(pos, pos), lambda: D.Gamma(pos, pos), lambda: D.Dirichlet(pos), lambda: D.StudentT(pos),
            lambda: D.Chi2(pos), lambda: D.Poisson(pos), lambda: D.Binomial(5, prob), lambda: D.Exponential(pos),
            lambda: D.Laplace(v, pos), lambda: D.Cauchy(v, pos), lambda: D.Gumbel(v, pos), lambda: D.Uniform(v, v + 1),
            lambda: D.LogNormal(v, pos), lambda: D.MultivariateNormal(v, cov), lambda: D.LKJCholesky(3, 0.5),
            lambda: D.VonMises(v, pos), lambda: D.Geometric(prob), lambda: D.RelaxedBernoulli(pos, probs=prob),
            lambda: D.Multinomial(4, prob), lambda: D.Kumaraswamy(pos, pos), lambda: D.Weibull(pos, pos)]
    for make in made:
        def run(make: Any = make) -> None:
            d = make()
            x = d.rsample() if d.has_rsample else d.sample()
            _grads(d.log_prob(x), [v])
            _grads(d.entropy(), [v])
        _guarded(run)


def fused_paths() -> None:
    """What the databases miss: attention's and RNNs' fused paths, interpolation's modes."""
    q = torch.randn(2, 4, 6, 8, requires_grad=True)
    runs = [lambda: _grads(torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True), [q]),
            lambda: _grads(torch.nn.functional.scaled_dot_product_attention(q, q, q, torch.ones(6, 6).bool()), [q])]
    for layer in (torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True),
                  torch.nn.TransformerDecoderLayer(8, 2, 16, batch_first=True)):
        x = torch.randn(2, 5, 8)
        args = (x,) if isinstance(layer, torch.nn.TransformerEncoderLayer) else (x, x)
        runs += [lambda layer=layer, args=args: _grads(layer.train()(*args), list(layer.parameters())),
                 lambda layer=layer, args=args: torch.no_grad()(layer.eval())(*args)]
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True).eval()
    runs.append(lambda: torch.no_grad()(mha)(*[torch.randn(2, 5, 8)] * 3, need_weights=False))
    lin = torch.nn.utils.weight_norm(torch.nn.Linear(3, 4))
    runs.append(lambda: _grads(lin(torch.randn(2, 3)), list(lin.parameters())))
    scaler = torch.amp.GradScaler("cpu")
    runs.append(lambda: scaler.unscale_(torch.optim.SGD([torch.ones(2, requires_grad=True)], lr=0.1)))
    for cell in (torch.nn.LSTM, torch.nn.GRU, torch.nn.RNN):
        for bi in (False, True):
            rnn = cell(4, 5, 2, batch_first=True, bidirectional=bi)
            x = torch.randn(3, 6, 4, requires_grad=True)
            packed = torch.nn.utils.rnn.pack_padded_sequence(x, [6, 4, 2], batch_first=True)
            runs += [lambda rnn=rnn, x=x: _grads(rnn(x)[0], [x, *rnn.parameters()]),
                     lambda rnn=rnn, p=packed: _grads(torch.nn.utils.rnn.pad_packed_sequence(rnn(p)[0])[0],
                                                      list(rnn.parameters()))]
    for cell in (torch.nn.LSTMCell, torch.nn.GRUCell, torch.nn.RNNCell):
        c = cell(4, 5)
        runs.append(lambda c=c: _grads(c(torch.randn(3, 4)), list(c.parameters())))
    img = torch.randn(1, 2, 6, 6, requires_grad=True)
    for mode, aa in (("nearest", False), ("nearest-exact", False), ("bilinear", False), ("bilinear", True),
                     ("bicubic", False), ("bicubic", True), ("area", False), ("lanczos", True)):
        runs.append(lambda mode=mode, aa=aa: _grads(torch.nn.functional.interpolate(
            img, scale_factor=1.5, mode=mode, **({"antialias": True} if aa else {})), [img]))
    for run in runs:
        _guarded(run)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="add what is reached or recorded to the list")
    ap.add_argument("--also", nargs="*", default=[], help="files of recorded aten.<op>.<overload> names to add")
    a = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    for section in (opinfos, modules, optimizers, distributions, fused_paths):
        section()
    sendable = _sendable()
    reached = {b for b in SEEN if _internal(b) and b in sendable}
    for path in a.also:
        reached |= {w.split(".")[1] for w in open(path).read().split() if w.startswith("aten.") and
                    _internal(w.split(".")[1])}
    lines = open(LIST).read().splitlines()
    header = [x for x in lines if x.startswith("#")]
    listed = {x.strip() for x in lines if x.strip() and not x.startswith("#")}
    unsendable = sorted(b for b in listed if b not in sendable)
    listed = {b for b in listed if _internal(b) and b in sendable}  # (what DENY refuses anyway leaves the list,
    #                                                                  and what the client cannot send)
    print(f"reached: {len(reached)} internal ops; listed: {len(listed)}")
    print("reached, not listed:", " ".join(sorted(reached - listed)) or "none")
    print("listed, not reached (ember.torch's own, or recorded):", " ".join(sorted(listed - reached)) or "none")
    print("listed, but ember.torch cannot send them (--write drops them):", " ".join(unsendable) or "none")
    if a.write:
        with open(LIST, "w") as f:
            f.write("\n".join([*header, *sorted(listed | reached)]) + "\n")
        print(f"wrote {os.path.normpath(LIST)}")


if __name__ == "__main__":
    main()
