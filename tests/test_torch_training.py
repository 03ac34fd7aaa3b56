"""ember.torch: unchanged training loops on a remote torch:cpu peer equal the same loops on local CPU torch.

Bit for bit (same seeds, same initial weights), over the embedded peer (in-memory link), real
WebSocket and real iroh on loopback.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from typing import Any, Iterator

import pytest

torch = pytest.importorskip("torch")

import ember  # noqa: E402
import ember.torch  # noqa: E402,F401
from ember.server import Server  # noqa: E402
from ember.torch import workloads as W  # noqa: E402

pytestmark = pytest.mark.timeout(120)

CASES: dict[str, dict[str, Any]] = {
    "mlp-sgd-momentum": dict(model=W.MLP, opt="SGD", opt_args={"lr": 0.05, "momentum": 0.9}),
    "mlp-adamw": dict(model=W.MLP, opt="AdamW", opt_args={"lr": 0.01}),
    "mlp-adamw-foreach": dict(model=W.MLP, opt="AdamW", opt_args={"lr": 0.01, "foreach": True}),
    "mlp-adamw-fused": dict(model=W.MLP, opt="AdamW", opt_args={"lr": 0.01, "fused": True}),
    "mlp-accumulate-clip-scheduler": dict(model=W.MLP, opt="SGD", opt_args={"lr": 0.1}, accumulate=2, clip=0.5,
                                          scheduler=True),
    "cnn-batchnorm-dropout": dict(model=W.CNN, batch=W.image_batch(), steps=4),
    "transformer-lm": dict(model=W.TinyLM, batch=W.lm_batch(), lm=True, opt="AdamW", opt_args={"lr": 3e-3},
                           steps=4),
}


def same(a: tuple[list[float], list[Any]], b: tuple[list[float], list[Any]]) -> None:
    assert a[0] == b[0], f"losses differ: {a[0]} vs {b[0]}"
    assert len(a[1]) == len(b[1])
    for p, q in zip(a[1], b[1]):
        assert torch.equal(p, q), f"parameters differ by {(p - q).abs().max().item()}"


@pytest.fixture(scope="module")
def peers() -> Iterator[dict[str, str]]:
    """One torch:cpu peer serving WebSocket and iroh (offline, loopback) for the whole module."""
    srv = Server(["torch:cpu"])
    srv.listen_websocket("127.0.0.1", 0)
    srv.listen_iroh(offline=True, bind=["127.0.0.1:0", "[::1]:0"])
    srv.start_in_thread()
    ws = next(a for a in srv.addresses if a.startswith("ws://"))
    ticket = next(a for a in srv.addresses if a.startswith("endpoint"))
    yield {"websocket": ws, "iroh": ticket}
    srv.close()


@pytest.mark.parametrize("case", sorted(CASES))
def test_training_equals_local_cpu_on_the_embedded_peer(case: str) -> None:
    kw = dict(steps=6, **CASES[case]) if "steps" not in CASES[case] else CASES[case]
    same(W.train(device="cpu", **kw), W.train(device="ember", **kw))


@pytest.mark.parametrize("transport", ["websocket", "iroh"])
@pytest.mark.parametrize("case", ["mlp-adamw", "transformer-lm"])
def test_training_equals_local_cpu_over_real_transports(peers: dict[str, str], transport: str, case: str) -> None:
    dev = ember.connect(peers[transport])
    try:
        kw = dict(steps=4, **{k: v for k, v in CASES[case].items() if k != "steps"})
        local = W.train(device="cpu", **kw)
        with dev:
            remote = W.train(device="ember", **kw)
        same(local, remote)
        assert ember.torch.device_of(torch.zeros(1, device="ember")) is not dev  # outside `with`: default
    finally:
        dev.close()


def _cnn_eval(device: str) -> tuple[Any, Any, Any]:
    torch.manual_seed(0)
    m = W.CNN().to(device)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 1, 28, 28, generator=g).to(device)
    m.train()
    m(x)  # updates the batch-norm running statistics
    m.eval()
    with torch.no_grad():
        a = m(x).cpu()
    with torch.inference_mode():
        b = m(x).cpu()
    return a, b, [t.detach().cpu() for t in m.state_dict().values()]


def test_eval_no_grad_and_inference_mode_equal_local() -> None:
    local, remote = _cnn_eval("cpu"), _cnn_eval("ember")
    assert torch.equal(local[0], remote[0]) and torch.equal(local[1], remote[1])
    assert all(torch.equal(p, q) for p, q in zip(local[2], remote[2]))


def test_state_dict_round_trip_through_a_file_into_a_cpu_model(tmp_path: Any) -> None:
    torch.manual_seed(0)
    model = W.TinyLM().to("ember")
    W.train(lambda: model, "ember", steps=2, batch=W.lm_batch(), lm=True, opt="AdamW", opt_args={"lr": 1e-2})
    path = tmp_path / "ckpt.pt"
    torch.save(model.state_dict(), path)
    # a process without Ember loads the checkpoint (tensors were saved as CPU tensors)
    code = ("import sys, torch; sd = torch.load(sys.argv[1], weights_only=True); "
            "assert all(t.device.type == 'cpu' for t in sd.values()); "
            "assert 'ember' not in sys.modules; print(len(sd))")
    r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": ""})
    assert r.returncode == 0, r.stderr
    assert int(r.stdout) == len(model.state_dict())
    cpu_model = W.TinyLM()
    cpu_model.load_state_dict(torch.load(path, weights_only=True))
    idx = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(cpu_model(idx), model(idx.to("ember")).cpu())
    # and back into an ember model
    again = W.TinyLM().to("ember")
    again.load_state_dict(torch.load(path, weights_only=True))
    with torch.no_grad():
        assert torch.equal(again(idx.to("ember")).cpu(), cpu_model(idx))


def test_parameters_stay_parameters_and_deepcopy_works() -> None:
    torch.manual_seed(0)
    m = W.MLP().to("ember")
    assert all(type(p) is torch.nn.Parameter and p.device.type == "ember" for p in m.parameters())
    twin = copy.deepcopy(m)
    x = torch.randn(3, 8).to("ember")
    assert torch.equal(twin(x).cpu(), m(x).cpu())
    with torch.no_grad():
        next(twin.parameters()).add_(1.0)
    assert not torch.equal(twin(x).cpu(), m(x).cpu())  # a copy, not an alias


@pytest.mark.parametrize("workers", [0, 2])
def test_dataloader_with_pin_memory_works_for_the_ember_accelerator(workers: int) -> None:
    assert torch.accelerator.is_available() and torch.accelerator.current_accelerator().type == "ember"
    ds = torch.utils.data.TensorDataset(torch.randn(16, 8), torch.randint(0, 4, (16,)))
    loader = torch.utils.data.DataLoader(ds, batch_size=8, pin_memory=True, num_workers=workers)
    m = W.MLP().to("ember")
    seen = 0
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "no accelerator is found": pinning for ember is a no-op
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(m(x.to("ember")), y.to("ember"))
            loss.backward()
            seen += 1
    assert seen == 2 and isinstance(loss.item(), float)


@pytest.mark.timeout(180)
def test_ember_demo_torch_runs_and_matches_local_torch() -> None:
    r = subprocess.run([sys.executable, "-m", "ember.cli", "demo", "--torch", "--steps", "60"], capture_output=True,
                       text=True, timeout=170)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "every loss equals local CPU torch's" in r.stdout and "steps/s" in r.stdout and "ATen ops" in r.stdout


def test_an_unsupported_torch_fails_at_import_with_the_versions_that_work() -> None:
    code = ("import torch; del torch._C._acc\n"
            "try:\n    import ember.torch\nexcept ImportError as e:\n    print(type(e).__name__, e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "UnsupportedTorch" in r.stdout and "tested with torch 2.13" in r.stdout, r.stdout + r.stderr
