"""The mesh's NCCL paths on a GPU machine (not run by the test suite: this box has no GPU).

``python bench/check_nccl.py`` starts one `ember serve --device torch:cuda:I --collectives` per GPU
(at least one; NCCL cannot hold two ranks on one GPU), forms a mesh with ``backend="nccl"`` and checks:
every collective (sync and async, coalesced), a poisoned rank, the barrier on the peer's own device,
and DataParallel steps equal to the same steps on CPU torch (allclose: cuBLAS is not the CPU's).
Prints one line per check and exits 1 on the first failure. ``--cpu N``: the same checks on N
`torch:cpu` peers over gloo (a dry run of this script where there is no GPU)."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

import ember
import ember.torch
from ember.bench.server_process import serve_collectives
from ember.errors import RemoteExecutionError

ENV = {**os.environ, "EMBER_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


CPU = int(sys.argv[sys.argv.index("--cpu") + 1]) if "--cpu" in sys.argv else 0
if CPU:
    ENV["GLOO_SOCKET_IFNAME"] = "lo"


def peer(gpu: int) -> tuple[subprocess.Popen, str]:
    return serve_collectives("torch:cpu" if CPU else f"torch:cuda:{gpu}", ENV)


def check(name: str, ok: bool) -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name}", flush=True)
    if not ok:
        raise SystemExit(1)


def main() -> None:
    n = CPU or torch.cuda.device_count()
    if n < 1:
        raise SystemExit("no CUDA device (--cpu N: a dry run on CPU peers)")
    procs = [peer(i) for i in range(n)]
    try:
        mesh = ember.torch.mesh([a for _, a in procs], backend="gloo" if CPU else "nccl", timeout=60)
        with mesh:
            x = mesh.shard(torch.arange(2.0 * n).reshape(n, 2))  # rank r: [2r, 2r + 1]
            s = x.clone()
            mesh.all_reduce(s)
            want = torch.arange(2.0 * n).reshape(n, 2).sum(0, keepdim=True)
            check("all_reduce", torch.equal(s.cpu(), want))
            a, b = x.clone(), x.clone() * 2
            w = mesh.all_reduce(a, b, async_op=True)
            w.wait()
            check("coalesced async all_reduce", torch.equal(a.cpu(), want) and torch.equal(b.cpu(), want * 2))
            c = x.clone()
            mesh.broadcast(c, src=n - 1)
            check("broadcast", c.cpu().tolist() == [[2.0 * (n - 1), 2.0 * n - 1]])
            g = torch.empty(2 * n, device="ember")
            mesh.all_gather_into_tensor(g, x.reshape(-1).clone())
            check("all_gather", g.cpu().tolist() == [float(i) for i in range(2 * n)])
            mesh.barrier()
            check("barrier", True)
            bad = torch.index_select(torch.ones(2, 2, device="ember"), 0, mesh.shard(torch.tensor([0] * (n - 1) + [9])))
            mesh.all_reduce(bad)
            try:
                bad.cpu()
                check("a poisoned rank poisons every rank", False)
            except RemoteExecutionError as e:
                check("a poisoned rank poisons every rank", "poisoned on a peer" in e.message or n == 1)
            torch.manual_seed(0)
            net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))
            ref = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))
            ref.load_state_dict(net.state_dict())
            model = ember.torch.DataParallel(net.to("ember"))
            opt, ropt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
            gen = torch.Generator().manual_seed(1)
            for _ in range(5):
                xb, yb = torch.randn(4 * n, 8, generator=gen), torch.randn(4 * n, 2, generator=gen)
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(mesh.shard(xb)), mesh.shard(yb)).backward()
                opt.step()
                ropt.zero_grad()
                torch.nn.functional.mse_loss(ref(xb), yb).backward()
                ropt.step()
            got = [p.detach().cpu() for p in model.parameters()]
            check("DataParallel over NCCL ~ CPU torch on the whole batch",
                  all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got, ref.parameters())))
            check("steps replayed as graphs", mesh.session.leader.stats["replays"] >= 2)
        mesh.close()
    finally:
        for p, _ in procs:
            p.kill()


if __name__ == "__main__":
    main()
