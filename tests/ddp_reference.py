"""torch's own DistributedDataParallel over gloo, one process per rank: the reference the mesh tests
(tests/test_mesh.py) and the mesh benchmark compare with. Not a test module (no ``test_`` prefix).

``python tests/ddp_reference.py RANK WORLD PORT OUT STEPS``: trains :func:`make_mlp` on rank's shard
of :func:`batches` with SGD; rank 0 saves the parameters (and the steps/s) to OUT. ``DDP_REFERENCE_MODEL=gpt``:
a small GPT on token batches instead of the MLP (the process reads it at import, as the test does); ``bn``: an MLP
with BatchNorm and an unused layer, SGD with weight decay. Every rank saves its buffers to OUT.buffersRANK."""

from __future__ import annotations

import datetime
import os
import sys
import time

import torch
import torch.nn.functional as F

BATCH, DIM, OUT = 16, 12, 4
HIDDEN = int(os.environ.get("DDP_REFERENCE_HIDDEN", "32"))  # the benchmark trains a wider MLP
MODEL = os.environ.get("DDP_REFERENCE_MODEL", "mlp")       # or "gpt": a small GPT (tied embedding/head)
VOCAB, CTX, EMBD, HEADS = 32, 8, 16, 2


def make_mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(DIM, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, HIDDEN),
                               torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT))


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(EMBD), torch.nn.LayerNorm(EMBD)
        self.qkv, self.proj = torch.nn.Linear(EMBD, 3 * EMBD), torch.nn.Linear(EMBD, EMBD)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(EMBD, 4 * EMBD), torch.nn.GELU(), torch.nn.Linear(4 * EMBD, EMBD))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(EMBD, dim=2)
        q, k, v = (t.view(B, T, HEADS, C // HEADS).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).contiguous().view(B, T, C)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


class GPT(torch.nn.Module):
    """nanoGPT's shape in miniature (the output head shares the token embedding's weight)."""

    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = torch.nn.Embedding(VOCAB, EMBD), torch.nn.Embedding(CTX, EMBD)
        self.ln_f, self.blocks = torch.nn.LayerNorm(EMBD), torch.nn.Sequential(Block())
        self.lm_head = torch.nn.Linear(EMBD, VOCAB, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.lm_head(self.ln_f(self.blocks(self.wte(idx) + self.wpe(pos))))


class WithBatchNorm(torch.nn.Module):
    """BatchNorm's running statistics (DDP broadcasts rank 0's before every forward) and a parameter the forward
    never uses (DDP(find_unused_parameters=True) leaves its gradient None: weight decay does not move it)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.bn = torch.nn.Linear(DIM, HIDDEN), torch.nn.BatchNorm1d(HIDDEN)
        self.b = torch.nn.Linear(HIDDEN, OUT)
        self.unused = torch.nn.Linear(HIDDEN, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.bn(self.a(x))))


def make_model(kind: str = MODEL) -> torch.nn.Module:
    if kind == "gpt":
        torch.manual_seed(0)
        return GPT()
    if kind == "bn":
        torch.manual_seed(0)
        return WithBatchNorm()
    return make_mlp()


def make_optimizer(params: object, kind: str = MODEL) -> torch.optim.Optimizer:
    """SGD; with weight decay for the BatchNorm net (an unused parameter given a zero gradient would move)."""
    return torch.optim.SGD(params, lr=0.1, weight_decay=0.1 if kind == "bn" else 0.0)  # type: ignore[arg-type]


def batches(steps: int, batch: int = BATCH, kind: str = MODEL) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    if kind == "gpt":
        data = torch.randint(VOCAB, (steps * batch * (CTX + 1),), generator=g).view(steps, batch, CTX + 1)
        return [(d[:, :-1].contiguous(), d[:, 1:].contiguous()) for d in data]
    return [(torch.randn(batch, DIM, generator=g), torch.randn(batch, OUT, generator=g)) for _ in range(steps)]


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, kind: str = MODEL) -> torch.Tensor:
    if kind == "gpt":
        return F.cross_entropy(model(x).view(-1, VOCAB), y.view(-1))
    return F.mse_loss(model(x), y)


def main(rank: int, world: int, port: int, out: str, steps: int, batch: int = BATCH) -> None:
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    model = torch.nn.parallel.DistributedDataParallel(make_model(), find_unused_parameters=MODEL == "bn")
    model.register_comm_hook(None, default_hooks.allreduce_hook)  # divide by world, then SUM
    opt = make_optimizer(model.parameters())
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
    torch.save([b.detach().clone() for b in model.module.buffers()], f"{out}.buffers{rank}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5]),
         *(int(a) for a in sys.argv[6:7]))
    sys.stdout.flush()
    sys.stderr.flush()
    # done (the result is saved): leave without C++ static destructors, which can race gloo's threads at exit
    # ("terminate called without an active exception", SIGABRT: seen once in CI, on rank 1)
    os._exit(0)
