"""Elementwise ops lay their outputs out as CPU torch's TensorIterator does (ember/torch/_iter_layout.py): the
meta kernels (Python decompositions for many) differ on size-1 dims with odd strides and on mixed layouts, and the
next reduction over the output then rounded otherwise (a BatchNorm after a 1x1 feature map, an ELU network's bias
gradient, a frequency-domain loss). Strides compared with local CPU torch's over permuted and odd layouts."""

from __future__ import annotations

import itertools
from typing import Any, Callable

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional
A = torch.ops.aten

import ember.torch  # noqa: E402,F401

pytestmark = pytest.mark.timeout(300)


def _layouts() -> list[Any]:
    out = []
    torch.manual_seed(0)
    for shape in ((4, 8, 1, 1), (1, 2, 3, 4), (3, 1, 5)):
        for perm in itertools.permutations(range(len(shape))):
            t = torch.randn([shape[p] for p in perm]).permute([perm.index(k) for k in range(len(shape))])
            out.append(t)
        odd = [7 if n == 1 else s for n, s in zip(shape, torch.empty(shape).stride())]
        out.append(torch.empty_strided(shape, odd).copy_(torch.randn(shape)))
    return out


UNARY: dict[str, Callable[[Any], Any]] = {
    "gelu": F.gelu, "relu": F.relu, "hardswish": F.hardswish, "silu": F.silu, "sigmoid": torch.sigmoid,
    "exp": torch.exp, "neg": torch.neg, "gt scalar": lambda t: t > 0, "mul number": lambda t: t * 2.0,
    "add.Scalar": lambda t: A.add.Scalar(t, 1.5), "fmod": lambda t: torch.fmod(t, 0.7),
    "where scalar": lambda t: torch.where(t > 0, t, 0.0), "to double": lambda t: t.double(), "elu": F.elu,
    "hardtanh": F.hardtanh, "2 ** t": lambda t: 2.0 ** t, "clamp": lambda t: t.clamp(-0.5, 0.5),
    "broadcast add": lambda t: t + t[..., :1], "not": lambda t: ~(t > 0)}
BINARY: dict[str, Callable[[Any, Any], Any]] = {
    "add": torch.add, "where": lambda x, y: torch.where(x > 0, x, y), "copysign": torch.copysign,
    "xlogy": lambda x, y: torch.xlogy(x.abs(), y.abs()),
    "elu_backward": lambda g, x: A.elu_backward(g, 1.0, 1, 1, False, x),
    "threshold_backward": lambda g, x: A.threshold_backward(g, x, 0.0),
    "leaky_relu_backward": lambda g, x: A.leaky_relu_backward(g, x, 0.01, False),
    "softplus_backward": lambda g, x: A.softplus_backward(g, x, 1, 20),
    "hardswish_backward": lambda g, x: A.hardswish_backward(g, x), "lerp": lambda x, y: torch.lerp(x, y, 0.3)}


@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary_elementwise_layouts_are_cpu_s(name: str) -> None:
    f = UNARY[name]
    for t in _layouts():
        want, got = f(t), f(t.to("ember"))
        assert got.stride() == want.stride(), (tuple(t.shape), t.stride(), want.stride(), got.stride())
        assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary_elementwise_layouts_are_cpu_s(name: str) -> None:
    f = BINARY[name]
    ts = _layouts()
    for a, b in itertools.product(ts, ts):
        if a.shape != b.shape:
            continue
        want, got = f(a, b), f(a.to("ember"), b.to("ember"))
        assert got.stride() == want.stride(), (tuple(a.shape), a.stride(), b.stride(), want.stride(), got.stride())


def test_n_dimensional_complex_ffts_are_laid_out_as_on_cpu() -> None:
    torch.manual_seed(0)
    for x in (torch.randn(3, 4, 5, 6, dtype=torch.complex64), torch.randn(2, 3, 4, 5, 6).transpose(1, 3)):
        for f in (torch.fft.fftn, torch.fft.ifftn, torch.fft.irfftn, torch.fft.hfftn):
            want, got = f(x), f(x.to("ember"))
            assert got.stride() == want.stride() and torch.equal(got.cpu(), want)


def test_lstsq_s_solution_is_laid_out_as_on_cpu() -> None:
    """CPU's solution is column-major in each matrix, a view of a buffer of max(m, n) rows: a sum over it, and
    ``view``, behave as there (the meta kernel made it contiguous)."""
    torch.manual_seed(0)
    for m, n in ((5, 3), (3, 5), (4, 4)):
        a, b = torch.randn(3, m, n, dtype=torch.float64), torch.randn(3, m, 2, dtype=torch.float64)
        want = torch.linalg.lstsq(a, b, driver="gelsd").solution
        got = torch.linalg.lstsq(a.to("ember"), b.to("ember"), driver="gelsd").solution
        assert got.stride() == want.stride() and torch.equal(got.cpu(), want)
        assert torch.equal(got.sum().cpu(), want.sum())
