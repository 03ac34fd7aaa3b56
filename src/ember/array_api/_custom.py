"""Calling server-registered custom ops by name."""

from __future__ import annotations

from typing import Any, Sequence

from ..protocol import codec
from ..protocol import messages as m
from . import _validate as V
from ._array import RemoteArray, same_device
from ._device import resolve
from ._dtypes import to_dtype


def call(name: str, arrays: Sequence[Any], outputs: Sequence[tuple[Sequence[int], Any]], device: Any,
         scalars: dict[str, Any]) -> Any:
    if type(name) is not str or not name:
        raise TypeError(f"custom_op: name must be a non-empty string, got {type(name).__name__}")
    try:
        codec.packb(scalars)
    except Exception as e:  # a value the protocol cannot carry
        bad = next((k for k, v in scalars.items() if not _encodable(v)), "?")
        raise TypeError(f"custom_op: keyword {bad}= cannot travel to the peer ({type(e).__name__}: {e}); "
                        f"pass None, bools, ints of at most 64 bits, floats, strings, bytes or lists of them") \
            from None
    arrs = list(arrays)
    if any(not isinstance(a, RemoteArray) for a in arrs):
        raise TypeError("custom_op inputs must be ember arrays; pass scalars as keyword arguments")
    if arrs:
        same_device(*arrs)
    dev = arrs[0].device if arrs else resolve(device)
    session = arrs[0]._session if arrs else dev.session
    if not isinstance(outputs, (list, tuple)):
        raise TypeError(f"custom_op: outputs must be a list of (shape, dtype) pairs, got {type(outputs).__name__}")
    specs = []
    for i, o in enumerate(outputs):
        if not isinstance(o, (list, tuple)) or len(o) != 2:
            raise TypeError(f"custom_op: outputs[{i}] must be a (shape, dtype) pair")
        specs.append((V.shape(f"outputs[{i}]", o[0]), to_dtype(o[1])))
        V.fits("custom_op", specs[-1][0], specs[-1][1], session)
    if not specs:
        raise ValueError("custom_op needs at least one declared output")
    tids = [next(session.ids) for _ in specs]
    session.record([m.CUSTOM, name, [a._id for a in arrs], tids, scalars,
                    [[list(s), dt.name] for s, dt in specs]])
    outs = tuple(RemoteArray(t, s, dt, dev, session) for t, (s, dt) in zip(tids, specs))
    return outs[0] if len(outs) == 1 else outs


def _encodable(v: Any) -> bool:
    try:
        codec.packb(v)
        return True
    except Exception:
        return False
