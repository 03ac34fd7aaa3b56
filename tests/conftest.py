"""Shared fixtures: real servers on loopback with ephemeral ports; never public relays."""

from __future__ import annotations

import os
import subprocess
import tempfile
from typing import Iterator

import pytest

os.environ.setdefault("EMBER_OFFLINE", "1")  # iroh: no relays, no discovery, ever, in tests
os.environ.setdefault("EMBER_BIND", "127.0.0.1:0,[::1]:0")         # `ember serve`: loopback only
os.environ.setdefault("EMBER_CLIENT_BIND", "127.0.0.1:0,[::1]:0")  # client endpoints: loopback only
os.environ.setdefault("EMBER_KEY", os.path.join(tempfile.mkdtemp(prefix="ember-test-"), "secret.key"))

import ember  # noqa: E402
from ember.server import Server  # noqa: E402


@pytest.fixture
def server() -> Iterator[Server]:
    """A compute peer (NumPy) serving WebSocket on 127.0.0.1, in a background thread."""
    srv = Server(["cpu"])
    srv.listen_websocket("127.0.0.1", 0)
    srv.start_in_thread()
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def torch_tcp_server() -> Iterator[Server]:
    """A torch:cpu peer serving TCP on 127.0.0.1, in a background thread of this process, for the module."""
    srv = Server(["torch:cpu"])
    srv.listen_tcp("127.0.0.1", 0)
    srv.start_in_thread()
    yield srv
    srv.close()


@pytest.fixture(params=["embedded", "tcp"])
def embedded_or_tcp(request: pytest.FixtureRequest, torch_tcp_server: Server) -> Iterator[ember.Device]:
    """A torch device: the embedded peer, and ``torch_tcp_server`` over TCP (closed afterwards)."""
    if request.param == "embedded":
        from ember.torch import current_device
        yield current_device()
        return
    d = ember.connect(next(a for a in torch_tcp_server.addresses if a.startswith("tcp://")))
    yield d
    d.close()


@pytest.fixture
def make_peer() -> Iterator:
    """``make_peer(*hosts, iroh=False, **server_options)``: NumPy peers serving WebSocket on each host
    (default 127.0.0.1), or iroh (offline, loopback), closed at the end of the test."""
    servers = []

    def make(*hosts: str, iroh: bool = False, **kw) -> Server:
        srv = Server(["cpu"], **kw)
        if iroh:
            srv.listen_iroh(offline=True, bind=["127.0.0.1:0", "[::1]:0"])
        for h in () if iroh else hosts or ("127.0.0.1",):
            srv.listen_websocket(h, 0)
        srv.start_in_thread()
        servers.append(srv)
        return srv
    yield make
    for s in servers:
        s.close()


@pytest.fixture(scope="module")
def torch_peer() -> Iterator[str]:
    """A torch:cpu peer serving WebSocket on 127.0.0.1 for the whole module; its address."""
    srv = Server(["torch:cpu"])
    srv.listen_websocket("127.0.0.1", 0)
    yield srv.start_in_thread()[0]
    srv.close()


@pytest.fixture
def ws_address(server: Server) -> str:
    return server.addresses[0]


@pytest.fixture(params=["local", "websocket"])
def dev(request: pytest.FixtureRequest) -> Iterator[ember.Device]:
    """A device over the in-memory link and over real WebSocket."""
    if request.param == "local":
        d = ember.connect("local")
        yield d
        d.close()
    else:
        srv = request.getfixturevalue("server")
        d = ember.connect(srv.addresses[0])
        yield d
        d.close()


@pytest.fixture(scope="module")
def tcp_peer() -> Iterator[str]:
    """``ember serve --device torch:cpu --tcp 127.0.0.1:0`` in its own process, for the whole module; its address."""
    from test_core_cli import address_of, spawn_serve
    p = spawn_serve("--device", "torch:cpu", "--no-iroh", "--tcp", "127.0.0.1:0", stderr=subprocess.DEVNULL,
                    env={**os.environ, "EMBER_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    try:
        yield address_of(p, r"listening on (tcp://\S+)", timeout=45)
    finally:
        p.terminate()
        p.wait(15)


@pytest.fixture(params=["embedded", "tcp"])
def peer(request: pytest.FixtureRequest) -> Iterator[ember.Device]:
    """A torch device: the embedded peer, and an ``ember serve`` process over TCP (``tcp_peer``)."""
    d = ember.connect("local:torch" if request.param == "embedded" else request.getfixturevalue("tcp_peer"))
    with d:
        yield d
    d.close()
