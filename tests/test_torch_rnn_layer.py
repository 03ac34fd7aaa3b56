"""nn.LSTM on a torch:cpu peer takes CPU torch's own path: one oneDNN layer op per layer and direction
(``mkldnn_rnn_layer``, backward ``mkldnn_rnn_layer_backward``), so it trains bit-equal to local CPU torch
(``ember/torch/_rnn.py``); the peer checks those kernels' operands, which oneDNN reads through raw
pointers (``ember/server/execute/rnn_layer.py``)."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn
F = nn.functional

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import ember  # noqa: E402
import ember.torch  # noqa: E402
from ember.errors import RemoteExecutionError  # noqa: E402
from ember.server.execute import rnn_layer  # noqa: E402
from test_torch_positions import edit_next_op  # noqa: E402

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")]
A = torch.ops.aten


class RNNModel(nn.Module):
    """pytorch/examples word_language_model's model: embedding, a 2-layer LSTM, a decoder (tied or not)."""

    def __init__(self, vocab: int = 40, d: int = 16, layers: int = 2, tie: bool = False) -> None:
        super().__init__()
        self.encoder, self.rnn = nn.Embedding(vocab, d), nn.LSTM(d, d, layers)
        self.decoder = nn.Linear(d, vocab)
        if tie:
            self.decoder.weight = self.encoder.weight

    def forward(self, idx: Any, hidden: Any) -> Any:
        out, hidden = self.rnn(self.encoder(idx), hidden)
        return self.decoder(out), hidden


def word_language_model(device: str, steps: int, tie: bool, capture: bool = False, bptt: int = 7,
                        batch: int = 4) -> tuple[list[float], list[Any]]:
    """word_language_model's train(): truncated BPTT over one token stream, the hidden state carried and
    detached between chunks, clip_grad_norm_, a manual SGD update; the loss read every 10 steps."""
    torch.manual_seed(0)
    model = RNNModel(tie=tie).to(device)
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 40, ((steps * bptt + 1) * batch,), generator=g).view(-1, batch)  # (tokens, batch)

    def step(x: Any, y: Any, h: Any, c: Any) -> Any:
        model.zero_grad()
        out, (h, c) = model(x, (h, c))
        loss = F.cross_entropy(out.view(-1, out.shape[-1]), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-2.0)
        return loss, h.detach(), c.detach()
    run = ember.torch.capture(step) if capture else step
    h, c = (torch.zeros(2, batch, 16, device=device) for _ in range(2))
    losses = []
    for k in range(steps):
        i = k * bptt
        x, y = data[i:i + bptt].to(device), data[i + 1:i + 1 + bptt].to(device)
        loss, h, c = run(x, y, h, c)
        if k % 10 == 9:
            losses.append(loss.item())
    return losses, [p.detach().cpu() for p in model.parameters()]


def same(a: Any, b: Any) -> None:
    assert a[0] == b[0], f"losses differ: {a[0]} vs {b[0]}"
    for p, q in zip(a[1], b[1], strict=True):
        assert torch.equal(p, q), f"parameters differ by {(p.double() - q.double()).abs().max().item()}"


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_word_language_model_trains_bit_equal_to_local_cpu_over_100_steps(peer: ember.Device, tie: bool) -> None:
    local = word_language_model("cpu", 100, tie)
    s = peer.session
    ops0 = ember.torch.counters["ops"]
    remote = word_language_model("ember", 100, tie)
    same(local, remote)
    assert (ember.torch.counters["ops"] - ops0) / 100 < 120  # oneDNN layers: the cells would be ~1,000 ops a step
    assert s.stats["reads"] >= 10


def test_a_captured_word_language_model_step_is_bit_equal_to_local_cpu_over_100_steps(peer: ember.Device) -> None:
    local = word_language_model("cpu", 100, tie=True)
    before = dict(ember.torch.capture_stats)
    remote = word_language_model("ember", 100, tie=True, capture=True)
    same(local, remote)
    assert ember.torch.capture_stats["replays"] >= before["replays"] + 95


@pytest.mark.parametrize("kw", [{}, {"bias": False}, {"batch_first": True}, {"bidirectional": True},
                                {"num_layers": 3, "bidirectional": True, "batch_first": True}, {"dtype": "bfloat16"}],
                         ids=["plain", "no-bias", "batch-first", "bidirectional", "3-layers-bidirectional", "bfloat16"])
def test_lstm_forward_backward_and_no_grad_equal_local_cpu(kw: dict[str, Any]) -> None:
    """(bfloat16: CPU torch takes oneDNN's layer where this CPU has oneDNN's bfloat16, and so does ember.)"""
    kw = dict(kw)
    dtype = getattr(torch, kw.pop("dtype", "float32"))
    torch.manual_seed(0)
    m = nn.LSTM(6, 5, **{"num_layers": 2, **kw}).to(dtype)
    dirs, layers = 2 if kw.get("bidirectional") else 1, m.num_layers
    x = torch.randn(3, 7, 6).to(dtype)
    state = (torch.randn(layers * dirs, 3, 5).to(dtype), torch.randn(layers * dirs, 3, 5).to(dtype))
    x = x if kw.get("batch_first") else x.transpose(0, 1).contiguous()
    results = []
    with ember.connect("local:torch"):
        for mod, dev in ((m, "cpu"), (nn.LSTM(6, 5, **{"num_layers": 2, **kw}).to(dtype), "ember")):
            if dev == "ember":
                mod.load_state_dict(m.state_dict())
                mod = mod.to(dev)
            xx = x.to(dev).requires_grad_()
            hh = tuple(t.to(dev).requires_grad_() for t in state)
            out, (h, c) = mod(xx, hh)
            grads = torch.autograd.grad((out * 1.5).sum() + h.sum() + c.sum() * 2, [xx, *hh, *mod.parameters()])
            with torch.no_grad():  # oneDNN's inference kernel: other last bits than its training one
                plain = mod(xx, hh)[0]
            results.append([t.cpu() for t in (out, h, c, plain, *grads)])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_an_lstm_under_autocast_keeps_cudas_policy() -> None:
    """Under ``torch.autocast("ember")`` the cells run in the low-precision type, as before (CUDA's policy)."""
    torch.manual_seed(0)
    m = nn.LSTM(4, 6, 2)
    x = torch.randn(5, 2, 4)
    with ember.connect("local:torch"):
        e = nn.LSTM(4, 6, 2)
        e.load_state_dict(m.state_dict())
        e = e.to("ember")
        with torch.autocast("ember", dtype=torch.bfloat16):
            got = e(x.to("ember"))[0]
        assert got.dtype is torch.bfloat16
        torch.testing.assert_close(got.float().cpu(), m(x)[0].detach(), rtol=0.05, atol=0.01)


def test_other_lstms_still_take_the_cells_and_train() -> None:
    """float64, projections, or oneDNN switched off: torch's own composite (per-step cells), close to CPU."""
    torch.manual_seed(0)
    cases = [(nn.LSTM(4, 6, dtype=torch.float64), torch.float64), (nn.LSTM(4, 6, proj_size=3), torch.float32)]
    with ember.connect("local:torch"):
        for m, dt in cases:
            x = torch.randn(5, 2, 4, dtype=dt)
            want = m(x)[0]
            e = m.to("ember")
            with _OpNames() as seen:
                got = e(x.to("ember"))[0]
            assert "aten._thnn_fused_lstm_cell.default" in seen.names  # ATen's own composite: the fused cells
            torch.testing.assert_close(got.cpu(), want.detach(), rtol=1e-6, atol=1e-6)
        with torch.backends.mkldnn.flags(enabled=False):
            m = nn.LSTM(4, 6)
            x = torch.randn(5, 2, 4)
            want = m(x)[0]
            n0 = ember.torch.counters["ops"]
            got = m.to("ember")(x.to("ember"))[0]
            assert ember.torch.counters["ops"] - n0 > 20
            torch.testing.assert_close(got.cpu(), want.detach(), rtol=1e-6, atol=1e-6)


class _OpNames(TorchDispatchMode):
    """The names of the ATen overloads dispatched inside the context."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.add(str(func))
        return func(*args, **(kwargs or {}))


# ---- the peer's checks: a hostile client's raw messages -------------------------------------------------

def _layer_args(t: int = 3, n: int = 2, i: int = 4, h: int = 5) -> list[Any]:
    g = torch.Generator().manual_seed(0)

    def r(*s: int) -> Any:
        return torch.randn(*s, generator=g).to("ember")
    return [r(t, n, i), r(4 * h, i), r(4 * h, h), r(4 * h), r(4 * h), r(n, h), r(n, h), False, [],
            rnn_layer.LSTM, h, 1, True, False, False, True]


def _edited(change: Any) -> Any:
    """Context: the next LSTM layer OP message's template edited by ``change`` on its way out."""
    return edit_next_op(change, only="mkldnn_rnn_layer")


@pytest.mark.parametrize("operand,layout,word", [
    (1, [[20, 2], [2, 1], 0, "float32"], "weight_ih"),         # weights for a narrower input
    (5, [[1, 5], [5, 1], 0, "float32"], "hx"),                 # a state of one row: oneDNN reads n rows
    (6, [[2, 5], [0, 1], 0, "float32"], "cx"),                 # an expanded (not dense) state
    (0, [[3, 2, 2], [4, 2, 1], 0, "float64"], "input"),        # another dtype than oneDNN is told
], ids=["weight-size", "hx-rows", "cx-strides", "input-dtype"])
def test_lstm_layer_operands_that_do_not_match_are_refused_on_the_peer(operand: int, layout: Any, word: str) -> None:
    with ember.connect("local:torch"):
        args = _layer_args()
        want = [t.cpu() for t in A.mkldnn_rnn_layer(*args)[:3]]

        def edit(kw: dict[str, Any]) -> None:
            kw["l"][operand] = layout
        with _edited(edit), pytest.raises(RemoteExecutionError, match=f"{word}.*refused on the peer"):
            A.mkldnn_rnn_layer(*args)[0].cpu()
        got = [t.cpu() for t in A.mkldnn_rnn_layer(*args)[:3]]  # the session carries on
    local = A.mkldnn_rnn_layer(*[a.cpu() if isinstance(a, torch.Tensor) else a for a in args])
    for w, g, loc in zip(want, got, local):
        assert torch.equal(w, g) and torch.equal(g, loc)


def test_a_workspace_smaller_than_onednn_reads_is_refused_on_the_peer() -> None:
    with ember.connect("local:torch"):
        args = _layer_args()
        out, hy, cy, ws = A.mkldnn_rnn_layer(*args)
        grads = [torch.ones_like(out), torch.ones_like(hy), torch.ones_like(cy)]
        x, w0, w1, w2, w3, hx, cx = args[:7]
        back = [x, w0, w1, w2, w3, hx, cx, out, hy, cy, *grads, False, rnn_layer.LSTM, 5, 1, True, True, False, [],
                False]
        want = [t.cpu() for t in A.mkldnn_rnn_layer_backward(*back, ws)]
        with pytest.raises(RemoteExecutionError, match="workspace.*refused on the peer"):
            A.mkldnn_rnn_layer_backward(*back, ws[:64])[0].cpu()  # sizes a forward ran with: learnt
        t7 = [torch.randn(7, 2, 4).to("ember"), *back[1:7], torch.randn(7, 2, 5).to("ember"), *back[8:10],
              torch.ones(7, 2, 5).to("ember"), *back[11:]]
        with pytest.raises(RemoteExecutionError, match="workspace holds 64 bytes.*refused on the peer"):
            A.mkldnn_rnn_layer_backward(*t7, ws[:64])[0].cpu()  # sizes no forward had: not even probed
        with pytest.raises(RemoteExecutionError, match="mode.*refused on the peer"):
            def gru_mode(kw: dict[str, Any]) -> None:
                kw["a"][9] = 3
            with _edited(gru_mode):
                A.mkldnn_rnn_layer(*args)[0].cpu()
        assert torch.equal(A.mkldnn_rnn_layer_backward(*back, ws)[0].cpu(), want[0])
    local = [a.cpu() if isinstance(a, torch.Tensor) else a for a in back]
    lws = A.mkldnn_rnn_layer(*[a.cpu() if isinstance(a, torch.Tensor) else a for a in args])[3]
    for w, loc in zip(want, A.mkldnn_rnn_layer_backward(*local, lws), strict=True):
        assert torch.equal(w, loc)


def test_a_bad_lstm_layer_call_fails_where_it_is_made() -> None:
    with ember.connect("local:torch"):
        args = _layer_args()
        args[5] = torch.zeros(1, 5).to("ember")
        with pytest.raises(RuntimeError, match="hx is .*oneDNN would read or write outside"):
            A.mkldnn_rnn_layer(*args)


def test_only_the_two_dense_lstm_layer_kernels_pass_the_mkldnn_deny_list() -> None:
    from ember.server.execute.aten import refusal
    assert refusal("aten.mkldnn_rnn_layer.default") is None
    assert refusal("aten.mkldnn_rnn_layer_backward.default") is None
    for name in ("aten.mkldnn_rnn_layer.out", "aten.mkldnn_rnn_layer_backward.out", "aten.mkldnn_convolution.default",
                 "aten.to_mkldnn.default", "aten.mkldnn_reorder_conv2d_weight.default"):
        assert "refused" in (refusal(name) or ""), name


def test_replayed_lstm_layers_keep_their_checks_and_grad_mode() -> None:
    """A replayed graph lowers only unchecked kernels onto its fast path (server/execute/program.py): the two
    layer kernels keep their operand checks in every replay, and the forward its grad mode from ``train``."""
    from ember.server.execute.aten import AtenKernel
    from ember.server.execute.session_random import SessionRandom
    cpu = torch.device("cpu")
    fwd = AtenKernel("aten.mkldnn_rnn_layer.default", A.mkldnn_rnn_layer.default, cpu, SessionRandom(cpu))
    bwd = AtenKernel("aten.mkldnn_rnn_layer_backward.default", A.mkldnn_rnn_layer_backward.default, cpu,
                     SessionRandom(cpu))
    assert fwd.check is not None and bwd.check is not None
    assert fwd.special is not None and bwd.special is None
    x = _layer_args(t=4)[:7]
    args = [t.cpu() for t in x] + [True, [], rnn_layer.LSTM, 5, 1, True, False, False, False]
    assert fwd.run(args, {})[3] is None  # train False: oneDNN's inference kernel, no workspace
    with torch.no_grad():
        args[15] = True
        ws = fwd.run(args, {})[3]  # train True: the training kernel, whose workspace's size the peer learns
    learnt = rnn_layer._learnt[(4, 2, 4, 5, True, torch.float32)]
    assert ws.numel() == rnn_layer.workspace_bytes(4, 2, 4, 5, True) == learnt
