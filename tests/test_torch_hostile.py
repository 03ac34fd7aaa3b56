"""Hostile arguments to ember.torch never break a session: each call raises at the call or works, and a
canary op on the same session returns the right value afterwards (hypothesis, bounded and seeded)."""

from __future__ import annotations

import math
from typing import Any, Callable

import pytest

torch = pytest.importorskip("torch")
from hypothesis import HealthCheck, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import ember  # noqa: E402
import ember.torch  # noqa: E402
from ember.errors import EmberError, SessionLost  # noqa: E402

pytestmark = pytest.mark.timeout(300)

BIG = [0, 1, -1, 2**31, 2**63 - 1, 2**63, 2**64, 2**70, -2**63, -2**64 - 1, 10**30]
hostile = st.one_of(
    st.sampled_from(BIG), st.integers(-2**80, 2**80), st.floats(allow_nan=True, allow_infinity=True),
    st.none(), st.just(()), st.just((10**6,) * 70), st.text(max_size=8), st.binary(max_size=8),
    st.just(object()), st.just([1, "x"]), st.just(torch.ones(2)), st.just(complex(1, float("nan"))),
    st.tuples(st.sampled_from(BIG), st.sampled_from(BIG)),
)
EXPECTED = (TypeError, ValueError, RuntimeError, OverflowError, IndexError, NotImplementedError, EmberError,
            AttributeError, KeyError)


def calls(x: torch.Tensor) -> list[Callable[[Any], Any]]:
    """Public entry points fed one hostile value each."""
    return [
        lambda v: torch.zeros(v, device="ember"),
        lambda v: torch.full((2,), v, device="ember"),
        lambda v: torch.arange(v, device="ember"),
        lambda v: torch.empty(v, device="ember").sum(),
        lambda v: torch.randn(v, device="ember"),
        lambda v: x + v,
        lambda v: x.mul_(v) if not isinstance(v, torch.Tensor) else x.mul(v),
        lambda v: x.view(v),
        lambda v: x.reshape(v),
        lambda v: x.narrow(0, v, 1),
        lambda v: x[v],
        lambda v: x.sum(dim=v),
        lambda v: x.to(v),
        lambda v: x.clamp(min=v),
        lambda v: x.roll(v),
        lambda v: x.expand(v, 3),
        lambda v: x.new_full((2,), v),
        lambda v: torch.nn.functional.dropout(x, p=v),
        lambda v: ember.torch.to_device(x, v),
        lambda v: ember.torch.to_device(v, ember.torch.current_device()),
        lambda v: ember.torch.from_array(v),
        lambda v: ember.torch.to_array(v),
        lambda v: ember.torch.device_of(v),
        lambda v: torch.manual_seed(v),
    ]


@pytest.fixture(scope="module")
def session_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.arange(6.0).reshape(2, 3).to("ember")
    canary = torch.arange(4.0).to("ember")
    return x, canary


@seed(20261201)
@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(which=st.integers(0, 23), value=hostile)
def test_hostile_arguments_never_break_the_session(session_tensors: Any, which: int, value: Any) -> None:
    x, canary = session_tensors
    before = x.detach().clone()
    try:
        r = calls(x)[which](value)
        if isinstance(r, torch.Tensor) and r.device.type == "ember" and 0 < r.numel() < 1 << 16:
            r.cpu()  # make the peer run it: a failure there must stay that op's
    except SessionLost:
        raise
    except EXPECTED:
        pass
    except ember.errors.RemoteExecutionError:
        pass
    with torch.no_grad():
        x.copy_(before)  # undo a successful in-place call
    assert (canary + 1).sum().item() == 10.0  # the session still computes
    assert not math.isnan(x.sum().item())


def test_an_unencodable_op_poisons_only_itself() -> None:
    """A message that cannot be encoded must not poison its batch or the session."""
    x = torch.arange(3.0).to("ember")
    s = ember.torch.device_of(x).session
    good = x * 2
    with pytest.raises((OverflowError, ValueError, RuntimeError, TypeError)):
        torch.zeros((2**40, 2**40, 2**40), device="ember").sum().item()
    assert good.tolist() == [0.0, 2.0, 4.0] and s.lost is None
