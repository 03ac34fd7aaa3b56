"""The hot paths the benchmarks measure keep their semantics.

* tiny batches run inline on the server's network loop (only provably cheap ones);
* the client's idle tick, batch size and GIL hand-off;
* the op path's cache of checked dtype combinations.
"""

from __future__ import annotations

import time
from typing import Any, Iterator

import numpy as np
import pytest

import ember
import ember.array_api as xp
from ember.errors import RemoteExecutionError
from ember.protocol import messages as m
from ember.server import Server
from ember.server.execute.backends import make_backend
from ember.server.execute.interpreter import Interpreter, build_table


@pytest.fixture(params=[True, False], ids=["inline", "worker"])
def peer(request: pytest.FixtureRequest) -> Iterator[Server]:
    srv = Server(["cpu"], inline_small=request.param)
    srv.listen_websocket("127.0.0.1", 0)
    srv.start_in_thread()
    yield srv
    srv.close()


def interp() -> Interpreter:
    b = make_backend("cpu")
    it = Interpreter(b, build_table(b), {}, lambda out: None,
                     {"max_frame": 1 << 26, "chunk": 1 << 24, "max_tensor": 1 << 40, "graph_cache": 4})
    it.tensors.update({1: np.ones(16), 2: np.ones(16), 3: np.ones(10_000), 4: np.ones((16, 1)),
                       5: np.ones(1), 6: np.ones((4, 4)), 7: np.ones(100_000)})
    return it


@pytest.mark.parametrize("batch, cheap", [
    ([[m.OP, "add", [1, 2], 0, [9], None], [m.READ, 1, 9]], True),
    ([[m.OP, "multiply", [1, 2.0], 2, [9], None], [m.SYNC, 1], [m.DROP, [1]]], True),
    ([[m.OP, "add", [1, 5], 0, [9], None]], True),                   # size 1 broadcasts nothing up
    ([[m.OP, "add", [1, 4], 0, [9], None]], False),                  # (16,) + (16, 1): 256 elements out
    ([[m.OP, "exp", [3], 0, [9], None]], False),                     # too many elements
    ([[m.OP, "matmul", [6, 6], 0, [9], None]], False),               # not elementwise
    ([[m.OP, "astype", [1], 0, [9], {"dtype": "float32"}]], False),  # keyword arguments
    ([[m.READ, 1, 7]], False),                                       # a large read
    ([[m.CUSTOM, "f", [1], [9], {}, [[[16], "float64"]]]], False),
    ([[m.OP, "add", [1, 2], 0, [9], None]] * 17, False),             # too many messages
    ([[m.UPLOAD, 9, "float64", [4], 0, b"\0" * 32, 32]], True),
])
def test_only_provably_cheap_batches_may_run_on_the_loop(batch: list[Any], cheap: bool) -> None:
    assert interp().cheap(batch) is cheap


def _aten(name: str, n: int, out_bytes: int | None = None) -> list[Any]:
    """An ATen OP message on two float32 operands of ``n`` elements (storages 1 and 2), out to 9."""
    lay = [[n], [1], 0, "float32"]
    return [m.OP, name, [[1], 1, 2], 3, [9], {"a": [0, 0, 1], "l": [lay, lay],
                                              "o": [[0, [n], [1], 0, "float32", out_bytes or 4 * n]]}]


@pytest.mark.parametrize("batch, cheap", [
    ([_aten("aten.add.Tensor", 16), [m.READ, 1, 9]], True),   # pointwise, small: the loop runs it
    ([_aten("aten.add.Tensor", 100_000)], False),             # too many elements
    ([_aten("aten.add.Tensor", 16, 1 << 30)], False),         # an output storage too big
    ([_aten("aten.mm.default", 16)], False),                  # neither pointwise nor a reduction
    ([_aten("aten.sum.default", 16), [m.READ, 1, 9]], True),  # a reduction: work linear in its operands
    ([_aten("aten.bernoulli.p", 16)], False),                 # random: not pointwise here
    ([_aten("aten.no_such.op", 16)], False),                  # refused: the worker says why
])
def test_small_pointwise_aten_ops_on_a_torch_cpu_peer_may_run_on_the_loop(batch: list[Any], cheap: bool) -> None:
    assert _torch_interp().cheap(batch) is cheap


def _torch_interp() -> Interpreter:
    torch = pytest.importorskip("torch")
    b = make_backend("torch:cpu")
    it = Interpreter(b, build_table(b), {}, lambda out: None,
                     {"max_frame": 1 << 26, "chunk": 1 << 24, "max_tensor": 1 << 40, "graph_cache": 4})
    it.tensors.update({1: torch.zeros(64, dtype=torch.uint8), 2: torch.zeros(64, dtype=torch.uint8)})
    return it


def _many(n: int) -> list[Any]:
    lay = [[4], [1], 0, "float32"]
    return [m.OP, "aten.cat.default", [[], *[1] * n], 1, [9], {"a": [[0] * n, 0], "l": [lay] * n,
                                                              "o": [[0, [4 * n], [1], 0, "float32", 16 * n]]}]


@pytest.mark.parametrize("batch, direct", [
    ([_aten("aten.mm.default", 16), [m.READ, 1, 9]], True),   # a small matmul, a reduction, a loss: bounded
    ([_aten("aten.sum.default", 16)], True),
    ([_aten("aten.bernoulli.p", 16)], True),                  # on the session's own random stream
    ([_aten("aten.mm.default", 100_000)], False),             # too many elements
    ([_aten("aten.mm.default", 16, 1 << 30)], False),         # an output storage too big
    ([_aten("aten.resize_.default", 16)], False),             # resizes: never off the worker
    ([_aten("aten.no_such.op", 16)], False),
    ([_many(16)], True),
    ([_many(17)], False),                                     # too many operands
])
def test_small_bounded_aten_ops_may_run_on_the_caller_s_own_thread(batch: list[Any], direct: bool) -> None:
    """``Session.direct`` (the embedded peer, on the caller's thread) also takes small non-pointwise ATen ops
    (what precedes ``loss.item()``); the network loop still takes only pointwise and reducing ones."""
    it = _torch_interp()
    assert it.cheap(batch, True) is direct
    assert it.cheap(batch) is (direct and batch[0][1] == "aten.sum.default")  # the loop: pointwise or reducing


def test_inline_and_worker_give_the_same_values_and_errors(peer: Server) -> None:
    dev = ember.connect(peer.addresses[0])
    try:
        a = xp.asarray(np.arange(8.0), device=dev)
        vals = [(a + float(i)).to_numpy().tolist() for i in range(20)]
        assert vals == [(np.arange(8.0) + i).tolist() for i in range(20)]
        bad = ember.custom_op("no_such_op", a, outputs=[((8,), xp.float64)])
        with pytest.raises(RemoteExecutionError) as e1:
            (bad + 1.0).to_numpy()   # a cheap batch whose input is poisoned
        big = xp.asarray(np.ones((300, 300)), device=dev)
        slow = big @ big             # goes to the worker ...
        with pytest.raises(RemoteExecutionError) as e2:
            (bad * 2.0).to_numpy()   # ... and what follows waits for it, in order
        assert e1.value.op == e2.value.op == "no_such_op"
        assert float(xp.sum(slow)) == 300.0 ** 3
        assert (a * 2.0).to_numpy().tolist() == (np.arange(8.0) * 2).tolist()
    finally:
        dev.close()


def test_idle_tick_flushes_without_a_read_and_stops_when_quiet(peer: Server) -> None:
    dev = ember.connect(peer.addresses[0], idle_flush=0.002)
    try:
        s = dev.session
        a = xp.asarray(np.ones(4), device=dev)
        dev.sync()
        b0 = s.stats["batches"]
        _ = a + 1.0  # no read: the tick sends it within a few ms
        deadline = time.monotonic() + 5
        while s.stats["batches"] == b0 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert s.stats["batches"] > b0
        deadline = time.monotonic() + 5
        while s._ticking and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not s._ticking  # quiet: the loop is not woken for nothing
        _ = a * 3.0
        deadline = time.monotonic() + 5
        while s._pending and time.monotonic() < deadline:
            time.sleep(0.001)
        assert not s._pending  # and it starts again with the next op
    finally:
        dev.close()


def test_a_long_chain_streams_in_bounded_batches(peer: Server) -> None:
    dev = ember.connect(peer.addresses[0], graphs=False)  # raw ops (with graphs the chain is replayed)
    try:
        s = dev.session
        a = xp.asarray(np.full(16, 0.25), device=dev)
        b = xp.asarray(np.full(16, 0.5), device=dev)
        dev.sync()
        b0 = s.stats["batches"]
        x = a
        for _ in range(1500):
            x = x * b + a
        got = x.to_numpy()
        ref = np.full(16, 0.25)
        for _ in range(1500):
            ref = ref * 0.5 + 0.25
        np.testing.assert_array_equal(got, ref)
        assert s.stats["batches"] - b0 >= 3000 // s.max_batch
    finally:
        dev.close()


def test_checked_dtype_combinations_still_check_values_and_types() -> None:
    dev = ember.connect("local")
    try:
        i8 = xp.asarray(np.arange(4, dtype=np.int8), device=dev)
        f = xp.asarray(np.ones(4), device=dev)
        for _ in range(2):  # the second time takes the cached path where there is one
            assert (i8 + 1).to_numpy().tolist() == [1, 2, 3, 4]
            with pytest.raises(OverflowError):
                i8 + 1000
            with pytest.raises(TypeError):
                i8 + 1.5
            assert (f * 2).dtype == xp.float64 and (2.0 - f).to_numpy().tolist() == [1.0] * 4
            assert (f < 2.0).dtype == xp.bool
            with pytest.raises(TypeError):
                f & f
            assert (-f).to_numpy().tolist() == [-1.0] * 4
            assert xp.abs(xp.asarray(np.array([-1 + 1j]), device=dev)).dtype == xp.float64
    finally:
        dev.close()
