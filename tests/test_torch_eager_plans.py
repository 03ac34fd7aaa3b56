"""An eager ATen call's shape is bound once on the peer (server/execute/eager.py): a later call of the
same shape still has every per-call check, and gets exactly what the generic kernel gives.

Each case first runs a valid call so the shape is planned, then sends the same shape with what a
plan must not take on trust: a storage too small for its layout, an array where a storage belongs,
scalars that are not numbers or not all there, a result whose layout or storage differs from its
spec. Over the embedded peer (where ``Session.direct`` runs it on the caller's thread) and TCP.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ember  # noqa: E402
import ember.torch  # noqa: E402
from ember.errors import RemoteExecutionError  # noqa: E402
from ember.protocol import messages as m  # noqa: E402
from ember.server.execute import eager  # noqa: E402

pytestmark = pytest.mark.timeout(120)
OP = m.OP
LAY = [[4], [1], 0, "float32"]
SPEC = [[0, [4], [1], 0, "float32", 16]]


@pytest.fixture
def dev(embedded_or_tcp: ember.Device) -> ember.Device:
    return embedded_or_tcp


def storage(s: Any, values: Any, dtype: Any = np.float32) -> int:
    return s.upload(np.frombuffer(np.asarray(values, dtype=dtype).tobytes(), dtype=np.uint8))


def call(s: Any, name: str, scalars: list[Any], ids: list[int], kw: dict[str, Any]) -> int:
    out = next(s.ids)
    s.record([OP, name, [scalars, *ids], 1, [out], kw])
    return out


def values(s: Any, tid: int, dtype: Any = np.float32) -> list[float]:
    return np.frombuffer(bytes(s.read(tid)), dtype=dtype).tolist()


def test_a_planned_shape_keeps_its_per_call_checks(dev: ember.Device) -> None:
    s = dev.session
    kw = {"a": [0, 1], "l": [LAY], "o": SPEC}
    a = storage(s, [0, 1, 2, 3])
    for k in range(3):  # planned at the first call; the same answers after
        assert values(s, call(s, "aten.mul.Tensor", [float(k + 2)], [a], kw)) == [0.0, k + 2, 2 * (k + 2), 3 * (k + 2)]
    small = storage(s, [1, 2])  # 8 bytes: the layout reaches byte 16
    with pytest.raises(RemoteExecutionError, match="reaches byte 16"):
        s.read(call(s, "aten.mul.Tensor", [2.0], [small], kw))
    arr = s.upload(np.ones(4, dtype=np.float32))  # an array id, not a storage
    with pytest.raises(RemoteExecutionError, match="must name a storage"):
        s.read(call(s, "aten.mul.Tensor", [2.0], [arr], kw))
    with pytest.raises(RemoteExecutionError, match="must be a number"):
        s.read(call(s, "aten.mul.Tensor", [{"x": 1}], [a], kw))
    with pytest.raises(RemoteExecutionError, match="scalars"):
        s.read(call(s, "aten.mul.Tensor", [], [a], kw))
    with pytest.raises(RemoteExecutionError, match="does not match its schema"):
        s.read(call(s, "aten.mul.Tensor", [2.0], [a, a], kw))
    assert values(s, call(s, "aten.mul.Tensor", [3.0], [a], kw)) == [0.0, 3.0, 6.0, 9.0]  # the session goes on
    assert any(len(k.plans) for k in kernels("aten.mul.Tensor"))  # (the shape was planned)


def kernels(name: str) -> list[Any]:
    """The peer's ATen kernels of ``name`` that plan their call shapes (embedded and threaded peers alike)."""
    import gc
    return [k for k in gc.get_objects() if type(k).__name__ == "AtenKernel" and k.name == name and k.plans is not None]


def test_results_that_differ_from_their_spec_are_stored_as_the_generic_kernel_stores_them(dev: ember.Device) -> None:
    s = dev.session
    a = storage(s, [1, 2, 3, 4])
    strided = {"a": [0], "l": [LAY], "o": [[0, [4], [2], 0, "float32", 28]]}  # every other float
    for _ in range(2):
        got = values(s, call(s, "aten.neg.default", [], [a], strided))
        assert got[0::2] == [-1.0, -2.0, -3.0, -4.0] and got[1::2] == [0.0, 0.0, 0.0]  # zeroed between
    wrong = {"a": [0], "l": [LAY], "o": [[0, [2], [1], 0, "float32", 8]]}
    for _ in range(2):
        with pytest.raises(RemoteExecutionError, match="where its operands broadcast"):  # (before it runs)
            s.read(call(s, "aten.neg.default", [], [a], wrong))
    alias = {"a": [0], "l": [LAY], "o": SPEC}  # aten.alias returns its operand's memory: copied, not shared
    for k in range(2):
        b = call(s, "aten.alias.default", [], [a], alias)
        s.record([OP, "aten.fill_.Scalar", [[9.0 + k], a], 1, [], {"a": [0, 1], "l": [LAY], "o": []}])
        assert values(s, b) == ([1.0, 2.0, 3.0, 4.0] if k == 0 else [9.0] * 4)
        assert values(s, a) == [9.0 + k] * 4


def test_planned_calls_equal_local_torch(dev: ember.Device) -> None:
    with dev:
        x = torch.randn(5, 7, generator=torch.Generator().manual_seed(0))
        y = torch.randn(7, generator=torch.Generator().manual_seed(1))
        ex, ey = x.to("ember"), y.to("ember")
        for alpha in (1, 2.5, -3):
            assert torch.equal((ex.add(ey, alpha=alpha)).cpu(), x.add(y, alpha=alpha))
            assert torch.equal((ex * alpha).sum(1).cpu(), (x * alpha).sum(1))
            assert (ex[1, 2] + alpha).item() == (x[1, 2] + alpha).item()
        assert torch.equal(ex.t().exp().cpu(), x.t().exp())  # a transposed operand: a shape of its own


def test_the_plan_cache_is_bounded() -> None:
    with ember.torch.current_device() as dev:
        s = dev.session
        a = storage(s, np.arange(eager.MAX_PLANS + 8, dtype=np.float32))
        for k in range(eager.MAX_PLANS + 8):
            o = call(s, "aten.neg.default", [], [a], {"a": [0], "l": [[[1], [1], k, "float32"]],
                                                       "o": [[0, [1], [1], 0, "float32", 4]]})
            assert values(s, o) == [-float(k)]
    planned = kernels("aten.neg.default")
    assert planned and all(len(k.plans) <= eager.MAX_PLANS for k in planned)
    big = storage(s, np.zeros(4, dtype=np.float32))
    many = call(s, "aten.cat.default", [], [big] * 100, {"a": [[0] * 100, 0], "l": [LAY] * 100,
                                                          "o": [[0, [400], [1], 0, "float32", 1600]]})
    assert values(s, many) == [0.0] * 400  # (a call too large to plan: the generic kernel)
    assert not any(b"aten.cat.default" in key and key.count(b"float32") >= 100  # (earlier tests' small cats: planned)
                   for k in kernels("aten.cat.default") for key in k.plans)


def test_a_storage_read_through_a_kept_typed_view_follows_its_writes_and_layouts(dev: ember.Device) -> None:
    """A planned call keeps the typed view it read a storage through (eager.py ``_VIEW``): the next call of
    that shape on that storage sees every write made since, by any kernel, and another layout of the same
    storage gets a view of its own; a result adopted whole (a flat uint8 view of it) is a storage like any."""
    s = dev.session
    a = storage(s, [1, 2, 3, 4])
    kw = {"a": [0, 1], "l": [LAY], "o": SPEC}
    tail = {"a": [0, 1], "l": [[[2], [1], 2, "float32"]], "o": [[0, [2], [1], 0, "float32", 8]]}
    for k in range(3):
        assert values(s, call(s, "aten.mul.Tensor", [2.0], [a], kw)) == [2.0 * v for v in values(s, a)]
        assert values(s, call(s, "aten.mul.Tensor", [2.0], [a], tail)) == [2.0 * v for v in values(s, a)[2:]]
        s.record([OP, "aten.fill_.Scalar", [[5.0 + k], a], 1, [], {"a": [0, 1], "l": [LAY], "o": []}])
    r = call(s, "aten.add.Tensor", [1.0, 1], [a], {"a": [0, 1, 1], "l": [LAY], "o": SPEC})  # adopted whole
    assert values(s, r) == [8.0] * 4
    s.record([OP, "aten.fill_.Scalar", [[3.0], r], 1, [], {"a": [0, 1], "l": [LAY], "o": []}])  # written in place
    assert values(s, call(s, "aten.mul.Tensor", [2.0], [r], kw)) == [6.0] * 4
    assert values(s, a) == [7.0] * 4


def test_a_kept_typed_view_follows_its_storage_when_it_grows(dev: ember.Device) -> None:
    with dev:
        x, host = torch.arange(4.0).to("ember"), torch.arange(4.0)
        for _ in range(2):
            assert torch.equal((x * 2).cpu(), host * 2)  # planned; the peer keeps x's typed view
        x.resize_(4096)  # the peer's resize_ moves x's bytes to a larger allocation (same storage)
        x[4:].fill_(7.0)
        assert torch.equal((x[:4] * 2).cpu(), host * 2)  # the same call shape: read through the kept view
        assert (x[4095] * 2).item() == 14.0
