"""A batch can never be poisoned by one message: what cannot be encoded (a value past the argument checks,
recorded here with ``session.record`` directly) or would exceed the peer's frame limit is dropped alone,
its outputs (and what consumes them) poisoned with the reason; the rest of the batch is sent, nothing
escapes into an event-loop callback, and the session carries on. The same for graph capture and replay."""

from __future__ import annotations

import gc
import time
from typing import Any, Iterator

import numpy as np
import pytest

import ember
import ember.array_api as xp
from ember.array_api._array import RemoteArray
from ember.client.io import get_loop
from ember.errors import LimitExceeded, ProtocolError
from ember.protocol import messages as m
from ember.server import Server


@pytest.fixture
def loop_errors() -> Iterator[list[dict[str, Any]]]:
    """Exceptions raised in callbacks of the client's I/O loop (the idle tick flushes there)."""
    loop = get_loop()
    errors: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    yield errors
    loop.set_exception_handler(previous)


def _record(dev: ember.Device, name: str, args: list[Any], smask: int, kwargs: Any, like: RemoteArray) -> RemoteArray:
    """An op recorded past every argument check, as a buggy frontend could."""
    s = dev.session
    tid = next(s.ids)
    s.record([m.OP, name, [a._id if isinstance(a, RemoteArray) else a for a in args], smask, [tid], kwargs])
    return RemoteArray(tid, like.shape, like.dtype, dev, s)


def _until(cond: Any, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


def test_an_unencodable_message_poisons_its_outputs_only(dev: ember.Device, loop_errors: list[Any]) -> None:
    s = dev.session
    a = xp.asarray(np.arange(3.0), device=dev)
    before = a + 1
    bad = _record(dev, "full", [], 0, {"shape": [3], "fill_value": 2**70, "dtype": "float64"}, a)
    downstream = bad * 2  # consumes the poisoned id, in the same batch
    after = a * 3
    _until(lambda: s.stats["unsendable"] == 1, "the idle tick to flush the batch")  # (an event-loop callback)
    later = bad + after  # recorded after the poison was found: inherits it too
    assert loop_errors == [] and s.lost is None
    for x in (bad, downstream, later):
        with pytest.raises(ProtocolError, match="op full was not sent .* cannot be encoded .*OverflowError"):
            x.to_numpy()
    np.testing.assert_array_equal(before.to_numpy(), [1.0, 2.0, 3.0])
    np.testing.assert_array_equal(after.to_numpy(), [0.0, 3.0, 6.0])
    np.testing.assert_array_equal(xp.asarray([1.0], device=dev).to_numpy(), [1.0])
    with pytest.raises(ProtocolError):
        xp.sum(downstream).to_numpy()
    del bad, downstream, later, x
    gc.collect()
    s.flush()  # the drops of the poisoned ids: the client forgets their poison
    assert not s._poisoned
    assert float(xp.sum(a * 2).to_numpy()) == 6.0 and s.stats["unsendable"] == 1 and loop_errors == []


def test_an_unencodable_scalar_keeps_graphs_working(dev: ember.Device, loop_errors: list[Any]) -> None:
    """A recurring step whose scalar cannot be encoded once: that step goes out as ops (its bad op
    dropped), the steps before and after are replayed."""
    s = dev.session
    a = xp.asarray(np.arange(4.0), device=dev)
    got = []
    for step in range(12):
        y = ((a * 2.0 + 1.0) * 1.0 + 0.0) * 1.0
        z = _record(dev, "multiply", [y, 2**70 if step == 6 else 2.0], 2, None, y)
        w = ((z * 3.0 - 1.0) * 1.0 + 0.0) * 1.0
        if step == 6:
            with pytest.raises(ProtocolError, match="op multiply was not sent"):
                w.to_numpy()
        else:
            got.append(w.to_numpy())
    assert s.stats["replays"] >= 5 and s.stats["unsendable"] == 1, s.stats
    for g in got:
        np.testing.assert_array_equal(g, (np.arange(4.0) * 2 + 1) * 2 * 3 - 1)
    assert loop_errors == [] and s.lost is None


@pytest.fixture
def small_frames() -> Iterator[ember.Device]:
    """A peer whose frames are at most 256 KiB, with a custom op that ignores its blob."""
    srv = Server(["cpu"], max_frame=256 << 10, chunk=64 << 10)
    srv.register_op("blob", lambda xp_, blob=b"": xp_.zeros(1))
    srv.listen_websocket("127.0.0.1", 0)
    srv.start_in_thread()
    d = ember.connect(srv.addresses[0])
    yield d
    d.close()
    srv.close()


def test_messages_past_the_frame_limit(small_frames: ember.Device, loop_errors: list[Any]) -> None:
    """A message larger than a frame is dropped with LimitExceeded; a batch larger than a frame is sent
    in several frames."""
    dev, s = small_frames, small_frames.session
    a = xp.asarray(np.arange(3.0), device=dev)
    big = ember.custom_op("blob", outputs=[((1,), xp.float64)], device=dev, blob=b"x" * (300 << 10))
    parts = [ember.custom_op("blob", outputs=[((1,), xp.float64)], device=dev, blob=b"y" * (100 << 10))
             for _ in range(5)]  # 500 KiB in one batch: two frames at least
    b = a + 1
    with pytest.raises(LimitExceeded, match="frame limit"):
        big.to_numpy()
    for p in parts:
        np.testing.assert_array_equal(p.to_numpy(), [0.0])
    np.testing.assert_array_equal(b.to_numpy(), [1.0, 2.0, 3.0])
    assert s.stats["unsendable"] == 1 and s.lost is None and loop_errors == []


def test_custom_op_keywords_are_checked_at_the_call(dev: ember.Device) -> None:
    with pytest.raises(TypeError, match="keyword big="):
        ember.custom_op("anything", outputs=[((1,), xp.float64)], device=dev, big=2**70)
    with pytest.raises(TypeError, match="keyword obj="):
        ember.custom_op("anything", outputs=[((1,), xp.float64)], device=dev, obj=object())
    assert dev.session.stats["unsendable"] == 0
