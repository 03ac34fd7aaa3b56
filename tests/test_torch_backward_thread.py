"""A backward pass from ember roots runs on the calling thread (``_patches._install_backward_thread``), not on
autograd's PrivateUse1 device thread, with the gradients local CPU torch computes, and leaves the thread's
multithreading setting as it found it."""

from __future__ import annotations

import threading
from typing import Any, Iterator

import pytest

torch = pytest.importorskip("torch")

import ember.torch  # noqa: E402,F401
from ember.torch import _dispatch as D  # noqa: E402

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def threads_seen(monkeypatch) -> Iterator[set[str]]:
    """The names of the threads that ran ember kernels."""
    seen: set[str] = set()
    generic = D._generic

    def noting(op: Any, args: Any, kwargs: Any) -> Any:
        seen.add(threading.current_thread().name)
        return generic(op, args, kwargs)
    monkeypatch.setattr(D, "_generic", noting)
    yield seen


def _grads(device: str, grad_api: bool = False) -> list[Any]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)).to(device)
    x = torch.arange(24.0).reshape(3, 8).div(10).to(device)
    loss = m(x).square().mean()
    if grad_api:
        return [g.cpu() for g in torch.autograd.grad(loss, list(m.parameters()))]
    loss.backward()
    return [p.grad.cpu() for p in m.parameters()]


@pytest.mark.parametrize("grad_api", [False, True], ids=["backward", "autograd.grad"])
def test_backward_runs_on_the_calling_thread_with_cpu_s_gradients(threads_seen: set[str], grad_api: bool) -> None:
    want = _grads("cpu", grad_api)
    threads_seen.clear()
    got = _grads("ember", grad_api)
    assert threads_seen == {threading.current_thread().name}  # no autograd device thread ran a kernel
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    assert torch._C._is_multithreading_enabled()  # as it was


def test_a_user_s_own_setting_is_kept(threads_seen: set[str]) -> None:
    with torch.autograd.set_multithreading_enabled(False):
        _grads("ember")
        assert not torch._C._is_multithreading_enabled()
    assert torch._C._is_multithreading_enabled()


def test_only_a_backward_from_ember_roots_changes_the_setting() -> None:
    """Seen from a gradient hook while the engine runs: off for ember roots, as torch has it for CPU roots."""
    for device, want in (("cpu", True), ("ember", False)):
        during: list[bool] = []
        w = torch.ones(4, device=device, requires_grad=True)
        w.register_hook(lambda g: during.append(torch._C._is_multithreading_enabled()))
        (w * 2).sum().backward()
        assert during == [want], device
        assert torch._C._is_multithreading_enabled()
