"""One bad argument never breaks a session: hypothesis calls every public function of ``ember.array_api``
(enumerated from the namespace by ``ember.testing``) with hostile arguments, over ``"local"`` and over
WebSocket. Each call raises an expected exception at the call or works; its small results are read;
no message reaches the flush unencodable; and a canary op on the same session returns the right value.

Bounded and seeded here (EMBER_HOSTILE_EXAMPLES per function, default 5); the long run is
``bench/bench_hostile.py``.
"""

from __future__ import annotations

import os
from typing import Any, Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import ember
import ember.array_api as xp
from ember.server import Server
from ember.testing import Target, calls, hostile_peer, public_functions, run_call

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore::RuntimeWarning")]

FUNCTIONS = dict(public_functions(xp))

SETTINGS = settings(max_examples=int(os.environ.get("EMBER_HOSTILE_EXAMPLES", "5")), deadline=None,
                    derandomize=True, database=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module", params=["local", "websocket"])
def target(request: pytest.FixtureRequest) -> Iterator[Target]:
    """Two sessions on one peer (the second's arrays are "arrays of another device")."""
    with hostile_peer(request.param) as t:
        yield t


def test_every_public_function_is_driven() -> None:
    """The enumeration is the namespace's own: every name of ``__all__`` that is a function, the extensions,
    the array object's methods, the inspection object's."""
    names = set(FUNCTIONS)
    assert {"asarray", "eye", "full", "roll", "clip", "isin", "linalg.eig", "fft.fftfreq", "Array.__getitem__",
            "Array.__setitem__", "Array.to_device", "Array.__dlpack__", "info.devices"} <= names
    assert not [n for n in xp.__all__ if callable(getattr(xp, n)) and n not in names
                and not isinstance(getattr(xp, n), type) and type(getattr(xp, n)).__name__ != "DType"]
    assert len(names) > 230


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_hostile_arguments_never_break_the_session(target: Target, name: str) -> None:
    fn = FUNCTIONS[name]

    @SETTINGS
    @given(call=calls(target, name, fn))
    def one(call: tuple[list[Any], dict[str, Any]]) -> None:
        args, kwargs = call
        out = run_call(target, name, fn, args, kwargs)
        assert not out.session_lost, f"{name}: the session was lost ({out.raised!r})"
        assert out.problem is None, out.problem

    one()
    if target.calls > 400:  # hostile in-place calls wear the arrays out (poisoned values): fresh ones
        target.reset()


@pytest.fixture(params=["local", "websocket"])
def small_peer(request: pytest.FixtureRequest, server: Server) -> Iterator[ember.Device]:
    d = ember.connect("local" if request.param == "local" else server.addresses[0])
    yield d
    d.close()


def test_the_calls_of_the_issue_raise_at_the_call(small_peer: ember.Device) -> None:
    """The report that opened the issue: each bad argument raises where it was passed, naming it; the
    session goes on."""
    dev = small_peer
    a = xp.asarray(np.arange(6.0).reshape(2, 3), device=dev)
    i = xp.asarray(np.arange(6).reshape(2, 3), device=dev)
    for call, match in ((lambda: xp.eye(2, k=2**64, device=dev), "k="),
                        (lambda: xp.full((2,), 2**70, device=dev), "fill_value"),
                        (lambda: xp.roll(a, 2**80), "shift"),
                        (lambda: xp.clip(i, 2**70, None), "bound"),
                        (lambda: xp.zeros((2**63,), device=dev), "shape"),
                        (lambda: i + 2**64, "out of range")):
        with pytest.raises(OverflowError, match=match):
            call()
    with pytest.raises(ValueError, match="too big"):
        xp.zeros((2**40, 2**40), device=dev)
    with pytest.raises(TypeError, match="keepdims"):
        xp.sum(a, keepdims="yes")
    with pytest.raises(ValueError, match="axis"):
        xp.sum(a, axis=2**70)
    with pytest.raises(IndexError, match="axis"):  # an AxisError: a ValueError and an IndexError, as NumPy's
        xp.sum(a, axis=5)
    assert float(xp.sum(a).to_numpy()) == 15.0
    np.testing.assert_array_equal(xp.asarray([1.0], device=dev).to_numpy(), [1.0])
    # what fits the standard's semantics goes through: an int beyond 64 bits with a float array is a float
    assert xp.full((2,), 2**70, dtype=xp.float64, device=dev).to_numpy()[0] == 2.0**70
    np.testing.assert_array_equal(xp.clip(a, 2**70, None).to_numpy(), np.full((2, 3), 2.0**70))
    np.testing.assert_array_equal((a + 2**70).to_numpy(), np.arange(6.0).reshape(2, 3) + 2.0**70)
    np.testing.assert_array_equal(a[:, 2**70:].to_numpy(), np.zeros((2, 0)))
    np.testing.assert_array_equal(a[::-2**70, -2**70:2].to_numpy(), [[3.0, 4.0]])
    np.testing.assert_array_equal(xp.eye(2, k=2**40, device=dev).to_numpy(), np.zeros((2, 2)))
    assert dev.session.lost is None and dev.session.stats["unsendable"] == 0
