"""torch.autocast("ember"): CUDA's mixed-precision policy on ember tensors (ember/torch/_autocast.py),
and a GradScaler training loop."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
nn, F = torch.nn, torch.nn.functional

import ember  # noqa: E402
import ember.torch  # noqa: E402,F401

pytestmark = pytest.mark.timeout(120)


def test_each_op_gets_cuda_s_autocast_policy() -> None:
    x, w = torch.randn(4, 8).to("ember"), torch.randn(3, 8).to("ember")
    with torch.autocast("ember", dtype=torch.bfloat16):
        y = F.linear(x, w)
        got = {"linear": y, "matmul": x @ w.t(), "sdpa": F.scaled_dot_product_attention(*[torch.randn(1, 2, 4, 8).to(
                   "ember")] * 3),
               "softmax": torch.softmax(y, 1), "log_softmax": F.log_softmax(y, -1), "sum": y.sum(),
               "sum(dim)": y.sum(1), "exp": y.exp(), "layer_norm": F.layer_norm(y, (3,)), "norm": y.norm(),
               "norm(dim)": y.norm(dim=1), "cross_entropy": F.cross_entropy(y, torch.tensor([0, 1, 2, 0]).to("ember")),
               "add": y + y, "relu": y.relu(), "sum(dtype=bf16)": y.sum(dtype=torch.bfloat16),
               "addcmul(f32, bf16, f32)": torch.addcmul(x, y[:, :1].expand(4, 8), x),
               "float64 matmul": x.double() @ w.double().t()}
    want = {"linear": "bfloat16", "matmul": "bfloat16", "sdpa": "bfloat16", "softmax": "float32",
            "log_softmax": "float32", "sum": "float32", "sum(dim)": "float32", "exp": "float32",
            "layer_norm": "float32", "norm": "float32", "norm(dim)": "float32", "cross_entropy": "float32",
            "add": "bfloat16", "relu": "bfloat16", "sum(dtype=bf16)": "bfloat16",
            "addcmul(f32, bf16, f32)": "float32", "float64 matmul": "float64"}
    assert {k: str(v.dtype)[6:] for k, v in got.items()} == want
    assert F.linear(x, w).dtype is torch.float32  # outside the region: as before
    torch.testing.assert_close(got["linear"].float().cpu(), F.linear(x, w).cpu(), rtol=2e-2, atol=2e-2)


def test_binary_cross_entropy_is_refused_as_on_cuda_and_the_session_carries_on() -> None:
    p = torch.sigmoid(torch.randn(4, 3).to("ember"))
    with torch.autocast("ember", dtype=torch.bfloat16):
        with pytest.raises(RuntimeError, match="unsafe to autocast.*binary_cross_entropy_with_logits"):
            F.binary_cross_entropy(p, torch.rand(4, 3).to("ember"))
    assert float(F.binary_cross_entropy(p, torch.zeros(4, 3).to("ember"))) > 0


def _loop(device: str, dtype: Any, scaler: Any = None, steps: int = 8) -> list[float]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 3)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 8, generator=g).to(device), torch.randint(0, 3, (64,), generator=g).to(device)
    losses = []
    for _ in range(steps):
        with torch.autocast(device.split(":")[0], dtype=dtype):
            loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        losses.append(loss.item())
    return losses


def test_bfloat16_training_over_websocket_tracks_local_cpu_autocast(torch_peer: str) -> None:
    local = _loop("cpu", torch.bfloat16)
    with ember.connect(torch_peer):
        remote = _loop("ember", torch.bfloat16)
    assert remote[-1] < remote[0] * 0.9
    for a, b in zip(local, remote):  # CPU's policy differs a little from CUDA's: bfloat16 rounding apart
        assert b == pytest.approx(a, rel=3e-2)


def test_float16_training_with_a_grad_scaler(torch_peer: str) -> None:
    with ember.connect(torch_peer):
        scaler = torch.amp.GradScaler("ember", init_scale=2.0 ** 10)
        losses = _loop("ember", torch.float16, scaler)
        assert scaler.get_scale() >= 2.0 ** 10  # no step skipped for overflow: finite gradients
    assert losses[-1] < losses[0] * 0.9
