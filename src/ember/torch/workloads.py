"""Small, deterministic PyTorch workloads: the same loop runs on ``"cpu"`` and on ``"ember"``.

Used by the tests (remote == local, bit for bit on a torch:cpu peer), ``ember demo --torch``
and the benchmarks. Each loop seeds torch once before building the model and once after
moving it (the peer's generator is not the local one, as with CUDA), draws its data from a
private CPU generator, and returns the losses read every ``read_every`` steps and the
final parameters on the CPU.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Sequential):
    def __init__(self, d_in: int = 8, hidden: int = 16, classes: int = 4) -> None:
        super().__init__(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, classes))


class CNN(nn.Module):
    """Conv2d, BatchNorm2d, MaxPool2d, Dropout and ReLU on 1x28x28 images."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.c1, self.bn = nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.c2, self.drop, self.fc = nn.Conv2d(8, 16, 3), nn.Dropout(0.25), nn.Linear(16 * 6 * 6, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn(self.c1(x))), 2)
        x = F.max_pool2d(F.relu(self.c2(x)), 2)
        return self.fc(self.drop(torch.flatten(x, 1)))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    """A causal transformer language model: embeddings, LayerNorm, attention (SDPA), GELU."""

    def __init__(self, vocab: int = 50, d: int = 32, heads: int = 4, layers: int = 2, ctx: int = 16) -> None:
        super().__init__()
        self.vocab = vocab
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def classification_batch(g: torch.Generator, n: int, shape: tuple[int, ...], classes: int) -> Any:
    return torch.randn(n, *shape, generator=g), torch.randint(0, classes, (n,), generator=g)


def train(model: Callable[[], nn.Module], device: str, *, steps: int = 10, opt: str = "SGD",
          opt_args: dict[str, Any] | None = None, batch: Callable[[torch.Generator], Any] | None = None,
          lm: bool = False, read_every: int = 1, clip: float | None = None, accumulate: int = 1,
          scheduler: bool = False, seed: int = 0, nan_filter: bool = False) -> tuple[list[float], list[torch.Tensor]]:
    """One training loop, unchanged between devices; returns (losses, final parameters on the CPU).
    ``nan_filter``: after each backward, read ``torch.isnan`` and ``torch.isinf`` of the loss, as Hugging Face's
    Trainer does every step (``logging_nan_inf_filter``)."""
    torch.manual_seed(seed)
    m = model().to(device)
    torch.manual_seed(seed + 1)
    o = getattr(torch.optim, opt)(m.parameters(), **(opt_args or {"lr": 0.01}))
    sched = torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) if scheduler else None
    g = torch.Generator().manual_seed(seed + 2)
    batch = batch or (lambda gen: classification_batch(gen, 32, (8,), 4))
    losses: list[float] = []
    for step in range(steps):
        o.zero_grad(set_to_none=True)
        for _ in range(accumulate):
            x, y = batch(g)
            x, y = x.to(device), y.to(device)
            out = m(x)
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)) if lm else F.cross_entropy(out, y)
            (loss / accumulate).backward()
            if nan_filter and (torch.isnan(loss.detach()) or torch.isinf(loss.detach())):
                raise FloatingPointError(f"the loss is {loss.item()} at step {step}")
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
        o.step()
        if sched is not None:
            sched.step()
        if (step + 1) % read_every == 0:
            losses.append(loss.item())
    return losses, [p.detach().cpu() for p in m.parameters()]


def lm_batch(vocab: int = 50, n: int = 4, ctx: int = 16) -> Callable[[torch.Generator], Any]:
    def draw(g: torch.Generator) -> Any:
        idx = torch.randint(0, vocab, (n, ctx + 1), generator=g)
        return idx[:, :-1], idx[:, 1:]
    return draw


def image_batch(n: int = 16) -> Callable[[torch.Generator], Any]:
    return lambda g: classification_batch(g, n, (1, 28, 28), 10)


__all__ = ["MLP", "CNN", "TinyLM", "train", "lm_batch", "image_batch", "classification_batch"]
