"""Steps/s of DataParallel on a 2-peer mesh vs one peer with the same global batch, vs torch's
DistributedDataParallel over gloo in two local processes (tests/ddp_reference.py), in one run.

``python bench/bench_mesh.py [STEPS] [GLOBAL_BATCH] [HIDDEN]`` (peers: `ember serve --collectives`)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
STEPS, BATCH, HIDDEN = (int(a) for a in (sys.argv[1:] + ["30", "256", "512"][len(sys.argv) - 1:])[:3])
os.environ["DDP_REFERENCE_HIDDEN"] = str(HIDDEN)
ENV = {**os.environ, "EMBER_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "GLOO_SOCKET_IFNAME": "lo",
       "OMP_NUM_THREADS": "1"}
sys.path.insert(0, str(HERE.parent / "tests"))

import torch  # noqa: E402

import ember  # noqa: E402
import ember.torch  # noqa: E402
from ddp_reference import batches, loss_of, make_mlp  # noqa: E402


def peer() -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen([sys.executable, "-m", "ember.cli.main", "serve", "--device", "torch:cpu", "--collectives",
                          "--no-iroh", "--tcp", "127.0.0.1:0"], stdout=subprocess.PIPE, text=True, env=ENV)
    assert p.stdout is not None
    for line in p.stdout:
        found = re.search(r"listening on (tcp://\S+)", line)
        if found:
            return p, found.group(1)
    raise SystemExit("ember serve printed no address")


def train(dev: ember.Device, mesh: bool) -> tuple[float, float]:
    """(steps/s, client CPU seconds per step)."""
    data = batches(STEPS, BATCH)
    with dev:
        model = make_mlp().to("ember")
        if mesh:
            model = ember.torch.DataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        t0 = 0.0
        for i, (x, y) in enumerate(data):
            if i == 1:
                dev.sync()
                t0, c0 = time.perf_counter(), time.process_time()
            xs, ys = (dev.shard(x), dev.shard(y)) if mesh else (x.to("ember"), y.to("ember"))
            opt.zero_grad()
            loss_of(model, xs, ys).backward()
            opt.step()
        dev.sync()
        return (STEPS - 1) / (time.perf_counter() - t0), (time.process_time() - c0) / (STEPS - 1)


def ddp() -> float:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    out = os.path.join(tempfile.mkdtemp(), "ref.pt")
    procs = [subprocess.Popen([sys.executable, str(HERE.parent / "tests" / "ddp_reference.py"), str(r), "2",
                               str(port), out, str(STEPS), str(BATCH)], env=ENV) for r in range(2)]
    for p in procs:
        p.wait(600)
    return float(torch.load(out)["steps_per_s"])


def main() -> None:
    procs = [peer(), peer()]
    try:
        addrs = [a for _, a in procs]
        one = ember.connect(addrs[0])
        single, cpu1 = train(one, False)
        one.close()
        m = ember.torch.mesh(addrs, timeout=60)
        meshed, cpu2 = train(m, True)
        m.close()
        ref = ddp()
        print(f"MLP {make_mlp()}\nglobal batch {BATCH}, hidden {HIDDEN}, {STEPS} steps (first not timed)")
        print(f"one peer, whole batch:        {single:8.2f} steps/s")
        print(f"2-peer mesh, DataParallel:    {meshed:8.2f} steps/s  ({meshed / single:.2f}x one peer)")
        print(f"client CPU per step: one peer {cpu1 * 1e3:.2f} ms, mesh {cpu2 * 1e3:.2f} ms ({cpu2 / cpu1:.2f}x)")
        print(f"torch DDP gloo, 2 processes:  {ref:8.2f} steps/s  (mesh / DDP = {meshed / ref:.2f})")
    finally:
        for p, _ in procs:
            p.kill()


if __name__ == "__main__":
    main()
