"""ember.torch aliases exactly as torch: views, in-place ops, out=, resize_, .data, detach, optimizer updates.

Every scenario runs on local CPU torch and on ember; every tensor it returns must be equal
(values, shape, strides, offsets, dtype), and so must gradients where it computes some.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest

torch = pytest.importorskip("torch")

import ember.torch  # noqa: E402,F401

pytestmark = pytest.mark.timeout(60)

Scenario = Callable[[str], Any]
SCENARIOS: dict[str, Scenario] = {}


def scenario(f: Scenario) -> Scenario:
    SCENARIOS[f.__name__] = f
    return f


def base(device: str, *shape: int) -> Any:
    return torch.arange(float(torch.Size(shape).numel())).reshape(shape).to(device)


@scenario
def views_of_views(d: str) -> Any:
    x = base(d, 4, 6)
    v = x[1:, ::2].t()[1]
    v.mul_(-1)
    w = x.view(2, 12)[:, 3:9].reshape(2, 3, 2)
    w[0].add_(100)
    return x, v, w


@scenario
def slice_iadd(d: str) -> Any:
    x = base(d, 5, 4)
    x[::2, 1] += 7
    x[1:3] += x[3:5]
    return x


@scenario
def transpose_fill(d: str) -> Any:
    x = base(d, 3, 4)
    x.t()[0].fill_(-5)
    x.diagonal().sub_(1)
    return x


@scenario
def split_unbind_aliases(d: str) -> Any:
    x = base(d, 6, 3)
    a, b, c = x.split(2)
    b.copy_(a * 10)
    for row in c.unbind(0):
        row.add_(row)
    return x, a, b, c


@scenario
def index_put_through_view(d: str) -> Any:
    x = base(d, 3, 4)
    flat = x.view(-1)
    flat[torch.tensor([0, 5, 11])] = torch.tensor([-1.0, -2.0, -3.0]).to(d)
    return x, flat


@scenario
def expand_reads_and_masks(d: str) -> Any:
    x = base(d, 1, 4)
    y = x.expand(3, 4) * torch.arange(3.0).reshape(3, 1).to(d)
    m = y > 4
    return y, y[m], m.nonzero(), y.masked_fill(m, 0.5)


@scenario
def out_with_resize(d: str) -> Any:
    a, b = base(d, 3, 3), base(d, 3, 3)
    out = torch.empty(0, device=d)
    torch.add(a, b, out=out)
    out2 = torch.empty(2, 2, device=d)
    torch.matmul(a, b, out=out2)  # out= of the wrong shape is resized
    return out, out2


@scenario
def resize_and_inplace_views(d: str) -> Any:
    x = base(d, 2, 3)
    x.resize_(3, 4)
    x.view(-1)[6:].fill_(9)  # the grown part (uninitialised in torch, zeros on a peer), written
    y = base(d, 2, 3)
    y.t_()
    y.unsqueeze_(0)
    z = base(d, 4, 1)
    z.squeeze_(1)
    return x, x[2], y, z


@scenario
def data_and_detach(d: str) -> Any:
    p = torch.nn.Parameter(base(d, 2, 2))
    q = p.detach()
    q.add_(1)
    p.data.mul_(2)
    p.data = base(d, 2, 2) + 10  # rebinds to another storage
    return p.detach(), q


@scenario
def inplace_on_view_of_non_leaf_with_autograd(d: str) -> Any:
    w = torch.nn.Parameter(base(d, 3, 3) / 10)
    h = w * 2
    h[:, 1].mul_(3)  # in-place on a view of a non-leaf
    h.t()[0].exp_()
    loss = (h ** 2).sum()
    loss.backward()
    return h.detach(), w.grad


@scenario
def dtype_views_and_conversions(d: str) -> Any:
    x = base(d, 2, 4)
    i = x.to(torch.int32)
    v = x.view(torch.int32)
    h = x.to(torch.float16).to(torch.bfloat16)
    return i, v, h.float(), x.double().sum(1)


@scenario
def as_strided_and_narrow(d: str) -> Any:
    x = base(d, 16)
    y = x.as_strided((3, 3), (4, 1), 2)
    y.add_(1)
    z = x.narrow(0, 10, 4).view(2, 2)
    z.zero_()
    return x, y, z


@scenario
def optimizer_updates_in_place(d: str) -> Any:
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 2).to(d)
    alias = lin.weight.data  # an alias of the parameter: sees the optimizer's in-place update
    opt = torch.optim.SGD(lin.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        opt.zero_grad()
        lin(base(d, 4, 3)).sum().backward()
        opt.step()
    return alias, lin.bias.detach(), opt.state[lin.weight]["momentum_buffer"]


def flat(x: Any) -> list[Any]:
    if isinstance(x, (tuple, list)):
        return [t for v in x for t in flat(v)]
    return [x]


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_aliasing_matches_cpu(name: str) -> None:
    local, remote = flat(SCENARIOS[name]("cpu")), flat(SCENARIOS[name]("ember"))
    assert len(local) == len(remote)
    for k, (a, b) in enumerate(zip(local, remote)):
        assert b.device.type == "ember", f"output {k} is on {b.device}"
        assert (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype), f"output {k}"
        assert a.storage_offset() == b.storage_offset(), f"output {k}"
        assert torch.equal(a, b.cpu()), f"output {k} differs:\n{a}\n{b.cpu()}"
