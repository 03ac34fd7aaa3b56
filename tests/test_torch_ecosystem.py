"""ember.torch and the switches PyTorch code relies on: the accelerator, checkpoints, the launcher.

``torch.accelerator`` reports ember; ``torch.load(map_location="ember")`` and a whole pickled
model come back on ember (the file stays a CPU checkpoint, loadable without Ember).
"""

from __future__ import annotations

import runpy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import ember.torch  # noqa: E402,F401
from torch import nn  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def test_torch_accelerator_memory_calls_answer_for_ember() -> None:
    """accelerate's ``free_memory`` (Trainer, accelerate >= 1.16) calls ``torch.accelerator.empty_cache()``: with
    ember the accelerator it failed torch's internal assert ("Allocator for ember is not a DeviceAllocator")."""
    assert torch.accelerator.current_accelerator().type == "ember"
    x = torch.ones(4, device="ember")
    torch.accelerator.empty_cache()
    torch.accelerator.reset_peak_memory_stats()
    torch.accelerator.reset_accumulated_memory_stats()
    assert dict(torch.accelerator.memory_stats()) == {} and torch.accelerator.memory_allocated() == 0
    with pytest.raises(NotImplementedError, match="peer"):
        torch.accelerator.get_memory_info()
    assert x.sum().item() == 4.0


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


def test_save_and_load_work_under_set_default_device_ember(tmp_path: Path) -> None:
    """Ember's own host-side tensors (a checkpoint's bytes, known values) say device="cpu": under
    ``torch.set_default_device("ember")`` they were made on ember and saving failed with WrongDevice."""
    e = torch.arange(6.0).to("ember")
    torch.save({"w": torch.ones(3)}, tmp_path / "cpu.pt")
    torch.set_default_device("ember")
    try:
        torch.save({"e": e, "view": e[2:]}, tmp_path / "ember.pt")
        back = torch.load(tmp_path / "ember.pt", map_location="ember")
        on = torch.load(tmp_path / "cpu.pt", map_location="ember")["w"]
        m = nn.Linear(3, 2)  # made on ember by the default device
        m(torch.ones(1, 3)).sum().backward()
    finally:
        torch.set_default_device(None)
    assert torch.equal(back["e"].cpu(), torch.arange(6.0)) and torch.equal(back["view"].cpu(), torch.arange(2.0, 6))
    assert on.device.type == "ember" and torch.equal(on.cpu(), torch.ones(3))
    assert m.weight.device.type == "ember" and m.weight.grad is not None


def test_distributed_checkpoint_saves_and_loads_with_ember_the_accelerator(tmp_path: Path) -> None:
    """torch.distributed.checkpoint asks the accelerator (ember) for its current stream, for CPU tensors too:
    ``torch.ember.current_stream()`` is the session's one stream."""
    import torch.distributed.checkpoint as dcp
    s = torch.ember.current_stream()
    assert s == torch.ember.current_stream() and s.device_type == "ember"
    for dev in ("cpu", "ember"):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8)).to(dev)
        where = tmp_path / dev
        with pytest.warns(UserWarning, match="single process"):
            dcp.save({"model": m.state_dict()}, checkpoint_id=where)
        torch.manual_seed(1)
        state = {"model": nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8)).to(dev).state_dict()}
        with pytest.warns(UserWarning, match="single process"):
            dcp.load(state, checkpoint_id=where)
        for k, v in m.state_dict().items():
            assert state["model"][k].device.type == dev and torch.equal(state["model"][k].cpu(), v.cpu()), k


@pytest.mark.parametrize("use_buffers", [False, True])
def test_swa_averaged_model_on_a_cpu_peer_averages_as_cpu(use_buffers: bool) -> None:
    """AveragedModel on a CPU peer's tensors takes CPU's per-tensor average (torch sends accelerators down
    CUDA's multi-tensor lerp: 1e-9 off, and failing on BatchNorm's integer counter with use_buffers)."""
    from torch.optim.swa_utils import AveragedModel

    def run(dev: str) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)).to(dev)
        avg = AveragedModel(m, use_buffers=use_buffers)
        g = torch.Generator().manual_seed(2)
        for i in range(3):
            with torch.no_grad():
                for p in m.parameters():
                    p.mul_(1.1).add_(0.013 * (i + 1))
            m(torch.randn(4, 8, generator=g).to(dev))
            avg.update_parameters(m)
        return {k: v.cpu() for k, v in avg.state_dict().items()}
    cpu, ember_ = run("cpu"), run("ember")
    assert all(torch.equal(cpu[k], ember_[k]) for k in cpu)


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



class _RNNModel(nn.Module):  # word_language_model's shape: embedding, LSTM, decoder tied to the embedding
    def __init__(self) -> None:
        super().__init__()
        self.encoder, self.rnn, self.decoder = nn.Embedding(10, 8), nn.LSTM(8, 8, 2), nn.Linear(8, 10)
        self.decoder.weight = self.encoder.weight

    def forward(self, x: Any) -> Any:
        return self.decoder(self.rnn(self.encoder(x))[0])


def test_a_whole_pickled_rnn_model_loads_back_on_ember(tmp_path: Path) -> None:
    """RNN modules pickle through a __getstate__ of their own (word_language_model saves the whole model and
    reloads it for its final evaluation): they come back on ember too, weights tied, output equal."""
    torch.manual_seed(0)
    model = _RNNModel().to("ember")
    x = torch.randint(0, 10, (5, 3)).to("ember")
    torch.save(model, tmp_path / "model.pt")
    back = torch.load(tmp_path / "model.pt", weights_only=False)
    assert {p.device.type for p in back.parameters()} == {"ember"}
    assert back.decoder.weight is back.encoder.weight
    assert torch.equal(back(x).cpu(), model(x).cpu())


SCRIPT = '''
import argparse, torch
p = argparse.ArgumentParser()
p.add_argument("--device", default="cpu")
p.add_argument("--steps", type=int, default=3)
a = p.parse_args()
torch.manual_seed(0)
m = torch.nn.Linear(4, 1).to(a.device)
opt = torch.optim.SGD(m.parameters(), lr=0.1)
for _ in range(a.steps):
    loss = m(torch.randn(8, 4).to(a.device)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
print(__name__, next(m.parameters()).device.type, repr(loss.item()))
'''


@pytest.mark.timeout(180)
def test_ember_run_runs_an_unchanged_script_with_device_ember_on_a_served_peer(tmp_path: Path, capsys: Any,
                                                                              monkeypatch: Any) -> None:
    from test_core_cli import ENV, start_serve
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    monkeypatch.setattr(sys, "argv", [str(script), "--steps", "4"])
    runpy.run_path(str(script), run_name="__main__")  # the same script on local CPU, here
    loss = capsys.readouterr().out.split()[-1]
    serve, addr = start_serve("--device", "torch:cpu", "--no-iroh", "--websocket", "127.0.0.1:0", "--log-level", "debug")
    run = [sys.executable, "-m", "ember.cli.main", "run"]
    try:  # the peer named by --peer, and by EMBER_PEER (two runs at once)
        runs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                for cmd, env in ((run + ["--peer", addr, str(script), "--device=ember", "--steps", "4"], ENV),
                                 (run + [str(script), "--device=ember", "--steps", "4"], {**ENV, "EMBER_PEER": addr}))]
        outs = [r.communicate(timeout=120) for r in runs]
    finally:
        serve.terminate()
        _, log = serve.communicate(timeout=30)
    for r, (out, err) in zip(runs, outs):
        assert r.returncode == 0, err
        assert out.split() == ["__main__", "ember", loss]  # on ember, bit-equal to the CPU run
    assert log.count("session") >= 2, log  # both runs reached the served peer


def test_torch_compile_with_the_default_backend_runs_ember_graphs_on_the_ember_backend() -> None:
    from ember.torch import _patches
    torch.manual_seed(0)
    local = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model.load_state_dict(local.state_dict())
    compiled = torch.compile(model.to("ember"))
    x = torch.randn(3, 4)
    _patches.WARNED_COMPILE.clear()
    with pytest.warns(UserWarning, match='backend="ember"'):
        y = compiled(x.to("ember"))
    y.sum().backward()
    local(x).sum().backward()
    assert torch.equal(y.cpu(), local(x)) and torch.equal(model[0].weight.grad.cpu(), local[0].weight.grad)


@pytest.mark.timeout(90)
def test_ember_serve_serves_websocket_before_iroh_waits_for_its_relays(tmp_path: Path) -> None:
    """`ember serve --device torch:cpu --websocket …` with iroh on and a relay that never answers: the WebSocket
    address is printed, and serves, while iroh still waits (its ticket comes only after its relay wait)."""
    import os
    import socket
    import time
    with socket.socket() as s:  # a relay address that refuses: iroh waits its full relay timeout
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "EMBER_OFFLINE"}
    env.update(PYTHONUNBUFFERED="1", EMBER_KEY=str(tmp_path / "secret.key"))
    p = subprocess.Popen([sys.executable, "-m", "ember.cli", "serve", "--device", "torch:cpu", "--websocket",
                          "127.0.0.1:0", "--relay", f"http://127.0.0.1:{dead}", "--no-discovery",
                          "--bind", "127.0.0.1:0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert p.stdout is not None
        deadline = time.monotonic() + 60
        addr = None
        while addr is None and time.monotonic() < deadline:
            line = p.stdout.readline()
            assert line, f"ember serve ended: {p.stderr.read() if p.stderr else ''}"
            assert "iroh ticket" not in line, "iroh's ticket came before the WebSocket address"
            if line.startswith("ember serve: listening on ws://"):
                addr = line.split()[4]
        assert addr is not None
        told = time.monotonic()
        dev = ember.connect(addr)  # serving already
        try:
            with dev:
                assert (torch.arange(4.0, device="ember") * 2).tolist() == [0.0, 2.0, 4.0, 6.0]
        finally:
            dev.close()
        rest = ""
        while "iroh ticket" not in rest and time.monotonic() < deadline:
            line = p.stdout.readline()
            if not line:
                break
            rest += line
        assert "iroh ticket" in rest, rest + (p.stderr.read() if p.stderr else "")
        assert time.monotonic() - told > 2.0, "the iroh lines came with the WebSocket address (after its relay wait)"
    finally:
        p.terminate()
        p.wait(30)


def test_the_embedded_session_is_never_declared_gone_by_the_heartbeat() -> None:
    """An in-process peer cannot vanish: a stalled I/O loop (a loaded box) is no loss, whatever the heartbeat
    settings (a remote peer's session with these settings is declared lost)."""
    import time

    from ember.client.io import get_loop
    dev = ember.connect("local:torch", heartbeat_interval=0.05, heartbeat_timeout=0.2)
    try:
        with dev:
            x = torch.arange(4.0, device="ember")
            assert (x + 1).tolist() == [1.0, 2.0, 3.0, 4.0]
            get_loop().call_soon_threadsafe(time.sleep, 1.0)  # the loop stalls 5x the heartbeat timeout
            assert (x * 2).tolist() == [0.0, 2.0, 4.0, 6.0] and dev.session.lost is None
    finally:
        dev.close()


_FORK_SCRIPT = r"""
import os, torch, ember.torch
from ember.errors import SessionLost
x = torch.arange(4.0, device="ember")
assert (x + 1).tolist() == [1.0, 2.0, 3.0, 4.0]
pid = os.fork()
if pid == 0:
    try:
        (x * 2).tolist()
        os._exit(3)
    except SessionLost as e:
        ok = "forked" in str(e)
    os._exit(0 if ok and torch.ones(2, device="ember").tolist() == [1.0, 1.0] else 4)
_, status = os.waitpid(pid, 0)
assert (x + 1).tolist() == [1.0, 2.0, 3.0, 4.0]
print("CHILD", os.waitstatus_to_exitcode(status))
"""


@pytest.mark.timeout(120)
def test_a_forked_child_gets_a_typed_error_for_its_parent_s_embedded_session() -> None:
    """A child forked from a process using the embedded peer once waited forever on the parent's session; it
    gets ``SessionLost`` saying why, new work in it starts its own embedded peer, and the parent carries on."""
    import os
    r = subprocess.run([sys.executable, "-c", _FORK_SCRIPT], capture_output=True, text=True, timeout=100,
                       env={**os.environ, "EMBER_OFFLINE": "1"})
    assert r.returncode == 0 and "CHILD 0" in r.stdout, r.stdout + r.stderr[-2000:]
