"""The embedded compute peer: an in-process ``Server`` reached over the in-memory link.

``ember.connect("local")`` (and the default device when none was chosen) is a NumPy peer
running in this process, ``"local:torch"`` a ``torch:cpu`` one (``ember.torch``'s default): the same session pump, interpreter and protocol as a remote
peer, with the sockets replaced by ``transport.memory``. This module sits above both
``client`` and ``server`` (the client layer never imports the server); it registers
the peer with the client's embedded-peer seam when ``ember`` is imported.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from .client.device import LOCAL, register_embedded
from .transport import SessionHandler

if TYPE_CHECKING:
    from .server import Server

#: Address -> the devices its embedded peer hosts (``"local:torch"``: ``ember.torch``'s default).
PEERS: dict[str, tuple[str, ...]] = {LOCAL: ("cpu",), "local:torch": ("torch:cpu",)}

_servers: dict[str, "Server"] = {}
_lock = threading.Lock()


def local_server(address: str = LOCAL) -> "Server":
    """The embedded peer serving ``address``, created on first use."""
    with _lock:
        srv = _servers.get(address)
        if srv is None:
            from .server import Server
            srv = _servers[address] = Server(list(PEERS[address]))
        return srv


def _handler(address: str) -> SessionHandler:
    return local_server(address).handle


for _address in PEERS:
    register_embedded(_address, lambda a=_address: _handler(a))

__all__ = ["local_server", "PEERS"]
