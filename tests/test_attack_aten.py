"""ATen messages a hostile client crafts, each found by a sweep that attacked a live peer: one message that killed the
peer (internal kernels that trust their arguments), a view in disguise that read other sessions' memory, a shrunken
result whose storage held freed bytes, a layout that kept a core busy for ever, and a broadcast that blew past the
budgets on the network loop. Each is refused or bounded now; a bystander session stays right."""

from __future__ import annotations

import time
from typing import Any, Iterator

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ember  # noqa: E402
import ember.array_api as xp  # noqa: E402
from ember.array_api._array import RemoteArray  # noqa: E402
from ember.errors import EmberError  # noqa: E402
from ember.protocol import messages as m  # noqa: E402
from ember.server import Server  # noqa: E402

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def peer() -> Iterator[Server]:
    srv = Server(["torch:cpu"], memory_limit="128MiB", session_memory="32MiB")
    srv.listen_websocket("127.0.0.1", 0)
    srv.start_in_thread()
    yield srv
    srv.close()


def contig(shape: list[int], dtype: str) -> list:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= n
    return [list(shape), stride[::-1], 0, dtype]


def attack(srv: Server, allocs: list[int], name: str, a: list, layouts: list, specs: list | None,
           scalars: list | None = None) -> EmberError | None:
    """Storages of ``allocs`` bytes, then one ``name`` call on them; what reading its first output (or, with none,
    its second operand: what it writes) raises, None if it ran. A bystander session on its own connection must be
    served before and after."""
    bystander = ember.connect(srv.addresses[0])
    held = xp.arange(5.0, device=bystander)
    d = ember.connect(srv.addresses[0])
    s = d.session
    ids = [next(s.ids) for _ in allocs]
    for tid, n in zip(ids, allocs):
        s.record([m.OP, "torch.alloc", [], 0, [tid], {"n": n}])
    outs = [next(s.ids) for _ in range(len(specs) if specs is not None else 4)]
    s.record([m.OP, name, [scalars or [], *ids[:len(layouts)]], 1, outs, {"a": a, "l": layouts, "o": specs}])
    try:
        RemoteArray(outs[0] if outs else ids[1], (1,), xp.uint8, d, s).to_numpy()
        err = None
    except EmberError as e:
        err = e
    assert float(xp.sum(held)) == 10.0 and float(xp.sum(xp.arange(4.0, device=bystander))) == 6.0
    d.close()
    bystander.close()
    return err


def leave_a_secret(srv: Server, n: int) -> None:
    """A victim session that leaves ``n`` x ``SECRET!!`` in memory the peer freed when it closed."""
    victim = ember.connect(srv.addresses[0])
    secret = xp.asarray(np.frombuffer(b"SECRET!!" * n, dtype=np.uint8).copy(), device=victim)
    (secret + 0).to_numpy()
    victim.close()


CRASHERS = {  # (storages, overload, template, layouts, output specs): each one message killed the peer
    "_cummax_helper": ([400000, 0, 0], "aten._cummax_helper.default", [0, 0, 0, 0],
                       [contig([100000], "float32"), [[0], [1], 0, "float32"], [[0], [1], 0, "int64"]], []),
    "_nnpack_spatial_convolution": ([64, 16], "aten._nnpack_spatial_convolution.default", [0, 0, None, [0, 0], [0, 0]],
                                    [contig([1, 1, 4, 4], "float32"), contig([1, 1, 2, 2], "float32")],
                                    [[0, [1, 1, 3, 3], [9, 9, 3, 1], 0, "float32", 36]]),
    "_new_zeros_with_same_feature_meta": ([12, 24], "aten._new_zeros_with_same_feature_meta.default", [0, 0, 1000],
                                          [contig([3], "float32"), contig([2, 3], "float32")], None),
    "_dyn_quant_matmul_4bit": ([32, 16], "aten._dyn_quant_matmul_4bit.default", [0, 0, 0, 4, 4],
                               [contig([2, 4], "float32"), contig([16], "uint8")],
                               [[0, [2, 4], [4, 1], 0, "float32", 32]]),
    "_fft_r2c past the dims": ([4], "aten._fft_r2c.default", [0, [0, 2], 0, True], [contig([1], "float32")], None),
    "_foreach_copy of unequal lists": ([8, 4, 1], "aten._foreach_copy.default", [[0], [0, 0], False],
                                       [contig([1, 1, 1, 1], "int64"), contig([1], "float32"), contig([1], "bool")],
                                       None),
    "_reshape_alias_copy past its storage": ([64], "aten._reshape_alias_copy.default", [0, [1 << 22], [1]],
                                             [contig([8], "float64")], [[0, [1 << 22], [1], 0, "float64", 8 << 22]]),
    "unfold_backward of a huge size": ([16], "aten.unfold_backward.default", [0, [4], 0, 1 << 20, 1],
                                       [contig([4], "float32")], [[0, [4], [1], 0, "float32", 16]]),
    "_native_multi_head_attention of 0 heads": (
        [4 * 12] * 3 + [4 * 108, 4 * 18, 4 * 36, 4 * 6], "aten._native_multi_head_attention.default",
        [0, 0, 0, 6, 0, 0, 0, 0, 0, None, False, True, None],
        [contig(sh, "float32") for sh in ([1, 2, 6], [1, 2, 6], [1, 2, 6], [18, 6], [18], [6, 6], [6])],
        [[0, [1, 2, 6], [12, 6, 1], 0, "float32", 48], [0, [0], [1], 0, "float32", 0]]),
    "_transform_bias_rescale_qkv of 0 heads": ([48, 24], "aten._transform_bias_rescale_qkv.default", [0, 0, 0],
                                               [contig([1, 2, 6], "float32"), contig([6], "float32")], None),
    # found by fuzzing the allowlisted peer (stop 40): internal kernels a client does send, trusting shapes
    "_cholesky_solve_helper of another size": ([4, 65536], "aten._cholesky_solve_helper.default", [0, 0, False],
                                               [contig([1, 1], "float32"), contig([128, 128], "float32")],
                                               [[0, [1, 1], [1, 1], 0, "float32", 4]]),
    "_weight_norm_interface with a short g": ([8000, 4], "aten._weight_norm_interface.default", [0, 0, 0],
                                              [contig([500, 4], "float32"), contig([1], "float32")],
                                              [[0, [500, 4], [4, 1], 0, "float32", 8000],
                                               [1, [1], [1], 0, "float32", 4]]),
}


@pytest.mark.parametrize("case", sorted(CRASHERS))
def test_internal_kernels_that_trust_their_arguments_are_refused_or_checked(peer: Server, case: str) -> None:
    allocs, name, a, layouts, specs = CRASHERS[case]
    err = attack(peer, allocs, name, a, layouts, specs)
    assert err is not None and ("refused" in str(err) or "must" in str(err) or "exceeds" in str(err)), err


def test_a_shrunken_result_s_storage_holds_nothing_else(peer: Server) -> None:
    """``unique_consecutive`` shrinks its output in place: the peer stored the whole allocation, and reading it gave
    uninitialised heap, another session's freed bytes among them. Now the storage is the result's 8 bytes."""
    leave_a_secret(peer, 4096)
    d = ember.connect(peer.addresses[0])
    s = d.session
    n = 4096
    x = xp.zeros((n * 8,), dtype=xp.uint8, device=d)
    outs = [next(s.ids) for _ in range(4)]
    s.record([m.OP, "aten.unique_consecutive.default", [[], x._id], 1, outs,
              {"a": [0, False, False, None], "l": [contig([n], "int64")], "o": None}])
    got = RemoteArray(outs[0], (n * 8,), xp.uint8, d, s).to_numpy()
    assert got.size == 8 and not got.any()
    d.close()


def test_a_layout_of_too_many_elements_is_refused_at_once(peer: Server) -> None:
    """A stride-0 layout of 2^62 elements on 8 bytes passed the extent check, and ``sum`` over it never ended."""
    t0 = time.monotonic()
    err = attack(peer, [8], "aten.sum.default", [0, None], [[[1 << 31, 1 << 31], [0, 0], 0, "float32"]],
                 [[0, [], [], 0, "float32", 4]])
    assert err is not None and ("elements" in str(err) or "budget" in str(err)) and time.monotonic() - t0 < 30


def test_an_elementwise_call_must_declare_its_broadcast_output(peer: Server) -> None:
    """Three operands of 4,096 elements broadcast to 1 GiB: with a one-element output declared, the call ran on the
    network loop (stalling every session's round trip for seconds) and allocated past the memory budgets."""
    err = attack(peer, [16384, 16384, 32], "aten.addcmul.default", [0, 0, 0, 1],
                 [contig([4096, 1, 1], "float32"), contig([1, 4096, 1], "float32"), contig([1, 1, 8], "float32")],
                 [[0, [1], [1], 0, "float32", 4]], [1.0])
    assert err is not None and "broadcast" in str(err)


@pytest.mark.parametrize("name", ["aten.mse_loss.default", "aten.huber_loss.default"])
def test_a_loss_that_broadcasts_inside_is_charged_for_it_before_it_runs(peer: Server, name: str) -> None:
    """A loss of a (4096, 1) input and a (1, 4096) target returns one number but holds 4096 x 4096 floats (64 MiB)
    while it runs: past the session's 32 MiB budget, uncharged, found by a sweep (one message could make the peer
    allocate any amount). The call is refused by the budget now, before it runs; a loss within the budget runs."""
    extra = [1.0] if "huber" in name else []
    a = [0, 0, 1, *([1] if extra else [])]  # (input, target, reduction=mean, delta)
    spec = [[0, [], [], 0, "float32", 4]]
    err = attack(peer, [16384, 16384], name, a, [contig([4096, 1], "float32"), contig([1, 4096], "float32")],
                 spec, extra)
    assert err is not None and "budget" in str(err), err
    assert attack(peer, [2048, 2048], name, a, [contig([512, 1], "float32"), contig([1, 512], "float32")],
                  spec, extra) is None


def test_an_internal_kernel_no_client_sends_is_refused_by_name(peer: Server) -> None:
    """ATen has some 700 internal kernels (``_...``), many written for one caller that checked their arguments first;
    eight of them each crashed a peer with one message before they were denied by name one by one. A peer now runs
    only the internal ops torch's public API or ember.torch sends (``protocol/aten_internal_ops.txt``): any other is
    refused by name, the session and a bystander carry on."""
    for name, a in (("aten._add_relu.Tensor", [0, 0, 1]), ("aten._compute_linear_combination.default", [0, 0])):
        err = attack(peer, [16, 16], name, a, [contig([4], "float32"), contig([4], "float32")],
                     [[0, [4], [1], 0, "float32", 16]], [1] if "relu" in name else None)
        assert err is not None and "internal kernel" in str(err) and "aten_internal_ops.txt" in str(err), err
    # A composite the client runs itself (never a message): named in one, it allocated lengths[0] entries as given.
    err = attack(peer, [120, 16], "aten._pack_padded_sequence.default", [0, 0, False],
                 [contig([5, 2, 3], "float32"), contig([2], "int64")], None)
    assert err is not None and "internal kernel" in str(err), err


def test_the_internal_ops_list_names_real_ops_and_what_ember_torch_sends() -> None:
    from ember.protocol import aten as PA
    listed = PA.internal_ops()
    known = {n.split("::")[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names() if n.startswith("aten::")}
    assert listed and listed <= known and all(n[0] == "_" and n[1] != "_" for n in listed)
    sent = {"_to_copy", "_log_softmax", "_log_softmax_backward_data", "_softmax", "_foreach_add_", "_fused_adamw_",
            "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_attention_math", "_local_scalar_dense",
            "_thnn_fused_lstm_cell", "_native_batch_norm_legit", "_embedding_bag", "_fft_r2c", "_unique2"}
    assert sent <= listed, sent - listed
    args = [("self", "Tensor"), ("other", "Tensor"), ("alpha", "number")]
    why = PA.refusal("aten._add_relu.Tensor", args, ["Tensor"])
    assert why is not None and "internal kernel" in why
    assert PA.refusal("aten.add.Tensor", args, ["Tensor"]) is None


def test_a_client_call_of_an_unlisted_internal_op_fails_at_the_call() -> None:
    import ember.torch  # noqa: F401
    a = torch.ones(3, device="ember")
    with pytest.raises(NotImplementedError, match="internal kernel"):
        torch.ops.aten._add_relu.Tensor(a, a)
    assert torch.equal((a + a).cpu(), torch.full((3,), 2.0))


@pytest.mark.parametrize("name,a", [("aten.bincount.default", [0, None, 0]),
                                    ("aten.repeat_interleave.Tensor", [0, None])])
def test_an_output_sized_by_an_operand_s_values_is_charged_before_the_kernel_runs(peer: Server, name: str,
                                                                                  a: list) -> None:
    """``bincount`` of one int64 holding 2^24 allocates 2^24 bins (128 MiB) whatever the session's 32 MiB budget:
    its output is data-dependent, charged once it existed (2^31 would have been 16 GiB: the peer's machine, every
    session with it). The peer charges what the values ask for before the kernel runs; small values run."""
    for value, ok in ((1 << 24, False), (100, True)):
        bystander = ember.connect(peer.addresses[0])
        d = ember.connect(peer.addresses[0])
        s = d.session
        sid = next(s.ids)
        s.record([m.OP, "torch.alloc", [], 0, [sid], {"n": 8}])
        fill = {"a": [0, 1], "l": [contig([1], "int64")], "o": []}
        s.record([m.OP, "aten.fill_.Scalar", [[value], sid], 1, [], fill])
        outs = [next(s.ids) for _ in range(2)]
        s.record([m.OP, name, [[], sid], 1, outs, {"a": a, "l": [contig([1], "int64")], "o": None}])
        try:
            RemoteArray(outs[-1], (1,), xp.uint8, d, s).to_numpy()
            err = None
        except EmberError as e:
            err = e
        assert (err is None) == ok and (ok or "budget" in str(err) and "operands' values" in str(err)), err
        assert float(xp.sum(xp.arange(4.0, device=bystander))) == 6.0
        d.close()
        bystander.close()


@pytest.mark.parametrize("name,a,scalars", [("aten.zeros.default", [[1 << 26], None, None, None, None], []),
                                            ("aten.randn.default", [[1 << 26], None, None, None, None], []),
                                            ("aten.arange.default", [1, None, None, None, None], [1 << 26]),
                                            ("aten.repeat.default", [0, [1 << 13, 1 << 13]], [])])
def test_a_call_must_declare_the_outputs_it_makes(peer: Server, name: str, a: list, scalars: list) -> None:
    """Memory is charged by the outputs a client declares, before the call runs: ``zeros([2**26])`` declared as one
    float allocated 256 MiB in a 32 MiB session before its result was found to differ (2^32: 16 GiB, the peer's
    machine). The overload's meta kernel now says what the call makes, before it runs; an honest call runs."""
    one = [[0, [1], [1], 0, "float32", 4]]
    lays = [contig([1, 1], "float32")] if "repeat" in name else []
    err = attack(peer, [4] * len(lays), name, a, lays, one, scalars)
    assert err is not None and "declared" in str(err), err
    honest = {"aten.zeros.default": ([[1], None, None, None, None], []), "aten.randn.default": ([[1], None, None, None,
              None], []), "aten.arange.default": ([1, None, None, None, None], [1]), "aten.repeat.default": (
              [0, [1, 1]], [])}[name]
    out = [[0, [1, 1] if "repeat" in name else [1], [1, 1] if "repeat" in name else [1], 0,
            "int64" if "arange" in name else "float32", 8 if "arange" in name else 4]]
    assert attack(peer, [4] * len(lays), name, honest[0], lays, out, honest[1]) is None


def test_an_out_call_may_not_grow_what_it_writes(peer: Server) -> None:
    """``repeat.out`` (or ``mm.out``) into a one-element ``out`` resized it to the product (256 MiB here) in a 32 MiB
    session, charged only after it ran. A client sizes what it writes first, so the peer refuses the growth."""
    err = attack(peer, [4, 4], "aten.repeat.out", [0, [1 << 13, 1 << 13], 0],
                 [contig([1, 1], "float32"), contig([1], "float32")], [])
    assert err is not None and "grow a written operand" in str(err), err
    assert attack(peer, [4, 8], "aten.repeat.out", [0, [1, 2], 0],
                  [contig([1, 1], "float32"), contig([1, 2], "float32")], []) is None


def _filled(s: Any, n: int, value: Any, dtype: str) -> int:
    sid = next(s.ids)
    s.record([m.OP, "torch.alloc", [], 0, [sid], {"n": n * {"int64": 8, "float32": 4}[dtype]}])
    s.record([m.OP, "aten.fill_.Scalar", [[value], sid], 1, [], {"a": [0, 1], "l": [contig([n], dtype)], "o": []}])
    return sid


def test_more_trusting_kernels_found_by_fuzzing_the_allowlisted_peer(peer: Server) -> None:
    """Three more, each one message: repeats whose int64 sum wraps (4 x 2^62 sums to 0: repeat_interleave allocated
    nothing and wrote four ranges; the peer died); CPU flash attention's backward with a one-element logsumexp (it
    read 16 KiB past it and sent back gradients made of those bytes); CTC's log_alpha, partly written by its kernel
    (the rest was freed heap: another session's bytes came back). The first two are refused, the third zeroed."""
    leave_a_secret(peer, 2048)
    d = ember.connect(peer.addresses[0])
    s = d.session
    rep = _filled(s, 4, 1 << 62, "int64")
    outs = [next(s.ids) for _ in range(2)]
    s.record([m.OP, "aten.repeat_interleave.Tensor", [[], rep], 1, outs,
              {"a": [0, None], "l": [contig([4], "int64")], "o": None}])
    with pytest.raises(EmberError, match="repeats"):
        RemoteArray(outs[-1], (1,), xp.uint8, d, s).to_numpy()
    L, D = 256, 8
    x, lse = _filled(s, L * D, 0.25, "float32"), _filled(s, 1, 0.0, "float32")
    outs = [next(s.ids) for _ in range(3)]
    spec = [[k, [1, 1, L, D], [L * D, L * D, D, 1], 0, "float32", L * D * 4] for k in range(3)]
    s.record([m.OP, "aten._scaled_dot_product_flash_attention_for_cpu_backward.default", [[0.0], x, x, x, x, x, lse],
              1, outs, {"a": [0, 0, 0, 0, 0, 0, 1, False, None, None],
                        "l": [contig([1, 1, L, D], "float32")] * 5 + [contig([1, 1, 1], "float32")], "o": spec}])
    with pytest.raises(EmberError, match="logsumexp"):
        RemoteArray(outs[0], (1,), xp.uint8, d, s).to_numpy()
    T, C, S = 512, 4, 1
    W = 2 * S + 1
    lp, tg = _filled(s, T * C, 0.0, "float32"), _filled(s, S, 1, "int64")
    outs = [next(s.ids), next(s.ids)]
    s.record([m.OP, "aten._ctc_loss.default", [[], lp, tg], 1, outs,
              {"a": [0, 0, [1], [S], 0, False], "l": [contig([T, 1, C], "float32"), contig([1, S], "int64")],
               "o": [[0, [1], [1], 0, "float32", 4], [1, [1, T, W], [T * W, W, 1], 0, "float32", T * W * 4]]}])
    raw = RemoteArray(outs[1], (T * W * 4,), xp.uint8, d, s).to_numpy()
    assert not raw.reshape(T, W * 4)[1:].any()  # (rows past the input's length: no kernel wrote them)
    d.close()


@pytest.mark.parametrize("case", ["stride-0 median", "histogram bins", "zeros called data-dependent",
                                  "resize_ of a 4-byte storage"])
def test_memory_a_message_asks_for_is_charged_before_the_kernel_runs(peer: Server, case: str) -> None:
    """More of what the fuzzer found: kernels that copy an operand hold what its layout describes (a stride-0 view of
    2^26 floats over 4 bytes), ``histogram``'s bins have no meta kernel to size them, a factory sent as
    data-dependent (``o: None``) skipped the declared-output check, and ``resize_`` grew its storage before its
    charge. Each allocated 256 MiB or more in a 32 MiB session; each is now charged first, and refused."""
    n = 1 << 26
    allocs, name, a, lays, specs = {
        "stride-0 median": ([4], "aten.median.default", [0], [[[n], [0], 0, "float32"]],
                            [[0, [], [], 0, "float32", 4]]),
        "histogram bins": ([4], "aten.histogram.bin_ct", [0, n, None, None, False], [contig([1], "float32")],
                           [[0, [1], [1], 0, "float32", 4], [1, [2], [1], 0, "float32", 8]]),
        "zeros called data-dependent": ([], "aten.zeros.default", [[n], "float32", None, None, None], [], None),
        "resize_ of a 4-byte storage": ([4], "aten.resize_.default", [0, [n], None], [contig([1], "float32")], []),
    }[case]
    if name != "aten.resize_.default":
        err = attack(peer, allocs, name, a, lays, specs)
    else:  # (what it writes is its operand: read that)
        d = ember.connect(peer.addresses[0])
        s = d.session
        sid = next(s.ids)
        s.record([m.OP, "torch.alloc", [], 0, [sid], {"n": 4}])
        s.record([m.OP, name, [[], sid], 1, [], {"a": a, "l": lays, "o": specs}])
        with pytest.raises(EmberError) as got:
            RemoteArray(sid, (4,), xp.uint8, d, s).to_numpy()
        err = got.value
        d.close()
    assert err is not None and "budget" in str(err), err


def test_an_op_whose_cost_grows_with_a_value_never_runs_on_the_network_loop() -> None:
    """``special_laguerre_polynomial_l`` of one element with n = 2e9 runs 2e9 steps: judged cheap (pointwise, small),
    it ran on the network loop and a bystander's session was lost. Such ops run on the session's worker."""
    from ember.server.execute.aten import AtenKernel
    from ember.server.execute.session_random import SessionRandom
    rng = SessionRandom(torch.device("cpu"))
    for name in ("aten.special_laguerre_polynomial_l.default", "aten.special_legendre_polynomial_p.default"):
        base, overload = name.split(".")[1:]
        k = AtenKernel(name, getattr(getattr(torch.ops.aten, base), overload), torch.device("cpu"), rng)
        assert not k.loop_ok and not k.bounded
    k = AtenKernel("aten.add.Tensor", torch.ops.aten.add.Tensor, torch.device("cpu"), rng)
    assert k.loop_ok
