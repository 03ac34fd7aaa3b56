"""Moving arrays between devices. Without a direct path, data goes through this client."""

from __future__ import annotations

from typing import Any

from ._array import RemoteArray


def move(x: RemoteArray, device: Any, *, via_client: bool = False) -> RemoteArray:
    from ._creation import upload
    from ._device import resolve
    dev = resolve(device)
    return upload(x.to_numpy(), dev)
