"""ember.torch and the switches PyTorch code relies on: the accelerator, checkpoints, the launcher.

``torch.accelerator`` reports ember; ``torch.load(map_location="ember")`` and a whole pickled
model come back on ember (the file stays a CPU checkpoint, loadable without Ember).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import ember.torch  # noqa: E402,F401
from torch import nn  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def test_torch_accelerator_reports_ember() -> None:
    assert torch.accelerator.is_available()
    assert torch.accelerator.current_accelerator(check_available=True) == torch.device("ember")
    assert torch.accelerator.device_count() == 1
    assert not torch.randn(3).pin_memory().is_pinned()  # pinning for ember is a no-op


def test_load_with_map_location_ember_keeps_values_views_and_parameters(tmp_path: Path) -> None:
    m = nn.Linear(3, 2)
    torch.save({"model": m.state_dict(), "iter": 3, "rows": [m.weight[1], m.weight.detach()],
                "p": nn.Parameter(torch.ones(2))}, tmp_path / "ckpt.pt")
    for where in ("ember", "ember:0", torch.device("ember")):
        ck = torch.load(tmp_path / "ckpt.pt", map_location=where)
        assert ck["iter"] == 3 and isinstance(ck["p"], nn.Parameter) and ck["p"].device.type == "ember"
        for k, v in m.state_dict().items():
            assert ck["model"][k].device.type == "ember" and torch.equal(ck["model"][k].cpu(), v)
        row, w = ck["rows"]
        assert row.untyped_storage() is w.untyped_storage() and torch.equal(row.cpu(), m.weight[1].detach())
    fresh = nn.Linear(3, 2).to("ember")
    fresh.load_state_dict(torch.load(tmp_path / "ckpt.pt", map_location="ember")["model"])
    assert torch.equal(fresh.weight.cpu(), m.weight.detach())


def test_a_whole_pickled_model_saved_from_ember_loads_back_on_ember(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5, bias=False), nn.BatchNorm1d(3))
    model[1].weight = model[0].weight
    model.to("ember")
    torch.save(model, tmp_path / "model.pt")
    back = torch.load(tmp_path / "model.pt", weights_only=False)
    assert back[0].weight.device.type == "ember" and back[2].running_mean.device.type == "ember"
    assert back[1].weight is back[0].weight and len(list(back.parameters())) == 3
    assert "_ember_on_device" not in vars(back[0])
    assert torch.equal(back[0].weight.cpu(), model[0].weight.cpu())
    assert torch.load(tmp_path / "model.pt", weights_only=False, map_location="cpu")[0].weight.device.type == "cpu"
    without_ember = ("import sys; sys.modules['ember'] = None; import torch; "
                     f"m = torch.load({str(tmp_path / 'model.pt')!r}, weights_only=False); print(m[0].weight.device)")
    r = subprocess.run([sys.executable, "-c", without_ember], capture_output=True, text=True, timeout=100)
    assert r.returncode == 0 and r.stdout.strip() == "cpu", r.stderr
