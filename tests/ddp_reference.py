"""torch's own DistributedDataParallel over gloo, one process per rank: the reference the mesh tests
(tests/test_mesh.py) and the mesh benchmark compare with. Not a test module (no ``test_`` prefix).

``python tests/ddp_reference.py RANK WORLD PORT OUT STEPS``: trains :func:`make_mlp` on rank's shard
of :func:`batches` with SGD; rank 0 saves the parameters (and the steps/s) to OUT."""

from __future__ import annotations

import datetime
import os
import sys
import time

import torch
import torch.nn.functional as F

BATCH, DIM, OUT = 16, 12, 4
HIDDEN = int(os.environ.get("DDP_REFERENCE_HIDDEN", "32"))  # the benchmark trains a wider MLP


def make_mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(DIM, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, HIDDEN),
                               torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT))


def batches(steps: int, batch: int = BATCH) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, DIM, generator=g), torch.randn(batch, OUT, generator=g)) for _ in range(steps)]


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x), y)


def main(rank: int, world: int, port: int, out: str, steps: int, batch: int = BATCH) -> None:
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    model = torch.nn.parallel.DistributedDataParallel(make_mlp())
    model.register_comm_hook(None, default_hooks.allreduce_hook)  # divide by world, then SUM
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = batches(steps, batch)
    t0 = 0.0
    for i, (x, y) in enumerate(data):
        if i == 1:
            t0 = time.perf_counter()
        xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
        opt.zero_grad()
        loss_of(model, xs, ys).backward()
        opt.step()
    dist.barrier()
    rate = (steps - 1) / (time.perf_counter() - t0) if steps > 1 else 0.0
    if rank == 0:
        torch.save({"params": [p.detach().clone() for p in model.module.parameters()], "steps_per_s": rate}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5]),
         *(int(a) for a in sys.argv[6:7]))
