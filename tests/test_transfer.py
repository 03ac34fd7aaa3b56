"""Multi-device peers and tensor movement (WebSocket peers; iroh peers in test_transfer_iroh.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import ember
import ember.array_api as xp
from ember.errors import SessionLost, TransferError
from ember.protocol import messages as m
from ember.server import Server


@pytest.fixture
def two_device_peer():
    srv = Server(["cpu", "cpu"])
    srv.listen_websocket("127.0.0.1", 0)
    srv.start_in_thread()
    yield srv
    srv.close()


@pytest.fixture
def other_peer():
    srv = Server(["cpu"])
    srv.listen_websocket("127.0.0.1", 0)
    srv.start_in_thread()
    yield srv
    srv.close()


def test_devices_lists_every_device(two_device_peer):
    devs = ember.devices(two_device_peer.addresses[0])
    assert [d.index for d in devs] == [0, 1]
    assert all(d.info["backend"] == "numpy" for d in devs)
    for d in devs:
        d.close()


def test_same_peer_move_is_in_process_without_copy(two_device_peer):
    d0, d1 = ember.devices(two_device_peer.addresses[0])
    x = xp.arange(6.0, device=d0) * 3
    y = x.to_device(d1)
    assert y.device is d1 and y.shape == x.shape
    np.testing.assert_array_equal((y + 1).to_numpy(), np.arange(6.0) * 3 + 1)
    by_dev = {s.device_index: s.interp for s in two_device_peer.live}
    assert by_dev[1].tensors[y._id] is by_dev[0].tensors[x._id]  # shared backend: no host copy
    assert d1.stats()["bytes_received"] < 200  # only the read's answer came back


def test_long_op_on_one_device_does_not_stall_the_other(two_device_peer):
    d0, d1 = ember.devices(two_device_peer.addresses[0])
    a = xp.asarray(np.ones((600, 600)), device=d0)
    for _ in range(60):
        a = a @ a * 1e-3
    t0 = time.monotonic()
    assert float(xp.sum(xp.ones(3, device=d1))) == 3.0
    fast = time.monotonic() - t0
    a.to_numpy()
    assert fast < 5.0


def test_peer_to_peer_move_never_carries_the_payload(two_device_peer, other_peer):
    src = ember.connect(two_device_peer.addresses[0])
    dst = ember.connect(other_peer.addresses[0])
    data = np.random.default_rng(1).standard_normal(200_000)
    x = xp.asarray(data, device=src) * 2.0
    y = x.to_device(dst)
    np.testing.assert_array_equal(xp.sum(y).to_numpy(), np.sum(data * 2.0))
    assert src.stats()["bytes_received"] < 1000 and dst.stats()["bytes_received"] < 1000
    np.testing.assert_array_equal(y.to_numpy(), data * 2.0)


def test_local_and_remote_move_by_upload_download(other_peer):
    loc = ember.connect("local")
    rem = ember.connect(other_peer.addresses[0])
    x = xp.asarray(np.arange(5.0), device=loc)
    np.testing.assert_array_equal(x.to_device(rem).to_device(loc).to_numpy(), np.arange(5.0))
    np.testing.assert_array_equal(x.to_device(rem, via_client=True).to_numpy(), np.arange(5.0))


def _fetch_again(x, dst, cap, timeout=3.0):
    """Record a second FETCH of an existing capability (what a replaying attacker would do)."""
    from ember.array_api._array import RemoteArray
    tid = next(dst.session.ids)
    dst.session.record([m.FETCH, tid, x.device.address, cap, timeout])
    return RemoteArray(tid, x.shape, x.dtype, dst, dst.session)


def _expose(x, cap, downloads=1, ttl=300.0, peer=None):
    x._session.send_alone([m.EXPOSE, x._id, cap, peer, downloads, ttl])


def test_denials_used_up_expired_unknown(two_device_peer, other_peer):
    src = ember.connect(two_device_peer.addresses[0])
    dst = ember.connect(other_peer.addresses[0])
    x = xp.arange(4.0, device=src)
    cap = os.urandom(32)
    _expose(x, cap, downloads=1)
    np.testing.assert_array_equal(_fetch_again(x, dst, cap).to_numpy(), np.arange(4.0))
    with pytest.raises(TransferError, match="used up|unknown capability"):
        _fetch_again(x, dst, cap).to_numpy()
    cap2 = os.urandom(32)
    _expose(x, cap2, ttl=0.0)
    with pytest.raises(TransferError, match="expired"):
        _fetch_again(x, dst, cap2).to_numpy()
    with pytest.raises(TransferError, match="unknown capability"):
        _fetch_again(x, dst, os.urandom(32), timeout=1.0).to_numpy()
    cap3 = os.urandom(32)
    _expose(x, cap3, peer="ab" * 32)  # bound to a peer id; a WebSocket download presents none
    with pytest.raises(TransferError, match="bound to peer"):
        _fetch_again(x, dst, cap3).to_numpy()
    assert float(xp.sum(xp.ones(2, device=dst))) == 2.0  # the target session is fine


def test_failed_moves_poison_the_target(two_device_peer, other_peer):
    src = ember.connect(two_device_peer.addresses[0])
    dst = ember.connect(other_peer.addresses[0])
    bad = ember.custom_op("missing", xp.ones(2, device=src), outputs=[((2,), xp.float64)])
    with pytest.raises(TransferError, match="no value"):
        bad.to_device(dst).to_numpy()
    d1 = ember.connect(two_device_peer.addresses[0], device=1)
    with pytest.raises(TransferError, match="no value"):
        bad.to_device(d1).to_numpy()
    x = xp.ones(3, device=src)
    import socket
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    dead = f"ws://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()
    from ember.array_api._array import RemoteArray
    tid = next(dst.session.ids)
    dst.session.record([m.FETCH, tid, dead, os.urandom(32), 3.0])  # the source peer is gone
    with pytest.raises(TransferError, match="cannot reach the source peer"):
        RemoteArray(tid, (3,), x.dtype, dst, dst.session).to_numpy(timeout=30)
    src.sync()
    two_device_peer.close()
    with pytest.raises(SessionLost):
        x._session.sync(timeout=10)  # the source session is gone (src.sync() would reconnect)
    with pytest.raises(TransferError, match="session is gone"):
        x.to_device(dst)
    assert float(xp.sum(xp.ones(2, device=dst))) == 2.0


@pytest.mark.timeout(120)
def test_two_threads_move_back_and_forth(two_device_peer):
    d0, d1 = ember.devices(two_device_peer.addresses[0])
    errors = []

    def worker(a, b, seed):
        try:
            x = xp.asarray(np.full(8, float(seed)), device=a)
            for _ in range(100):
                x = x.to_device(b) + 1
                x = x.to_device(a) + 1
            assert float(xp.sum(x)) == 8 * (seed + 200)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(d0, d1, 1)), threading.Thread(target=worker, args=(d1, d0, 2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(100)
    assert not any(t.is_alive() for t in threads), "deadlock"
    assert not errors, errors


CLIENT = r"""
import re, sys, numpy as np, ember, ember.array_api as xp
src, dst = ember.connect(sys.argv[1]), ember.connect(sys.argv[2])
n = 256 * 1024 * 1024 // 8
x = xp.ones((n,), device=src) * 2.0
y = x.to_device(dst, timeout=120)
total = float(xp.sum(y))
assert total == 2.0 * n, total
# VmHWM: this process's own peak RSS (ru_maxrss would include the parent's at fork)
print("RSS_MB", int(re.search(r"VmHWM:\s+(\d+)", open("/proc/self/status").read()).group(1)) // 1024)
"""


def _serve(*args):
    p = subprocess.Popen([sys.executable, "-m", "ember.cli.main", "serve", *args], stdout=subprocess.PIPE,
                         text=True, env={**os.environ, "EMBER_OFFLINE": "1"})
    line = p.stdout.readline()
    mm = re.search(r"(ws://\S+)", line)
    assert mm, line
    return p, mm.group(1)


@pytest.mark.timeout(180)
def test_256_mib_peer_to_peer_with_a_small_client():
    p1, a1 = _serve("--websocket", "127.0.0.1:0")
    p2, a2 = _serve("--websocket", "127.0.0.1:0")
    try:
        r = subprocess.run([sys.executable, "-c", CLIENT, a1, a2], capture_output=True, text=True, timeout=170)
        assert r.returncode == 0, r.stderr
        rss = int(re.search(r"RSS_MB (\d+)", r.stdout).group(1))
        assert rss < 160, f"client peak RSS {rss} MiB for a 256 MiB tensor"
    finally:
        p1.kill()
        p2.kill()


def test_numpy_and_torch_devices_on_one_peer():
    pytest.importorskip("torch")
    srv = Server(["cpu", "torch:cpu"])
    srv.listen_websocket("127.0.0.1", 0)
    srv.start_in_thread()
    try:
        d0, d1 = ember.devices(srv.addresses[0])
        assert (d0.info["backend"], d1.info["backend"]) == ("numpy", "torch")
        assert "uint64" not in d1.dtypes
        x = xp.asarray(np.arange(6.0).reshape(2, 3), device=d0)
        y = x.to_device(d1)
        np.testing.assert_array_equal((xp.exp(y) @ xp.ones((3, 1), dtype=xp.float64, device=d1)).to_numpy(),
                                      np.exp(np.arange(6.0).reshape(2, 3)) @ np.ones((3, 1)))
        np.testing.assert_array_equal((y.to_device(d0) * 2).to_numpy(), np.arange(6.0).reshape(2, 3) * 2)
    finally:
        srv.close()
