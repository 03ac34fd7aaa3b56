"""The embedded compute peer: an in-process ``Server`` reached over the in-memory link.

``ember.connect("local")`` (and the default device when none was chosen) is a NumPy peer
running in this process, ``"local:torch"`` a ``torch:cpu`` one (``ember.torch``'s default): the same session pump, interpreter and protocol as a remote
peer, with the sockets replaced by ``transport.memory``. This module sits above both
``client`` and ``server`` (the client layer never imports the server); it registers
the peer with the client's embedded-peer seam when ``ember`` is imported.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
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
            srv = _servers[address] = Server(list(PEERS[address]), max_sessions_per_client=0)  # all one user
            if len(_servers) == 1:
                atexit.register(_stop_workers)  # runs before the client's own exit handler (LIFO)
        return srv


def _stop_workers(timeout: float = 10.0) -> None:
    """At exit: let every embedded session's worker finish the batch it is running, and stop.

    A worker is a thread of this very process; one still inside a torch or NumPy kernel while
    the interpreter tears down would abort the process (C++ ``std::terminate``). Queued batches
    are dropped: the process is ending, and nobody can read their results."""
    deadline = time.monotonic() + timeout
    sessions = [sess for srv in list(_servers.values()) for sess in list(srv.live)]
    for sess in sessions:
        sess.stop()
    for sess in sessions:
        sess.worker.join(max(0.0, deadline - time.monotonic()))


def _after_fork_in_child() -> None:
    """A forked child starts its own embedded peers: the parent's threads did not come along."""
    global _lock
    _lock = threading.Lock()
    _servers.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _handler(address: str) -> SessionHandler:
    return local_server(address).handle


for _address in PEERS:
    register_embedded(_address, lambda a=_address: _handler(a))

__all__ = ["local_server", "PEERS"]
