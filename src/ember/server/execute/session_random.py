"""A session's random stream on one torch device, never the process-wide generator.

A random ATen op runs on the session's own ``torch.Generator``: ops with a ``generator=``
twin overload (``randn`` -> ``randn.generator``) take it, ``native_dropout`` is computed as
torch's CPU kernel computes it (``bernoulli_`` of a like-shaped mask, then ``x * (mask *
scale)``: bit-equal) from it, and ops that draw nothing for their arguments (attention with
``dropout_p == 0``, ``_fused_sdp_choice``) run as they are. So an embedded peer, in the
user's process, never reads or advances the user's ``torch.default_generator``. Only an op
with none of these routes (none that a CPU peer runs) is run on the device's default generator,
swapped in and out under a lock.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch

_locks: dict[str, threading.Lock] = {}
_DRAW_NOTHING = frozenset({"_fused_sdp_choice"})


class SessionRandom:
    """A session's random stream on one device (reseeded by ``torch.seed``)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.lock = _locks.setdefault(str(device), threading.Lock())

    def runner(self, op: Any) -> Callable[[list[Any], dict[str, Any]], Any]:
        """How to run ``op`` (a seeded overload without a generator argument) on this stream."""
        packet, name = op.overloadpacket, op._schema.name.split("::")[1]
        args = [a.name for a in op._schema.arguments]
        for ov in packet.overloads():
            twin = getattr(packet, ov)
            names = [a.name for a in twin._schema.arguments]
            if "generator" in names and [n for n in names if n != "generator"] == args:
                return lambda a, k: twin(*a, **k, generator=self.generator)
        if op is torch.ops.aten.native_dropout.default:
            return self._native_dropout
        if name in _DRAW_NOTHING:
            return lambda a, k: op(*a, **k)
        if "dropout_p" in args:  # attention kernels: random only with dropout
            at = args.index("dropout_p")
            return lambda a, k: op(*a, **k) if (a[at] if at < len(a) else k.get("dropout_p", 0.0)) == 0 \
                else self.swapped(lambda: op(*a, **k))
        return lambda a, k: self.swapped(lambda: op(*a, **k))

    def _native_dropout(self, a: list[Any], k: dict[str, Any]) -> Any:
        x, p, train = a[0], a[1], a[2] if len(a) > 2 else k.get("train")
        if x.numel() == 0 or train is False:
            return torch.ops.aten.native_dropout.default(x, p, train)  # draws nothing
        p1m = 1.0 - p
        mask = torch.empty_like(x).bernoulli_(p1m, generator=self.generator)
        return x.mul(mask * (0.0 if p1m == 0 else 1.0 / p1m)), mask.bool()

    def swapped(self, fn: Callable[[], Any]) -> Any:
        """Run an op that draws from the device's default generator, on this session's stream."""
        d = torch.default_generator if self.device.type == "cpu" else \
            torch.cuda.default_generators[self.device.index or 0]
        with self.lock:
            saved = d.get_state()
            d.set_state(self.generator.get_state())
            try:
                return fn()
            finally:
                self.generator.set_state(d.get_state())
                d.set_state(saved)

    def state(self, a: Any, ts: list[torch.Tensor]) -> list[torch.Tensor]:
        """``torch.rng_state``: the stream's state, as its generator's ``get_state`` bytes, on the device."""
        if a != [] or ts:
            raise ValueError("malformed torch.rng_state call: no arguments, no operands")
        return [self.generator.get_state().to(self.device)]

    def set_state(self, a: Any, ts: list[torch.Tensor]) -> list[torch.Tensor]:
        """``torch.set_rng_state``: the stream set to a state ``torch.rng_state`` made (the generator checks it)."""
        if a != [] or len(ts) != 1 or ts[0].dtype is not torch.uint8 or ts[0].dim() != 1:
            raise ValueError("malformed torch.set_rng_state call: one flat uint8 state")
        self.generator.set_state(ts[0].cpu())
        return []


__all__ = ["SessionRandom"]
