"""ember.torch failures land where the user looks, and hostile ATen messages cannot hurt a peer.

Errors torch would raise come at the call with torch's kind of message; a failure on the peer
poisons what the op wrote and raises RemoteExecutionError naming the ATen op at the next read;
the session survives. Raw clients sending refused ops or malformed layouts get errors, never an
out-of-bounds access.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any, Iterator

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ember  # noqa: E402
import ember.torch  # noqa: E402
from ember.errors import LimitExceeded, RemoteExecutionError, SessionLost  # noqa: E402
from ember.protocol import messages as m  # noqa: E402
from ember.server import Server  # noqa: E402
from ember.torch import workloads as W  # noqa: E402

pytestmark = pytest.mark.timeout(90)
OP = m.OP


@pytest.fixture(scope="module")
def peer() -> Iterator[Server]:
    srv = Server(["torch:cpu", "cpu"])
    srv.listen_websocket("127.0.0.1", 0)
    srv.start_in_thread()
    yield srv
    srv.close()


@pytest.fixture
def dev(peer: Server) -> Iterator[ember.Device]:
    d = ember.connect(peer.addresses[0])
    yield d
    d.close()


def storage(s: Any, data: bytes) -> int:
    """A raw client's storage: the bytes of ``data`` uploaded as a flat uint8 array."""
    return s.upload(np.frombuffer(data, dtype=np.uint8))


def canary(s: Any) -> None:
    """The session still computes: a valid ATen op on a fresh storage reads back right."""
    a = storage(s, np.arange(4, dtype=np.float32).tobytes())
    out = next(s.ids)
    lay = [[4], [1], 0, "float32"]
    s.record([OP, "aten.mul.Tensor", [[3.0], a], 1, [out],
              {"a": [0, 1], "l": [lay], "o": [[0, [4], [1], 0, "float32", 16]]}])
    got = np.frombuffer(bytes(s.read(out)), dtype=np.float32)
    assert got.tolist() == [0.0, 3.0, 6.0, 9.0]


def test_shape_errors_raise_at_the_call_with_torchs_message(dev: ember.Device) -> None:
    with dev:
        a, b = torch.ones(2, 3, device="ember"), torch.ones(2, 3, device="ember")
        with pytest.raises(RuntimeError, match="cannot be multiplied|same reduction dim"):
            a @ b
        with pytest.raises(RuntimeError, match="size of tensor a|broadcast"):
            a + torch.ones(4, device="ember")
        assert (a + b).sum().item() == 12.0  # and everything else carries on


def test_mixed_with_a_cpu_tensor_raises_like_cuda(dev: ember.Device) -> None:
    with dev:
        a = torch.ones(3, device="ember")
        with pytest.raises(RuntimeError, match="same device.*ember:0 and cpu"):
            a + torch.ones(3)
        assert (a * torch.tensor(2.0)).tolist() == [2.0, 2.0, 2.0]  # 0-d CPU tensors mix in, as on CUDA
        assert a[torch.tensor([0, 2])].tolist() == [1.0, 1.0]       # and CPU indices


def test_a_failure_on_the_peer_poisons_what_the_op_wrote_and_the_session_survives(dev: ember.Device) -> None:
    with dev:
        x = torch.zeros(3, device="ember")
        bad = x[torch.tensor([5]).to("ember")]  # meta cannot know the index is out of range
        with pytest.raises(RemoteExecutionError, match=r"aten\.index\.Tensor.*index 5 is out of bounds"):
            bad.item()
        y = torch.ones(3, device="ember")
        y.index_put_((torch.tensor([7]).to("ember"),), torch.tensor(1.0).to("ember"))  # in place, fails remotely
        z = y * 2  # depends on the poisoned storage
        with pytest.raises(RemoteExecutionError, match=r"aten\.index_put_"):
            z.cpu()
        with pytest.raises(RemoteExecutionError, match=r"aten\.index_put_"):
            print(y)
        assert (x + 1).tolist() == [1.0, 1.0, 1.0]


def test_refused_aten_ops_never_run(dev: ember.Device, tmp_path: Any) -> None:
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"\x01" * 64)
    s = dev.session
    out = next(s.ids)
    # aten::from_file(str filename, bool? shared, int? size, ...) would read a file of the peer's
    s.record([OP, "aten.from_file.default", [[]], 1, [out],
              {"a": [str(secret), None, 16, "uint8", None, None, None], "l": [], "o": [[0, [16], [1], 0, "uint8", 16]]}])
    with pytest.raises(RemoteExecutionError, match="refused on Ember peers"):
        s.read(out)
    for name, why in [("aten.set_.source_Storage", "Storage"), ("aten.empty.memory_format", "refused"),
                      ("aten.as_strided.default", "refused"), ("aten.no_such_op.default", "no ATen overload"),
                      ("aten.add", "not an ATen overload name"), ("os.system", "unknown op")]:
        o = next(s.ids)
        s.record([OP, name, [[]], 1, [o], {"a": [], "l": [], "o": []}])
        with pytest.raises(RemoteExecutionError, match=why):
            s.read(o)
    canary(s)


BAD_LAYOUTS = [
    ([[4], [1], 1, "float32"], "reaches byte 20"),            # one element past the end
    ([[2, 2], [1, 4], 0, "float32"], "reaches byte 24"),      # a stride past the end
    ([[1 << 30], [1], 0, "float32"], "reaches byte"),         # huge
    ([[1 << 40], [0], 0, "float32"], "over the"),             # too many elements (of one)
    ([[4], [-1], 3, "float32"], "non-negative"),              # negative stride
    ([[4], [1], -4, "float32"], "non-negative"),              # negative offset
    ([[4], [1], 0, "float128"], "unknown dtype"),
    ([[4], [1, 1], 0, "float32"], "equal length"),
    ([[2.5], [1], 0, "float32"], "non-negative ints"),
    ("garbage", "a layout is"),
    ([[1] * 100, [1] * 100, 0, "float32"], "at most 64"),
]


@pytest.mark.parametrize("layout,why", BAD_LAYOUTS, ids=[w for _, w in BAD_LAYOUTS])
def test_malformed_layouts_are_refused_before_memory_is_touched(dev: ember.Device, layout: Any, why: str) -> None:
    s = dev.session
    a = storage(s, np.arange(4, dtype=np.float32).tobytes())  # 16 bytes
    out = next(s.ids)
    s.record([OP, "aten.neg.default", [[], a], 1, [out],
              {"a": [0], "l": [layout], "o": [[0, [4], [1], 0, "float32", 16]]}])
    with pytest.raises((RemoteExecutionError, LimitExceeded), match=why):  # (2^40 elements: over the budget first)
        s.read(out)
    canary(s)


def test_malformed_templates_and_specs_are_refused(dev: ember.Device) -> None:
    s = dev.session
    a = storage(s, bytes(16))
    lay = [[4], [1], 0, "float32"]
    spec = [[0, [4], [1], 0, "float32", 16]]
    cases = [
        ({"a": [0, 1], "l": [lay], "o": spec}, [[], a], "scalars sent"),                # a scalar that is not there
        ({"a": [0], "l": [lay], "o": spec}, [[], a], "does not match its schema"),      # template too short
        ({"a": [0, "x"], "l": [lay], "o": spec}, [[], a], "bad tensor entry"),
        ({"a": [0, 1], "l": [lay], "o": [[0, [4], [1], 0, "float32", 8]]}, [[2.0], a], "cannot hold"),
        ({"a": [0, 1], "l": [lay], "o": [[3, [4], [1], 0, "float32", 16]]}, [[2.0], a], "malformed output spec"),
        ({"a": [0, 1], "l": [lay, lay], "o": spec}, [[2.0], a], "does not match"),
        ({"a": [0, 1], "l": [lay], "o": spec}, [[{"x": 1}], a], "must be a number"),
    ]
    for kwargs, args, why in cases:
        o = next(s.ids)
        s.record([OP, "aten.mul.Tensor", args, 1, [o], kwargs])
        with pytest.raises(RemoteExecutionError, match=why):
            s.read(o)
    arr = s.upload(np.ones(4, dtype=np.float32))  # an array id, not a storage
    o = next(s.ids)
    s.record([OP, "aten.neg.default", [[], arr], 1, [o], {"a": [0], "l": [lay], "o": spec}])
    with pytest.raises(RemoteExecutionError, match="must name a storage"):
        s.read(o)
    canary(s)


def test_a_numpy_device_answers_aten_ops_with_a_hint(peer: Server) -> None:
    numpy_dev = ember.connect(peer.addresses[0], device=1)
    try:
        with numpy_dev:
            with pytest.raises(ember.torch.NotATorchDevice, match="--device torch:cpu"):
                torch.zeros(3, device="ember")
        s = numpy_dev.session
        o = next(s.ids)
        s.record([OP, "aten.zeros.default", [[]], 1, [o], {"a": [[3], None, None, None, None], "l": [], "o": []}])
        with pytest.raises(RemoteExecutionError, match="needs a torch device.*--device torch:cpu"):
            s.read(o)
    finally:
        numpy_dev.close()


def test_values_printing_and_conversions(dev: ember.Device) -> None:
    with dev:
        t = torch.arange(6.0, device="ember").reshape(2, 3)
        reads = dev.session.stats["reads"]
        text = repr(t)
        assert dev.session.stats["reads"] == reads + 1  # printing reads once
        assert "device='ember:0'" in text and "[3., 4., 5.]" in text
        assert t.tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
        assert t[1, 2].item() == 5.0 and int(t[0, 1]) == 1 and bool(t[0, 0]) is False
        assert (t > 2).nonzero().tolist() == [[1, 0], [1, 1], [1, 2]]
        assert torch.equal(t, t.clone()) and not torch.equal(t, t + 1)
        with pytest.raises(TypeError, match="ember:0.*numpy|numpy.*ember"):
            t.numpy()
        with pytest.raises(NotImplementedError, match="generator"):
            torch.randn(3, device="ember", generator=torch.Generator())
        with pytest.raises(RuntimeError, match="pin"):
            t.pin_memory()


def test_manual_seed_reseeds_the_peer(dev: ember.Device) -> None:
    with dev:
        torch.manual_seed(42)
        a = torch.randn(5, device="ember").cpu()
        torch.manual_seed(42)
        b = torch.randn(5, device="ember").cpu()
        torch.manual_seed(42)
        local = torch.randn(5)
    assert torch.equal(a, b) and torch.equal(a, local)


def test_peer_storage_count_stays_flat_over_many_steps(peer: Server, dev: ember.Device) -> None:
    with dev:
        torch.manual_seed(0)
        model = W.MLP().to("ember")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(0)
        held = []
        for step in range(200):
            x, y = W.classification_batch(g, 16, (8,), 4)
            loss = torch.nn.functional.cross_entropy(model(x.to("ember")), y.to("ember"))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if step % 50 == 49:
                loss.item()
                dev.sync()
                held.append(peer.held_tensors())
    assert held[0] > 0 and len(set(held)) == 1, f"the peer's storage count grew: {held}"


@pytest.mark.timeout(120)
def test_killed_peer_raises_session_lost_within_seconds() -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen([sys.executable, "-m", "ember.cli.main", "serve", "--no-iroh", "--device", "torch:cpu",
                          "--websocket", "127.0.0.1:0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env)
    try:
        assert p.stdout is not None
        address = None
        deadline = time.monotonic() + 60
        while address is None and time.monotonic() < deadline:
            line = p.stdout.readline()
            if "listening on ws://" in line:
                address = line.split("listening on ")[1].split()[0]
        assert address, "ember serve printed no address"
        d = ember.connect(address, heartbeat_timeout=3.0)
        with d:
            x = torch.randn(300, 300, device="ember")
            for _ in range(200):
                x = (x @ x).tanh()  # keeps the peer busy so the read really waits
            t0 = time.monotonic()
            os.kill(p.pid, signal.SIGKILL)
            with pytest.raises(SessionLost):
                x.sum().item()
            assert time.monotonic() - t0 < 8
    finally:
        p.kill()
        p.wait(10)
