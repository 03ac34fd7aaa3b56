"""A peer never lets operand VALUES (or sizes) that a CPU kernel trusts as memory positions reach the kernel
unchecked (``server/execute/positions.py``): each case below made CPU torch read or write outside a
storage (a crash, a heap corruption, or no error at all) when called directly; on a peer the call is
refused with the operand named, the session carries on, and the legitimate call still equals CPU.

The calls go to the peer as raw ATen ``OP`` messages: ``torch.ops.aten`` on ember tensors sends the
overload as it is (the client's meta kernels check shapes, never values), and where the client's meta kernel
would catch a size first the message's operand layout is edited on its way out, as a hostile client would.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest

torch = pytest.importorskip("torch")

import ember  # noqa: E402
import ember.torch  # noqa: E402
from ember.errors import RemoteExecutionError  # noqa: E402
from ember.protocol.messages import OP  # noqa: E402
from ember.server.execute.positions import CHECKS  # noqa: E402

pytestmark = pytest.mark.timeout(120)
A = torch.ops.aten
E = "ember"
BIG, NEG = 1 << 20, -(1 << 20)


def _e(t: torch.Tensor) -> torch.Tensor:
    return t.to(E)


def _long(shape: Any, v: int) -> torch.Tensor:
    return torch.full(shape, v, dtype=torch.long)


def _pool_calls(v: int) -> list[tuple[str, Callable[[Callable[[torch.Tensor], torch.Tensor]], Any]]]:
    g2, x2, i2 = torch.randn(1, 1, 2, 2), torch.randn(1, 1, 4, 4), _long((1, 1, 2, 2), v)
    g3, x3, i3 = torch.randn(1, 1, 2, 2, 2), torch.randn(1, 1, 4, 4, 4), _long((1, 1, 2, 2, 2), v)
    return [
        ("max_pool2d_with_indices_backward", lambda d: A.max_pool2d_with_indices_backward(
            d(g2), d(x2), [2, 2], [2, 2], [0, 0], [1, 1], False, d(i2))),
        ("max_pool3d_with_indices_backward", lambda d: A.max_pool3d_with_indices_backward(
            d(g3), d(x3), [2, 2, 2], [2, 2, 2], [0, 0, 0], [1, 1, 1], False, d(i3))),
        ("adaptive_max_pool2d_backward", lambda d: A.adaptive_max_pool2d_backward(d(g2), d(x2), d(i2))),
        ("adaptive_max_pool3d_backward", lambda d: A.adaptive_max_pool3d_backward(d(g3), d(x3), d(i3))),
        ("embedding_dense_backward", lambda d: A.embedding_dense_backward(
            d(torch.randn(1, 3)), d(torch.tensor([v])), 4, -1, True)),
        ("_embedding_bag_dense_backward", lambda d: A._embedding_bag_dense_backward(
            d(torch.randn(2, 3)), d(torch.tensor([1, 2, 3])), d(torch.tensor([0, v, 1])), d(torch.tensor([1, 2])),
            d(torch.tensor([0])), 5, False, 0, None, -1)),
        ("_embedding_bag_per_sample_weights_backward", lambda d: A._embedding_bag_per_sample_weights_backward(
            d(torch.randn(2, 3)), d(torch.randn(5, 3)), d(torch.tensor([1, v])), d(torch.tensor([0, 1])),
            d(torch.tensor([0, 1])), 0, -1)),
        ("_embedding_bag", lambda d: A._embedding_bag(
            d(torch.randn(4, 3)), d(torch.tensor([1, 2])), d(torch.tensor([0, v])))),
        ("segment_reduce", lambda d: A.segment_reduce(d(torch.randn(4)), "sum", offsets=d(torch.tensor([0, v])))),
        ("_segment_reduce_backward", lambda d: A._segment_reduce_backward(
            d(torch.randn(2)), d(torch.randn(2)), d(torch.randn(4)), "sum", offsets=d(torch.tensor([0, v, 4])))),
        ("_ctc_loss", lambda d: A._ctc_loss(
            d(torch.randn(5, 1, 3).log_softmax(2)), d(torch.tensor([[v, 1]])), [5], [2])),
        ("fractional_max_pool2d", lambda d: A.fractional_max_pool2d(
            d(torch.randn(1, 1, 4, 4)), [2, 2], [2, 2], d(torch.full((1, 1, 2), float("nan"))))),
    ]


@pytest.mark.parametrize("v", [BIG, NEG])
@pytest.mark.parametrize("k", range(12))
def test_position_operands_out_of_range_are_refused_on_the_peer(k: int, v: int) -> None:
    name, call = _pool_calls(v)[k]
    assert name in CHECKS
    with pytest.raises(RemoteExecutionError, match="refused on the peer"):
        r = call(_e)
        (r[0] if isinstance(r, tuple) else r).cpu()
    assert (torch.arange(3.0, device=E) + 1).tolist() == [1.0, 2.0, 3.0]  # the session carries on


def _edit_layout(operand: int, layout: list[Any]) -> Any:
    """Context: the next OP message's ``operand``-th tensor layout replaced (a hostile client's message)."""
    def edit(kw: dict[str, Any]) -> None:
        kw["l"][operand] = layout
    return edit_next_op(edit)


def edit_next_op(change: Callable[[dict[str, Any]], Any], name: str | None = None, only: str | None = None) -> Any:
    """Context: the next OP message (of an op whose name holds ``only``, if given) has its template (``"a"``,
    ``"l"``, ``"o"``) changed by ``change``, its op renamed to ``name`` if given (a hostile client's message)."""
    class Edit:
        def __enter__(self) -> None:
            self.s = ember.torch.current_device().session
            self.orig = self.s.record

            def record(msg: list[Any]) -> None:
                if msg[0] == OP and isinstance(msg[5], dict) and "l" in msg[5] and self.s.record is record \
                        and (only is None or only in str(msg[1])):
                    msg = [msg[0], name or msg[1], *msg[2:5],
                           {**msg[5], "l": [list(x) for x in msg[5]["l"]], "a": [*msg[5]["a"]]}]
                    change(msg[5])
                    self.s.record = self.orig
                self.orig(msg)
            self.s.record = record

        def __exit__(self, *exc: Any) -> None:
            self.s.record = self.orig
    return Edit()


SIZE_CASES = [  # (call, the operand whose layout shrinks to one element, expected words)
    (lambda: A.native_batch_norm(_e(torch.randn(2, 8)), None, None, _e(torch.zeros(8)), _e(torch.ones(8)),
                                 False, 0.1, 1e-5), 1, "running_mean"),
    (lambda: A._native_batch_norm_legit(_e(torch.randn(2, 8)), _e(torch.ones(8)), None, True, 0.1, 1e-5), 1,
     "weight"),
    (lambda: A._batch_norm_with_update(_e(torch.randn(2, 8)), _e(torch.ones(8)), _e(torch.zeros(8)),
                                       _e(torch.zeros(8)), _e(torch.ones(8)), 0.1, 1e-5), 3, "running_mean"),
    (lambda: A.batch_norm_update_stats(_e(torch.randn(2, 8)), _e(torch.zeros(8)), _e(torch.ones(8)), 0.1), 1,
     "running_mean"),
    (lambda: A.native_layer_norm_backward(_e(torch.randn(2, 8)), _e(torch.randn(2, 8)), [8], _e(torch.zeros(2, 1)),
                                          _e(torch.ones(2, 1)), None, None, [True, False, False]), 2, "mean"),
    (lambda: A._cdist_backward(_e(torch.randn(2, 4)), _e(torch.randn(2, 3)), _e(torch.randn(4, 3)), 2.0,
                               _e(torch.randn(2, 4))), 3, "cdist"),
    (lambda: A._adaptive_avg_pool2d_backward(_e(torch.randn(4, 3, 2, 2)), _e(torch.randn(4, 3, 4, 4))), 1,
     "grad_output"),
    (lambda: A.grid_sampler_2d_backward(_e(torch.randn(2, 3, 8, 8)), _e(torch.randn(2, 3, 8, 8)),
                                        _e(torch.rand(2, 8, 8, 2) * 2 - 1), 0, 0, False, [True, True]), 0,
     "grad_output"),
    (lambda: A._log_softmax_backward_data(_e(torch.randn(8, 8)), _e(torch.randn(8, 8)), 1, torch.float32), 0,
     "grad_output"),
    (lambda: A.multi_margin_loss_backward(_e(torch.randn(8)), _e(torch.randn(8, 3)), _e(torch.zeros(8, dtype=torch.long)),
                                          1, 1, None, 0), 0, "grad_output"),
    (lambda: A._weight_norm_interface_backward(_e(torch.randn(4, 3)), _e(torch.randn(4, 3)), _e(torch.randn(4, 1)),
                                               _e(torch.rand(4, 1) + 1), 0), 3, "saved_norms"),
]


@pytest.mark.parametrize("k", range(len(SIZE_CASES)))
def test_per_channel_operands_of_the_wrong_size_are_refused_on_the_peer(k: int) -> None:
    call, operand, word = SIZE_CASES[k]
    with _edit_layout(operand, [[1], [1], 0, "float32"]):
        with pytest.raises(RemoteExecutionError, match=f"{word}.*refused on the peer"):
            r = call()
            (r[0] if isinstance(r, tuple) else r).cpu()
    assert (torch.arange(3.0, device=E) * 2).tolist() == [0.0, 2.0, 4.0]


def test_legitimate_position_ops_still_equal_cpu() -> None:
    """The checks pass what torch itself sends: pooling, embedding (bag), CTC, norms and their gradients."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    ids = torch.tensor([[1, 2, 0, 5], [4, 3, 2, 9]])
    emb = torch.nn.Embedding(10, 4, padding_idx=0, scale_grad_by_freq=True).double()
    bag = torch.nn.EmbeddingBag(10, 4, mode="max").double()
    bn = torch.nn.BatchNorm2d(3).double()
    lp = torch.randn(6, 2, 5, dtype=torch.float64).log_softmax(2)
    tg = torch.tensor([[1, 2, 0], [3, 4, 4]])  # a padded row: values past its length are not read

    def run(d: str) -> list[torch.Tensor]:
        xd = x.detach().clone().to(d).requires_grad_()
        lpd = lp.detach().clone().to(d).requires_grad_()
        e, b, n = (m.to(d) if d == E else m for m in (emb, bag, bn))
        outs = [torch.nn.functional.max_pool2d(xd, 2).sum(), torch.nn.functional.adaptive_max_pool2d(xd, 3).sum(),
                e(ids.to(d)).sum(), b(ids.to(d)).sum(), n(xd).square().sum(),
                torch.nn.functional.layer_norm(xd, [8]).square().sum(),
                torch.nn.functional.ctc_loss(lpd, tg.to(d), [6, 5], [2, 3])]
        sum(outs).backward()
        grads = [xd.grad, lpd.grad, e.weight.grad, b.weight.grad, n.weight.grad]
        for m in (e, b, n):
            m.zero_grad()
        return [t.detach().cpu() for t in (*outs, *grads)]

    want, got = run("cpu"), run(E)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w)


def test_ctc_backward_input_lengths_past_the_input_are_refused() -> None:
    lp = torch.randn(5, 1, 3).log_softmax(2)
    args = (lp, torch.tensor([[1, 2]]), torch.tensor([5]), torch.tensor([2]))
    nll, alpha = A._ctc_loss(*args)
    with pytest.raises(RemoteExecutionError, match="input_lengths.*refused on the peer"):
        A._ctc_loss_backward(_e(torch.ones(1)), _e(lp), _e(args[1]), _e(torch.tensor([BIG])), _e(args[3]), _e(nll),
                             _e(alpha), 0, False).cpu()


def test_the_position_fuzzer_finds_nothing_unchecked(capsys: Any) -> None:
    """``bench/bench_aten_positions.py`` over the ops that once reached outside memory: every mutated call is
    refused by the peer's check or by the kernel itself."""
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).parents[1] / "bench" / "bench_aten_positions.py"
    spec = importlib.util.spec_from_file_location("bench_aten_positions", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rc = mod.main(["--ops", "nn.functional.max_pool2d,nn.functional.embedding_bag,nn.functional.ctc_loss,"
                   "nn.functional.adaptive_avg_pool2d,segment_reduce", "--sizes", "--limit", "1"])
    out = capsys.readouterr().out
    assert rc == 0 and "UNSAFE" not in out and "refused" in out, out[-2000:]


def test_a_composite_named_directly_is_refused_on_the_peer() -> None:
    """``embedding_backward`` is CompositeImplicitAutograd: torch never sends it (its parts come instead, each
    checked); named in a raw message, the peer refuses it rather than run its inner kernels unchecked."""
    from ember.server.execute.aten import refusal
    assert "composite" in (refusal("aten.batch_norm.default") or "")
    assert refusal("aten.native_batch_norm.default") is None and refusal("aten.conj_physical.default") is None
    with edit_next_op(lambda kw: kw["a"].append(False), name="aten.embedding_backward.default"):
        with pytest.raises(RemoteExecutionError, match="composite"):
            A.embedding_dense_backward(_e(torch.randn(1, 3)), _e(torch.tensor([BIG])), 4, -1, True).cpu()
    assert (torch.arange(3.0, device=E) - 1).tolist() == [-1.0, 0.0, 1.0]


@pytest.mark.parametrize("k", [0, 4, 8])  # max-pool backward, embedding backward, segment_reduce
def test_position_operands_are_checked_in_a_replayed_graph_too(k: int) -> None:
    """A replayed graph runs its steps on the peer's fast path (server/execute/program.py): the position checks
    hold there as for an op sent alone. The call is captured (one REPLAY a call), then handed bad positions."""
    from ember.torch import _capture as C

    def operands(v: int) -> tuple[Callable[..., Any], list[torch.Tensor]]:
        name, call = _pool_calls(v)[k]
        ins: list[torch.Tensor] = []
        try:  # the CPU operands, in the order the call takes them (run on meta: nothing reads their values)
            call(lambda t: ins.append(t) or t.to("meta"))
        except (RuntimeError, NotImplementedError):
            pass
        return call, ins

    def first(r: Any) -> torch.Tensor:
        return r[0] if isinstance(r, tuple) else r

    call, good = operands(0)
    _, bad = operands(BIG)

    def run(*ts: torch.Tensor) -> Any:
        it = iter(ts)
        return call(lambda _t: next(it))
    step = ember.torch.capture(run)
    replays = C.stats["replays"]
    want = first(run(*good))
    for _ in range(4):
        assert torch.equal(first(step(*[_e(t) for t in good])).cpu(), want)
    assert C.stats["replays"] > replays, "the call never replayed"
    with pytest.raises(RemoteExecutionError, match="refused on the peer"):
        first(step(*[_e(t) for t in bad])).cpu()
    assert C.stats["replays"] > replays + 1  # (refused inside a replay, not by an eager fallback)
    assert (torch.arange(3.0, device=E) + 1).tolist() == [1.0, 2.0, 3.0]  # the session carries on


@pytest.mark.parametrize("offs", [[3, 7, 9], [8, 2, 10], [-4, 7, 10], [3, 7, 1000], []])
def test_grouped_mm_offsets_that_leave_output_rows_unwritten_are_refused(offs: list[int]) -> None:
    """``_grouped_mm`` leaves the output rows no group covers as allocated: uninitialized memory, maybe another
    session's freed bytes (found running Hugging Face's Mixtral on ember). Offsets that do not partition the
    grouped dimension are refused on the peer; the session carries on."""
    a, b = torch.randn(10, 8), torch.randn(3 if offs else 0, 8, 8)
    o = torch.tensor(offs, dtype=torch.int32)
    with pytest.raises(RemoteExecutionError, match="refused on the peer"):
        A._grouped_mm(_e(a), _e(b), offs=_e(o)).cpu()
    assert (torch.arange(3.0, device=E) + 1).tolist() == [1.0, 2.0, 3.0]


@pytest.mark.parametrize("offs", [[3, 7, 10], [0, 0, 10], [3, 3, 10], [10, 10, 10]])
def test_grouped_mm_in_float32_runs_on_a_cpu_peer_as_on_cpu(offs: list[int]) -> None:
    """Float32 grouped matmuls (torch's meta kernel allows bfloat16 only, CUDA's rule; the CPU kernel takes
    float32), empty groups included: equal to local CPU, forward and backward (a 2D x 2D grouped matmul)."""
    torch.manual_seed(0)
    a, b, o = torch.randn(10, 8), torch.randn(3, 8, 8), torch.tensor(offs, dtype=torch.int32)

    def run(d: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
        x, w = d(a).requires_grad_(), d(b).requires_grad_()
        y = torch._grouped_mm(x, w, offs=d(o))
        y.pow(2).sum().backward()
        return [t.cpu() for t in (y.detach(), x.grad, w.grad)]
    for p, q in zip(run(lambda t: t.clone()), run(_e)):
        assert torch.equal(p, q)


def test_integer_histc_runs_on_a_cpu_peer_as_cuda_runs_it() -> None:
    """CUDA's ``histc`` takes integer tensors (Hugging Face's MoE counts tokens per expert so on any device but
    CPU and MPS); the CPU kernel does not. A CPU peer counts them on a float64 copy: CUDA's bins, its dtype."""
    x = torch.tensor([0, 1, 1, 3, 2, 3, 3, 7, -1], dtype=torch.int32)
    got = torch.histc(_e(x), bins=4, min=0, max=3).cpu()
    assert got.dtype == torch.int32 and got.tolist() == [1, 2, 1, 3]
    with pytest.raises(RuntimeError):  # (local CPU still refuses it: nothing changed for the user's own tensors)
        torch.histc(x, bins=4, min=0, max=3)


@pytest.mark.parametrize("offsets,rows", [([1, 2], 2), ([0, 1, 2], 2), ([], 2)],
                         ids=["first-offset-not-0", "more-bags-than-gradient-rows", "no-offsets"])
def test_an_empty_offset2bag_is_rebuilt_from_the_offsets_and_checked(offsets: list[int], rows: int) -> None:
    """CPU's ``sum`` mode leaves ``offset2bag`` empty and the per-sample-weights backward rebuilds it from the offsets:
    a bag of -1 (offsets not starting at 0) or past the gradient's rows would read outside it. The peer rebuilds it
    as the kernel does and checks it; a well-formed empty one passes and equals the full one. The dense backward has
    no offsets to rebuild it from: an empty one is refused there."""
    g, w, idx = torch.randn(rows, 3), torch.randn(5, 3), torch.tensor([1, 2, 3])
    empty = torch.empty(0, dtype=torch.long)

    def call(d: Callable[[torch.Tensor], torch.Tensor], off: list[int], o2b: torch.Tensor) -> Any:
        return A._embedding_bag_per_sample_weights_backward(d(g), d(w), d(idx), d(torch.tensor(off, dtype=torch.long)),
                                                            d(o2b), 0, -1)
    with pytest.raises(RemoteExecutionError, match="refused on the peer"):
        call(_e, offsets, empty).cpu()
    assert torch.equal(call(_e, [0, 1], empty).cpu(), call(lambda t: t, [0, 1], torch.tensor([0, 1, 1])))
    with pytest.raises(RemoteExecutionError, match="refused on the peer"):
        A._embedding_bag_dense_backward(_e(g), _e(idx), _e(empty), _e(torch.tensor([1, 2])), _e(torch.tensor([0])),
                                        5, False, 0, None, -1).cpu()


def _fused_call(kind: str, big: int, small: int) -> Callable[[Callable[[torch.Tensor], torch.Tensor]], Any]:
    """A fused optimizer step whose parameter has ``big`` elements and one state tensor ``small``."""
    def call(d: Callable[[torch.Tensor], torch.Tensor]) -> Any:
        gen = torch.Generator().manual_seed(0)
        p, g, s = ([d(torch.rand(n, generator=gen))] for n in (big, small, big))
        steps = [d(torch.ones(()))]
        if kind == "adam":
            A._fused_adam_.default(p, g, s, s, [], steps, lr=0.1, beta1=0.9, beta2=0.99, weight_decay=0.0,
                                   eps=1e-8, amsgrad=False, maximize=False)
        elif kind == "adamw-lr":
            A._fused_adamw_.tensor_lr(p, s, g, s, [], steps, lr=d(torch.tensor(0.1)), beta1=0.9, beta2=0.99,
                                      weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)
        elif kind == "sgd":
            A._fused_sgd_.default(p, s, g, weight_decay=0.0, momentum=0.9, lr=0.1, dampening=0.0,
                                  nesterov=False, maximize=False, is_first_step=False)
        else:
            A._fused_adagrad_.default(p, g, s, steps, lr=0.1, lr_decay=0.0, weight_decay=0.0, eps=1e-8,
                                      maximize=False)
        return p[0]
    return call


@pytest.mark.parametrize("kind", ["adam", "adamw-lr", "sgd", "adagrad"])
def test_a_fused_optimizer_step_with_a_state_smaller_than_its_parameter_is_refused(kind: str) -> None:
    """CPU's fused optimizer kernels read and write each state tensor over its parameter's ``numel`` from its data
    pointer, checking only the lists' lengths: a gradient of 3 elements for a parameter of 10^6 crashed the process
    (and would touch other sessions' memory on a peer). The peer checks every tensor's extent first; the session and
    the peer carry on, and a well-formed step runs bit-equal to CPU."""
    with pytest.raises(RemoteExecutionError, match="refused on the peer"):
        _fused_call(kind, 1 << 20, 3)(_e).cpu()  # (the step writes its operands: reading one reports the refusal)
    assert (torch.arange(3.0, device=E) + 1).tolist() == [1.0, 2.0, 3.0]
    want = _fused_call(kind, 5, 5)(lambda t: t.clone())
    assert torch.equal(_fused_call(kind, 5, 5)(_e).cpu(), want)


def test_the_fake_quantize_observer_is_refused() -> None:
    from ember.protocol import aten as PA
    assert PA.DENY.search("_fused_moving_avg_obs_fq_helper")
