"""Which device an array function runs on, and the dtypes it offers."""

from __future__ import annotations

from typing import Any

from ..client.device import Device, default_device
from . import _dtypes as d


def resolve(device: Any) -> Device:
    """``device=None`` means the default device (``with dev:`` / ``set_default_device`` / local)."""
    if device is None:
        return default_device()
    if isinstance(device, Device):
        return device
    raise TypeError(f"device must be an ember Device (from ember.connect), got {device!r}")


def check_dtype(dev: Device, dt: d.DType) -> None:
    """Refuse, before anything is sent, a dtype the device's backend lacks."""
    names = dev.session.welcome["devices"][dev.index]["dtypes"]
    if dt.name not in names:
        raise TypeError(f"device {dev!r} ({dev.info['backend']}) has no {dt.name} dtype; "
                        f"it offers {', '.join(names)}")
