"""The dispatch fast path (``_dispatch._fast_walk``): taken for repeated positional-only calls, and what it
returns is what the generic path returns — after a layout change, an alias, an in-place op, a view, a new
literal or a new scalar value, every result equals local CPU torch (values, shape, strides, offset, dtype)."""

from __future__ import annotations

from typing import Any, Callable

import pytest

torch = pytest.importorskip("torch")

import ember  # noqa: E402
import ember.torch  # noqa: E402
from ember.torch import _dispatch as D  # noqa: E402
from ember.torch._devices import WrongDevice  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def same(a: Any, b: Any) -> None:
    if isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            same(x, y)
        return
    assert b.device.type == "ember"
    assert (a.shape, a.stride(), a.storage_offset(), a.dtype) == (b.shape, b.stride(), b.storage_offset(), b.dtype)
    assert torch.equal(a, b.cpu()), f"{a}\n{b.cpu()}"


def both(f: Callable[[str], Any]) -> None:
    """Run ``f`` on CPU and on ember, twice (the second run hits the fast cache), and compare every result."""
    for _ in range(2):
        same(f("cpu"), f("ember"))


def data(device: str, *shape: int, start: float = 0.0) -> Any:
    return (torch.arange(float(torch.Size(shape).numel())) + start).reshape(shape).to(device)


def test_repeated_positional_calls_take_the_fast_path() -> None:
    a, b = data("ember", 4, 4), data("ember", 4, 4, start=3.0)
    for f in (lambda: a + b, lambda: torch.mm(a, b), lambda: a.relu(), lambda: a.view(16), lambda: a.t(),
              lambda: a * 2.0, lambda: torch.cat([a, b], 1), lambda: a.sum(0, True)):
        f()  # (the generic path: fills the fast cache)
        n = D.counters["fast"]
        for _ in range(3):
            f()
        assert D.counters["fast"] == n + 3
    n = D.counters["fast"]
    a.add(b, alpha=2)  # keyword arguments: the generic path
    assert D.counters["fast"] == n


def test_layout_change_gives_the_right_answer() -> None:
    def f(d: str) -> Any:
        x, y = data(d, 4, 6), data(d, 6, 4, start=1.0)
        return x + y.t(), x[:, ::2] + y.t()[:, 1::2], x[1:] * y.t()[1:], torch.mm(x, y), torch.mm(y.t().t(), x)
    both(f)


def test_aliases_give_the_right_answer() -> None:
    def f(d: str) -> Any:
        x, y = data(d, 4, 4), data(d, 4, 4, start=5.0)
        r = [x + y, x + x, x + x.t(), x[0] + x[1]]
        z = data(d, 4, 4)
        z.add_(z)  # the operand is its own source
        w = data(d, 4, 4)
        w.add_(y)
        v = data(d, 4, 4)
        v.add_(v.t().contiguous())
        u = data(d, 4, 4)
        u[2:].add_(u[:2])  # two views of one storage
        return (*r, z, w, v, u)
    both(f)


def test_in_place_and_views_give_the_right_answer() -> None:
    def f(d: str) -> Any:
        x = data(d, 3, 4)
        v = x.view(12)
        t = x.t()
        s = x.as_strided((2, 2), (4, 1), 1)
        x.mul_(2.0)
        v.add_(1.0)
        t.sub_(x.t())
        k = x.view(2, 6)  # another literal
        k2 = x.view(6, 2)
        return x, v, t, s, k, k2
    both(f)


def test_new_scalar_values_reach_the_peer() -> None:
    def f(d: str) -> Any:
        x = data(d, 2, 3)
        return [x * s for s in (2.0, 3.5, -1.0)] + [x.add(x, alpha=a) for a in (1, 2)] + [torch.clamp(x, 1.0, 4.0),
                                                                                        torch.clamp(x, 0.5, 2.0)]
    both(f)


def test_dtype_and_list_arguments() -> None:
    def f(d: str) -> Any:
        x, y = data(d, 2, 3), data(d, 2, 3, start=1.0)
        i = torch.tensor([1, 0, 1], device=d)
        return (torch.cat([x, y], 0), torch.cat([x, y, x], 1), torch.stack([x, y]), x.to(torch.float64),
                x.sum(1, dtype=torch.float64), x.index_select(1, i), torch.where(x > 2, x, y))
    both(f)


def test_bad_calls_after_a_fast_entry_still_fail_typed() -> None:
    a, b = data("ember", 4, 4), data("ember", 4, 4)
    for _ in range(2):
        a + b
    with pytest.raises(WrongDevice):
        a + data("cpu", 4, 4)
    with pytest.raises(RuntimeError):
        torch.mm(a, data("ember", 3, 3))
    with pytest.raises(RuntimeError):
        a.view(5)


def test_fast_path_on_torch_autograd_thread() -> None:
    """The backward runs ember kernels on torch's autograd thread: its repeated calls take the fast path too,
    and the gradients equal CPU's."""
    def f(d: str) -> Any:
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)).to(d)
        x = data(d, 5, 6) / 30
        for _ in range(2):
            m.zero_grad()
            m(x).square().sum().backward()
        return [p.grad for p in m.parameters()]
    n = D.counters["fast"]
    both(f)
    assert D.counters["fast"] > n
