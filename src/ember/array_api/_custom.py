"""Calling server-registered custom ops by name."""

from __future__ import annotations

from typing import Any, Sequence

from ..protocol import messages as m
from ._array import RemoteArray, same_device
from ._device import resolve
from ._dtypes import to_dtype


def call(name: str, arrays: Sequence[Any], outputs: Sequence[tuple[Sequence[int], Any]], device: Any,
         scalars: dict[str, Any]) -> Any:
    arrs = list(arrays)
    if any(not isinstance(a, RemoteArray) for a in arrs):
        raise TypeError("custom_op inputs must be ember arrays; pass scalars as keyword arguments")
    if arrs:
        same_device(*arrs)
    dev = arrs[0].device if arrs else resolve(device)
    session = arrs[0]._session if arrs else dev.session
    specs = [(tuple(int(n) for n in shape), to_dtype(dt)) for shape, dt in outputs]
    if not specs:
        raise ValueError("custom_op needs at least one declared output")
    tids = [next(session.ids) for _ in specs]
    session.record([m.CUSTOM, name, [a._id for a in arrs], tids, scalars,
                    [[list(s), dt.name] for s, dt in specs]])
    outs = tuple(RemoteArray(t, s, dt, dev, session) for t, (s, dt) in zip(tids, specs))
    return outs[0] if len(outs) == 1 else outs
