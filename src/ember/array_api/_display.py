"""``repr(x)`` / ``str(x)`` / ``print(x)``: an array shows its values like NumPy, with its dtype and device.

One read. A large array (more elements than NumPy's print ``threshold``) is cut on the peer
first: along every axis longer than ``2 * (edgeitems + 1)`` only its first and last
``edgeitems + 1`` entries are kept, so the read stays small whatever the array's size, and
NumPy's own summarising formatter then prints exactly what it prints for the whole array (it
formats only the edge items it shows). An array whose value cannot be read (poisoned by a
failed op, its session gone, a read timeout) shows the error instead of raising it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import EmberError
from ._array import RemoteArray
from ._manipulation import concat


def _device(dev: Any) -> str:
    address = getattr(dev, "address", None)
    if address is None:
        return repr(dev)
    shown = address if len(address) <= 40 else address[:24] + "…"
    return f"Device({shown!r}, {getattr(dev, 'index', 0)})"


def _edges(x: RemoteArray, keep: int) -> RemoteArray:
    """``x`` with every axis longer than ``2 * keep`` cut to its first and last ``keep`` entries."""
    y = x
    for ax, n in enumerate(x.shape):
        if n > 2 * keep:
            head = (slice(None),) * ax + (slice(0, keep),)
            tail = (slice(None),) * ax + (slice(n - keep, n),)
            y = concat([y[head], y[tail]], axis=ax)
    return y


def values_text(x: RemoteArray, prefix: str = "", separator: str = ", ") -> str:
    """The values as NumPy prints them (summarised like NumPy when large); one read."""
    opts = np.get_printoptions()
    if x.size == 0:
        return np.array2string(np.empty(x.shape, dtype=x.dtype.np), separator=separator, prefix=prefix)
    if x.size <= opts["threshold"]:
        return np.array2string(x.to_numpy(), separator=separator, prefix=prefix)
    host = _edges(x, opts["edgeitems"] + 1).to_numpy()
    return np.array2string(host, separator=separator, prefix=prefix, threshold=0)


def array_repr(x: RemoteArray) -> str:
    prefix = "Array("
    try:
        body = values_text(x, prefix)
    except EmberError as e:
        body = f"<{type(e).__name__}: {e.message}>"
    extra = f", shape={x.shape}" if x.size == 0 or body.startswith("<") else ""
    return f"{prefix}{body}{extra}, dtype={x.dtype.name}, device={_device(x.device)})"


RemoteArray.__repr__ = array_repr  # type: ignore[method-assign]
RemoteArray.__str__ = array_repr  # type: ignore[method-assign]

__all__ = ["array_repr", "values_text"]
