"""Which device an array function runs on, and the dtypes it offers."""

from __future__ import annotations

import weakref
from typing import Any

from ..client.device import Device, default_device
from ..protocol import ops
from . import _dtypes as d

#: Every device the array API has seen in this process (``__array_namespace_info__().devices()``).
KNOWN: "weakref.WeakSet[Device]" = weakref.WeakSet()


def resolve(device: Any) -> Device:
    """``device=None`` means the default device (``with dev:`` / ``set_default_device`` / local)."""
    if device is None:
        device = default_device()
    elif not isinstance(device, Device):
        raise TypeError(f"device must be an ember Device (from ember.connect), got {device!r}")
    if device not in KNOWN:
        KNOWN.add(device)
    return device


def dtype_names(dev: Device) -> list[str]:
    """The dtype names the device's backend offers, from the peer's Welcome."""
    return dev.session.welcome["devices"][dev.index]["dtypes"]


def check_dtype(dev: Device, dt: d.DType) -> None:
    """Refuse, before anything is sent, a dtype the device's backend lacks. (Every array starts here: the
    session learns that this frontend's ops write none of their arguments, ``ops.writes``.)"""
    s = dev.session
    if getattr(s, "op_writes", False) is None:
        s.op_writes = ops.writes
    names = dtype_names(dev)
    if dt.name not in names:
        raise TypeError(f"device {dev!r} ({dev.info['backend']}) has no {dt.name} dtype; "
                        f"it offers {', '.join(names)}")
