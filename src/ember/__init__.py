"""Ember: run array code on remote compute peers.

>>> import ember, ember.array_api as xp
>>> dev = ember.connect("local")          # or "ws://host:port", or an iroh ticket
>>> x = xp.asarray([1.0, 2.0, 3.0], device=dev)
>>> float(xp.sum(xp.exp(x)))              # doctest: +ELLIPSIS
30.19...
"""

from __future__ import annotations

from . import embedded, errors
from ._version import __version__
from .client.device import Device, connect, default_device, devices, set_default_device
from .client.progress import set_progress
from .errors import EmberError


def custom_op(name: str, *arrays: object, outputs: list[tuple[tuple[int, ...], object]], device: object = None,
              **scalars: object) -> object:
    """Call the server-registered custom op ``name`` on ``arrays``.

    ``outputs`` declares each result's (shape, dtype); a single output returns
    one array, several return a tuple. An unknown name or a mismatching result
    raises ``RemoteExecutionError`` when the result is read.
    """
    from .array_api._custom import call
    return call(name, arrays, outputs, device, scalars)


def __getattr__(name: str) -> object:
    if name == "pool":  # ember.pool(...): a pool of peers on Ray (imported on first use; ember[ray])
        import importlib
        return importlib.import_module(".pool", __name__)
    raise AttributeError(f"module 'ember' has no attribute {name!r}")


__all__ = ["__version__", "errors", "EmberError", "Device", "connect", "devices", "set_default_device",
           "default_device", "custom_op", "set_progress"]
