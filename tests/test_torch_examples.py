"""Training patterns of pytorch/examples, run on ember next to local CPU torch.

* ``mnist``: a small CNN (conv, max-pool, flatten, linear, log-softmax, NLL) with ``Adadelta`` and a
  ``StepLR`` schedule -- bit-equal to local CPU on the embedded peer and over WebSocket (dropout is left out: the
  peer draws from its own generator, as CUDA does).
* ``time_sequence_prediction``: ``LBFGS`` with a closure that reads its loss (``loss.item()``) at every
  evaluation, float64 -- bit-equal for a model of linear layers; with ``nn.LSTMCell`` equal to rounding only
  (torch sends a non-CPU device through CUDA's fused cell, ``_thnn_fused_lstm_cell``).
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

import ember  # noqa: E402
import ember.torch  # noqa: E402,F401
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

pytestmark = pytest.mark.timeout(180)


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 8, 3, 1), nn.Conv2d(8, 16, 3, 1)
        self.fc1, self.fc2 = nn.Linear(16 * 5 * 5, 32), nn.Linear(32, 10)

    def forward(self, x: Any) -> Any:
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        return F.log_softmax(self.fc2(F.relu(self.fc1(torch.flatten(x, 1)))), dim=1)


def train_cnn(device: str) -> tuple[list[float], dict[str, Any]]:
    torch.manual_seed(1)
    model = SmallCNN().to(device)
    opt = torch.optim.Adadelta(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    g = torch.Generator().manual_seed(0)
    losses = []
    for _epoch in range(2):
        for _ in range(4):
            x, y = torch.randn(16, 1, 14, 14, generator=g), torch.randint(0, 10, (16,), generator=g)
            x, y = x.to(device), y.to(device)
            opt.zero_grad()
            loss = F.nll_loss(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        sched.step()
    return losses, {k: v.detach().cpu() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("peer", ["embedded", "websocket"])
def test_a_cnn_with_adadelta_and_steplr_trains_bit_equal_to_local_cpu(peer: str, torch_peer: str) -> None:
    want = train_cnn("cpu")
    with ember.connect("local:torch" if peer == "embedded" else torch_peer):
        got = train_cnn("ember")
    assert got[0] == want[0]
    assert all(torch.equal(got[1][k], want[1][k]) for k in want[1])


class Cells(nn.Module):
    def __init__(self, cell: bool) -> None:
        super().__init__()
        self.cell = nn.LSTMCell(1, 12) if cell else None
        self.inp, self.out = nn.Linear(1, 12), nn.Linear(12, 1)

    def forward(self, seq: Any) -> Any:
        h = torch.zeros(seq.size(0), 12, dtype=seq.dtype, device=seq.device)
        c = torch.zeros_like(h)
        outs = []
        for x in seq.split(1, dim=1):
            h, c = self.cell(x, (h, c)) if self.cell is not None else (torch.tanh(self.inp(x) + h), c)
            outs.append(self.out(h))
        return torch.cat(outs, dim=1)


def fit_lbfgs(device: str, cell: bool) -> list[float]:
    torch.manual_seed(0)
    t = torch.arange(24, dtype=torch.float64)
    data = torch.sin((t[None, :] + torch.arange(6, dtype=torch.float64)[:, None] * 3) / 4)
    seq, target = data[:, :-1].to(device), data[:, 1:].to(device)
    model = Cells(cell).double().to(device)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.8, max_iter=6)
    losses: list[float] = []

    def closure() -> Any:
        opt.zero_grad()
        loss = F.mse_loss(model(seq), target)
        losses.append(loss.item())
        loss.backward()
        return loss
    for _ in range(2):
        opt.step(closure)
    return losses


@pytest.mark.parametrize("cell", [False, True], ids=["linear", "lstm-cell"])
def test_lbfgs_with_a_closure_that_reads_its_loss(cell: bool) -> None:
    want = fit_lbfgs("cpu", cell)
    with ember.connect("local:torch"):
        got = fit_lbfgs("ember", cell)
    assert len(got) == len(want) > 2
    if cell:  # the fused cell: the same numbers to rounding
        assert got == pytest.approx(want, rel=1e-9)
    else:
        assert got == want
