"""nn.LSTM / nn.GRU on ember: torch's fused cells (CUDA-only kernels) run on a torch:cpu peer, and the
client infers their shapes without a round trip (ember/server/execute/rnn_cells.py)."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

import ember  # noqa: E402
import ember.torch  # noqa: E402,F401
from ember.server.execute import rnn_cells  # noqa: E402

pytestmark = pytest.mark.timeout(120)


class Classifier(nn.Module):
    def __init__(self, kind: str, **kw: Any) -> None:
        super().__init__()
        self.rnn = getattr(nn, kind)(8, 16, batch_first=True, **kw)
        self.head = nn.Linear(16 * (2 if kw.get("bidirectional") else 1), 3)

    def forward(self, x: Any) -> Any:
        return self.head(self.rnn(x)[0][:, -1])


def train(device: str, kind: str, steps: int = 4, optimizer: Any = None, **kw: Any) -> tuple[list[float], list[Any]]:
    torch.manual_seed(0)
    model = Classifier(kind, **kw).to(device)
    opt = (optimizer or torch.optim.AdamW)(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(4, 6, 8, generator=g).to(device), torch.randint(0, 3, (4,), generator=g).to(device)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().cpu() for p in model.parameters()]


@pytest.mark.parametrize("kind,kw", [("LSTM", {}), ("GRU", {}), ("LSTM", {"bias": False}), ("GRU", {"bias": False}),
                                     ("LSTM", {"num_layers": 2, "bidirectional": True}), ("GRU", {"num_layers": 2})],
                         ids=["lstm", "gru", "lstm-nobias", "gru-nobias", "lstm-2-layers-bidirectional", "gru-2-layers"])
def test_rnn_training_equals_local_cpu_over_websocket(torch_peer: str, kind: str, kw: dict[str, Any]) -> None:
    """The fused cell adds the biases after the matmuls, so values differ from local CPU by rounding
    only. Losses are compared after AdamW; parameters after SGD, whose update is linear in the
    gradient (Adam divides by sqrt(v): a last-bit difference in a tiny gradient becomes a visible
    one in the parameter, and how visible depends on the machine's kernels)."""
    local = train("cpu", kind, **kw)
    local_sgd = train("cpu", kind, optimizer=torch.optim.SGD, **kw)
    with ember.connect(torch_peer) as dev:
        remote = train("ember", kind, **kw)
        remote_sgd = train("ember", kind, optimizer=torch.optim.SGD, **kw)
        assert dev.stats()["reads"] >= 8
    for a, b in zip(local[0] + local_sgd[0], remote[0] + remote_sgd[0]):
        assert b == pytest.approx(a, rel=1e-6)
    for p, q in zip(local_sgd[1], remote_sgd[1]):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_an_rnn_training_step_costs_no_round_trip(kind: str) -> None:
    with ember.connect("local:torch") as dev:
        torch.manual_seed(0)
        model = Classifier(kind).to("ember")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = torch.randn(4, 6, 8).to("ember"), torch.randint(0, 3, (4,)).to("ember")
        first = nn.functional.cross_entropy(model(x), y).item()
        reads = dev.stats()["reads"]
        for _ in range(3):
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        assert dev.stats()["reads"] == reads  # shapes inferred here, every op sent in batches
        assert loss.item() < first


def cell_run(cell: Any, device: str, bias: bool, dtype: Any, unbatched: bool) -> tuple[list[Any], list[Any]]:
    """Six steps of a cell (its state carried), a sum of the states as the loss, backward: (outputs, grads)."""
    torch.manual_seed(0)
    c = cell(5, 7, bias=bias).to(dtype).to(device)
    xs = torch.randn(6, 5, dtype=dtype) if unbatched else torch.randn(6, 3, 5, dtype=dtype)
    h = torch.randn(xs.shape[1:-1] + (7,), dtype=dtype).to(device)
    state = (h, torch.randn(h.shape, dtype=dtype).to(device)) if cell is nn.LSTMCell else h
    outs, loss = [], 0
    for x in xs.to(device):
        state = c(x, state)
        outs.append(state[0] if isinstance(state, tuple) else state)
        loss = loss + outs[-1].sum()
    loss.backward()
    return [o.detach().cpu() for o in outs], [p.grad.cpu() for p in c.parameters()]


@pytest.mark.parametrize("cell", [nn.LSTMCell, nn.GRUCell], ids=["lstm_cell", "gru_cell"])
def test_cells_used_directly_are_bit_equal_to_local_cpu(cell: Any) -> None:
    """Torch's composite takes the fused cells on any device but the CPU, as on CUDA; on a CPU peer the client
    makes the gates with addmm as CPU torch does (torch/_rnn.py) and the peer's fused cell kernels compute the
    rest with CPU's rounding (server/execute/rnn_cells.py): outputs and gradients bit-equal, with and without
    biases, float32 and float64, batched or not. A malformed call fails as on CPU."""
    for bias in (True, False):
        for dtype in (torch.float32, torch.float64):
            for unbatched in (False, True):
                want = cell_run(cell, "cpu", bias, dtype, unbatched)
                got = cell_run(cell, "ember", bias, dtype, unbatched)
                assert all(torch.equal(a, b) for a, b in zip(want[0] + want[1], got[0] + got[1])), (bias, dtype)
    c = cell(5, 7)
    errors = []
    for device in ("cpu", "ember"):
        with pytest.raises(RuntimeError) as e:
            c.to(device)(torch.randn(3, 4).to(device))  # input size 4 where the cell takes 5
        errors.append(str(e.value).split("\n")[0])
    assert errors[0] == errors[1]


@pytest.mark.parametrize("bias", [True, False])
def test_fused_cell_kernels_pass_gradcheck(bias: bool) -> None:
    """Forward and backward agree: torch's derivative formulas call the backward kernels."""
    rnn_cells.install("CPU")
    g = torch.Generator().manual_seed(0)

    def t(*shape: int) -> Any:
        return torch.randn(*shape, dtype=torch.float64, generator=g).requires_grad_()
    b, h = 3, 4
    lstm = (t(b, 4 * h), t(b, 4 * h), t(b, h)) + ((t(4 * h), t(4 * h)) if bias else ())
    assert torch.autograd.gradcheck(lambda *a: torch.ops.aten._thnn_fused_lstm_cell(*a)[:2], lstm)
    gru = (t(b, 3 * h), t(b, 3 * h), t(b, h)) + ((t(3 * h), t(3 * h)) if bias else ())
    assert torch.autograd.gradcheck(lambda *a: torch.ops.aten._thnn_fused_gru_cell(*a)[0], gru)


def _layer_run(device: str, cls: Any, dtype: Any, **kw: Any) -> list[Any]:
    """Outputs, the input's gradient and the parameters' after a forward and backward of an RNN layer stack."""
    torch.manual_seed(0)
    m = cls(5, 7, **kw).to(dtype).to(device)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 3, 5, generator=g, dtype=dtype)
    if kw.get("batch_first"):
        x = x.transpose(0, 1).contiguous()
    x = x.to(device).requires_grad_()
    out, h = m(x)
    h = h[0] if isinstance(h, tuple) else h
    (out.pow(2).sum() + h.sum()).backward()
    return [out.detach().cpu(), h.detach().cpu(), x.grad.cpu()] + [p.grad.cpu() for p in m.parameters()]


_STACKS = [{"num_layers": 2, "bidirectional": True, "batch_first": True}, {"num_layers": 2, "bias": False},
           {"bidirectional": True}, {}]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("cls,kw", [(c, kw) for c in ("GRU", "RNN", "RNN-relu", "LSTM") for kw in _STACKS])
def test_gru_rnn_and_lstm_layers_are_bit_equal_to_local_cpu(cls: str, kw: dict[str, Any], dtype: Any) -> None:
    """CPU torch projects a layer's whole input sequence in one ``linear`` before its time loop; any other
    device step by step. On a CPU peer ember takes CPU's path (``torch/_rnn.py``'s ``_stack``; float32 LSTMs
    take oneDNN's layer op, as on CPU), so ``nn.GRU``, ``nn.RNN`` and ``nn.LSTM`` stacks are bit-equal to
    local CPU: outputs, final hiddens and every gradient. (The embedded peer runs its kernels with the
    user's thread count, set here after ``ember.torch`` took it: a GEMM split otherwise rounds otherwise.)"""
    make = {"GRU": nn.GRU, "LSTM": nn.LSTM}.get(cls, nn.RNN)
    if cls == "RNN-relu":
        kw = {**kw, "nonlinearity": "relu"}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ember.connect("local:torch"):
            cpu, remote = _layer_run("cpu", make, dtype, **kw), _layer_run("ember", make, dtype, **kw)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(cpu, remote):
        assert a.dtype == b.dtype and torch.equal(a, b), (a - b).abs().max()


@pytest.mark.parametrize("cls", ["GRU", "LSTM"])
def test_a_layer_call_with_too_few_hidden_states_raises_torch_s_error(cls: str) -> None:
    """A raw ``torch.gru`` / ``torch.lstm`` call with one hidden state for a 2-layer stack: torch's own error, as
    on CPU (the LSTM's CPU layer path once indexed past the states: an IndexError)."""
    def call(device: str) -> str:
        m = getattr(nn, cls)(5, 7, num_layers=2).double().to(device)
        x = torch.randn(4, 3, 5, dtype=torch.float64).to(device)
        h = torch.zeros(1, 3, 7, dtype=torch.float64).to(device)
        fn, hx = (torch.lstm, (h, h)) if cls == "LSTM" else (torch.gru, h)
        with pytest.raises(RuntimeError) as e:
            fn(x, hx, m._flat_weights, True, 2, 0.0, False, False, False)
        return str(e.value)
    with ember.connect("local:torch"):
        assert call("ember") == call("cpu")
