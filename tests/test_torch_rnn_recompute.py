"""nn.GRU and nn.RNN on a torch:cpu peer, one layer per op: the peer runs torch's own layer composite
(``torch.rnn_layer``) and recomputes it for the backward (``torch.rnn_layer_backward``), so a language model
trains bit-equal to local CPU torch in a few ops a step (``ember/server/execute/rnn_recompute.py``); what a
hostile client sends for those two ops is refused with the reason, and the session carries on."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn
F = nn.functional

import ember  # noqa: E402
import ember.torch  # noqa: E402
from ember.errors import RemoteExecutionError  # noqa: E402
from test_torch_positions import edit_next_op  # noqa: E402

pytestmark = pytest.mark.timeout(300)


class LM(nn.Module):
    """pytorch/examples word_language_model's RNNModel with a GRU or a plain RNN: dropout on the embedding,
    between the layers and on the output."""

    def __init__(self, kind: str, vocab: int = 40, d: int = 16) -> None:
        super().__init__()
        self.drop, self.encoder = nn.Dropout(0.2), nn.Embedding(vocab, d)
        rnn = {"GRU": nn.GRU, "RNN_TANH": nn.RNN, "RNN_RELU": nn.RNN}[kind]
        kw = {"nonlinearity": kind[4:].lower()} if kind.startswith("RNN") else {}
        self.rnn, self.decoder = rnn(d, d, 2, dropout=0.2, **kw), nn.Linear(d, vocab)

    def forward(self, idx: Any, hidden: Any) -> Any:
        out, hidden = self.rnn(self.drop(self.encoder(idx)), hidden)
        return self.decoder(self.drop(out)), hidden


def train_lm(device: str, kind: str, steps: int, bptt: int = 7, batch: int = 4) -> tuple[list[float], list[Any]]:
    """word_language_model's train(): truncated BPTT, the hidden state detached between chunks, clipping, a manual
    SGD update; every few steps an evaluation without dropout (model.eval(), no_grad)."""
    torch.manual_seed(0)
    model = LM(kind).to(device)
    torch.manual_seed(5)  # (the peer's stream and CPU's, aligned after the CPU-side init)
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 40, ((steps * bptt + 1) * batch,), generator=g).view(-1, batch).to(device)
    h = torch.zeros(2, batch, 16, device=device)
    losses = []
    for k in range(steps):
        x, y = data[k * bptt:(k + 1) * bptt], data[k * bptt + 1:(k + 1) * bptt + 1]
        model.train()
        model.zero_grad()
        out, h = model(x, h.detach())
        loss = F.cross_entropy(out.view(-1, 40), y.reshape(-1))
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-2.0)
        if k % 10 == 9:
            model.eval()
            with torch.no_grad():
                losses += [loss.item(), F.cross_entropy(model(x, h)[0].view(-1, 40), y.reshape(-1)).item()]
    return losses, [p.detach().cpu() for p in model.parameters()]


def same(a: Any, b: Any) -> None:
    assert a[0] == b[0], f"losses differ: {a[0]} vs {b[0]}"
    for p, q in zip(a[1], b[1], strict=True):
        assert torch.equal(p, q), f"parameters differ by {(p.double() - q.double()).abs().max().item()}"


@pytest.mark.parametrize("kind", ["GRU", "RNN_TANH", "RNN_RELU"])
def test_a_gru_or_rnn_language_model_trains_bit_equal_to_local_cpu_in_few_ops(torch_peer: str, kind: str) -> None:
    """100 steps over WebSocket, evaluations between them: losses and every parameter bit-equal; each layer is
    one op forward and one backward (the time steps' cells were ~600 ops a step), and no step reads."""
    local = train_lm("cpu", kind, 100)
    with ember.connect(torch_peer) as dev:
        ops0 = ember.torch.counters["ops"]
        remote = train_lm("ember", kind, 100)
        assert (ember.torch.counters["ops"] - ops0) / 100 < 120
        assert dev.session.stats["reads"] < 50  # (the 20 losses read, and no read a step)
    same(local, remote)


def _layer(device: str, kind: str, freeze: bool, grad_input: bool, **kw: Any) -> list[Any]:
    torch.manual_seed(0)
    m = (nn.GRU if kind == "GRU" else nn.RNN)(5, 7, **kw).to(device)
    m.requires_grad_(not freeze)
    x = torch.randn(6, 3, 5, generator=torch.Generator().manual_seed(1))
    x = (x.transpose(0, 1).contiguous() if kw.get("batch_first") else x).to(device).requires_grad_(grad_input)
    out, h = m(x)
    if not (freeze and not grad_input):
        (out.pow(2).sum() + h.sum()).backward()
    grads = [x.grad] + [p.grad for p in m.parameters()]
    return [out.detach().cpu(), h.detach().cpu()] + [g.cpu() for g in grads if g is not None]


@pytest.mark.parametrize("freeze,grad_input", [(True, True), (False, False), (True, False)],
                         ids=["frozen-weights", "weights-only", "inference"])
@pytest.mark.parametrize("kind", ["GRU", "RNN"])
def test_which_operands_require_grad_is_kept_as_cpu_rounds_by_it(kind: str, freeze: bool, grad_input: bool) -> None:
    """CPU torch's layer rounds by which operands require grad (``matmul`` folds a batch-first input into one
    ``mm`` when the weight requires grad): frozen weights under a trained input, a trained layer on a plain
    input, and inference, each bit-equal, batch-first and bidirectional."""
    kw = {"batch_first": True, "bidirectional": True, "num_layers": 2}
    with ember.connect("local:torch"):
        want, got = _layer("cpu", kind, freeze, grad_input, **kw), _layer("ember", kind, freeze, grad_input, **kw)
    assert len(want) == len(got)
    for a, b in zip(want, got):
        assert torch.equal(a, b), (a - b).abs().max()


def test_a_captured_gru_step_stays_bit_equal() -> None:
    """ember.torch.capture records a step op by op (its layers take the time steps' cells there) and replays it."""
    def run(device: str) -> list[Any]:
        torch.manual_seed(0)
        m = nn.GRU(5, 7, 2).to(device)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)

        def step(x: Any) -> Any:
            opt.zero_grad()
            loss = m(x)[0].pow(2).mean()
            loss.backward()
            opt.step()
            return loss
        run_step = ember.torch.capture(step) if device == "ember" else step
        g = torch.Generator().manual_seed(1)
        losses = [run_step(torch.randn(4, 3, 5, generator=g).to(device)).item() for _ in range(6)]
        return losses + [p.detach().cpu() for p in m.parameters()]
    with ember.connect("local:torch"):
        want, got = run("cpu"), run("ember")
    assert want[:6] == got[:6]
    assert all(torch.equal(a, b) for a, b in zip(want[6:], got[6:]))


def _call() -> tuple[Any, Any]:
    torch.manual_seed(0)
    m = nn.GRU(5, 7).to("ember")
    x = torch.randn(4, 3, 5).to("ember").requires_grad_()
    return m, x


@pytest.mark.parametrize("change,words", [
    (lambda kw: kw["a"].__setitem__(0, "lstm"), "malformed RNN layer call"),            # no such layer op
    (lambda kw: kw["a"].__setitem__(3, [True]), "requires-grad flag"),                   # flags that do not match
    (lambda kw: kw["l"].__setitem__(2, [[22, 5], [5, 1], 0, "float32"]), "reaches byte"),  # past its storage
    (lambda kw: kw["l"].__setitem__(2, [[20, 5], [5, 1], 0, "float64"]), "reaches byte|dtype"),
    (lambda kw: kw["l"].__setitem__(2, [[21, 4], [4, 1], 0, "float32"]), "size|shape"),  # torch's own size check
    (lambda kw: kw["o"][0].__setitem__(1, [4, 3, 8]), "output spec"),                    # a spec the result is not
], ids=["layer-name", "flags", "past-storage", "dtype", "weight-size", "spec"])
def test_a_hostile_rnn_layer_call_is_refused_with_the_reason_and_the_session_goes_on(change: Any, words: str) -> None:
    with ember.connect("local:torch"):
        m, x = _call()
        want = m(x)[0].cpu()
        with edit_next_op(change, only="torch.rnn_layer"), pytest.raises(RemoteExecutionError, match=words):
            m(x)[0].cpu()
        with edit_next_op(lambda kw: kw["a"].__setitem__(4, "yes"), only="torch.rnn_layer_backward"), \
                pytest.raises(RemoteExecutionError, match="malformed"):
            m(x)[0].sum().backward()
            x.grad.cpu()
        assert torch.equal(m(x)[0].cpu(), want)  # the session carries on
