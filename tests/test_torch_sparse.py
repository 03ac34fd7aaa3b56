"""Sparse COO tensors on ember (``ember/torch/_sparse.py``): made, read, combined and differentiated as on
local CPU torch, on the embedded peer and over WebSocket; what is not held fails with NotImplementedError
naming the op; a hostile sparse tensor's indices never reach a kernel unchecked."""

from __future__ import annotations

from typing import Any, Callable, Iterator

import pytest

torch = pytest.importorskip("torch")

import ember  # noqa: E402
import ember.torch  # noqa: E402,F401

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(params=["embedded", "websocket"])
def where(request: pytest.FixtureRequest) -> Iterator[None]:
    if request.param == "embedded":
        yield
        return
    dev = ember.connect(request.getfixturevalue("torch_peer"))
    with dev:
        yield
    dev.close()  # (the module's peer allows one client 32 sessions)


def _dense() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 5, 3, generator=g, dtype=torch.float64)
    return x * (torch.rand(4, 5, 1, generator=g, dtype=torch.float64) > 0.5)


def _uncoalesced() -> torch.Tensor:
    i = torch.tensor([[3, 0, 3, 1, 0], [2, 1, 2, 4, 1]])
    return torch.sparse_coo_tensor(i, torch.arange(1.0, 16.0, dtype=torch.float64).reshape(5, 3), (4, 5, 3),
                                   check_invariants=True)


def _same(cpu: Any, got: Any) -> None:
    got = got.cpu()
    assert got.layout == cpu.layout and got.dtype == cpu.dtype and got.shape == cpu.shape
    if cpu.is_sparse:
        assert got.is_coalesced() == cpu.is_coalesced()
        assert torch.equal(got._indices(), cpu._indices()) and torch.equal(got._values(), cpu._values())
    else:
        assert torch.equal(got, cpu)


def _matrix() -> torch.Tensor:
    """A 2-d sparse matrix with a repeated index (not coalesced), as a graph's adjacency is often built."""
    i = torch.tensor([[3, 0, 3, 1, 0, 2], [2, 1, 2, 4, 1, 0]])
    return torch.sparse_coo_tensor(i, torch.linspace(-1.0, 2.0, 6, dtype=torch.float64), (4, 5), check_invariants=True)


def _rhs(rows: int = 5) -> torch.Tensor:
    return torch.randn(rows, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64)


CASES: dict[str, Callable[[str], Any]] = {
    "to_sparse": lambda d: _dense().to(d).to_sparse(),
    "to_sparse_1": lambda d: _dense().to(d).to_sparse(1),
    "to_sparse_dense_dim": lambda d: _dense().to(d).to_sparse(layout=torch.sparse_coo, dense_dim=1),
    "to_dense": lambda d: _dense().to(d).to_sparse(2).to_dense(),
    "from_cpu_sparse": lambda d: _uncoalesced().to(d),
    "coalesce": lambda d: _uncoalesced().to(d).coalesce(),
    "coalesce_to_dense": lambda d: _uncoalesced().to(d).to_dense(),
    "indices_values": lambda d: _uncoalesced().to(d).coalesce().values(),
    "sparse_coo_tensor": lambda d: torch.sparse_coo_tensor(
        torch.tensor([[0, 2], [1, 1]], device=d), torch.tensor([1.5, -2.0], device=d), (3, 2),
        check_invariants=False),
    "add": lambda d: (_dense().to(d).to_sparse(2) + _uncoalesced().to(d)).coalesce(),
    "sub": lambda d: (_dense().to(d).to_sparse(2) - _uncoalesced().to(d)).coalesce(),
    "mul_dense": lambda d: _uncoalesced().to(d) * _dense().to(d),
    "mul_scalar": lambda d: _dense().to(d).to_sparse() * 2.5,
    "neg_clone": lambda d: (-_dense().to(d).to_sparse()).clone(),
    "sum": lambda d: _uncoalesced().to(d).sum(),
    "sparse_mask": lambda d: _dense().to(d).sparse_mask(_uncoalesced().to(d).coalesce()),
    "mm": lambda d: torch.mm(_matrix().to(d), _rhs().to(d)),
    "spmm_coalesced": lambda d: torch.spmm(_matrix().coalesce().to(d), _rhs().to(d)),
    "t": lambda d: _matrix().to(d).t(),
    "t_mm": lambda d: torch.mm(_matrix().to(d).t(), _rhs(4).to(d)),
    "sparse.mm": lambda d: torch.sparse.mm(_matrix().to(d), _rhs().to(d)),
    "addmm": lambda d: torch.addmm(_rhs(4).to(d), _matrix().to(d), _rhs().to(d), beta=0.5, alpha=2.0),
    "sparse.addmm": lambda d: torch.sparse.addmm(_rhs(4).to(d), _matrix().to(d), _rhs().to(d)),
    "dense+sparse": lambda d: torch.add(_dense().to(d), _uncoalesced().to(d), alpha=-0.3),
    "dense-sparse_2d": lambda d: _dense()[:, :, 1].to(d) - _matrix().to(d),
    "dense.add_(sparse)": lambda d: _dense().to(d).add_(_uncoalesced().to(d).coalesce(), alpha=0.7),
    "dense.sub_(sparse)": lambda d: _dense()[:, :, 0].to(d).sub_(_matrix().to(d)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_sparse_op_equals_cpu(name: str, where: None) -> None:
    _same(CASES[name]("cpu"), CASES[name]("ember"))


def _grad(d: str) -> tuple[torch.Tensor, torch.Tensor]:
    x = _dense().to(d).requires_grad_()
    w = torch.linspace(0.5, 1.5, 60, dtype=torch.float64).reshape(4, 5, 3).to(d)
    ((x.to_sparse(2) * w).sum() + (x.to_sparse() * 3.0).to_dense().pow(2).sum()).backward()
    return x.grad, x.to_sparse().to_dense()


def test_gradients_through_sparse_ops_equal_cpu(where: None) -> None:
    for want, got in zip(_grad("cpu"), _grad("ember")):
        assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("call", [
    lambda s: s.to_sparse_csr(),
    lambda s: s @ s.t(),
    lambda s: s * s,
    lambda s: s + torch.ones(4, 5, device="ember", dtype=torch.float64),
    lambda s: s.abs(),
], ids=["csr", "mm", "sparse*sparse", "sparse+dense", "abs"])
def test_what_is_not_held_fails_naming_the_op(call: Callable[[Any], Any]) -> None:
    s = _dense()[:, :, 0].to("ember").to_sparse()
    with pytest.raises(NotImplementedError) as e:
        call(s).cpu()
    assert "aten." in str(e.value) or "to_sparse" in str(e.value)  # the op that is not held, by name
    assert torch.equal(s.to_dense().cpu(), _dense()[:, :, 0])  # the tensor and the session carry on


def test_out_of_range_indices_are_refused_by_the_peer_not_read(where: None) -> None:
    """An index past the size (made unchecked, as a hostile caller would) fails at the peer's dense index."""
    i = torch.tensor([[0, 1 << 20]], device="ember")
    s = torch.sparse_coo_tensor(i, torch.tensor([1.0, 2.0], device="ember"), (3,), check_invariants=False)
    with pytest.raises(Exception) as e:
        s.to_dense().cpu()
    assert "index" in str(e.value).lower() or "bound" in str(e.value).lower()
    assert torch.equal(torch.ones(2, device="ember").cpu(), torch.ones(2))


class GCN(torch.nn.Module):
    """pytorch/examples' gcn, small: two graph convolutions (``spmm`` of the sparse adjacency with the features
    times a weight, a sparse feature matrix in the first), ReLU, log-softmax."""

    def __init__(self, n_in: int, n_hidden: int, n_out: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.w1 = torch.nn.Parameter(torch.randn(n_in, n_hidden, generator=g) * 0.3)
        self.w2 = torch.nn.Parameter(torch.randn(n_hidden, n_out, generator=g) * 0.3)

    def forward(self, x: Any, adj: Any) -> Any:
        h = torch.relu(torch.spmm(adj, torch.mm(x, self.w1)))
        return torch.log_softmax(torch.spmm(adj, torch.mm(h, self.w2)), dim=1)


def _gcn(device: str) -> tuple[list[float], list[Any]]:
    g = torch.Generator().manual_seed(1)
    n = 30
    x = (torch.rand(n, 12, generator=g) > 0.7).float()
    edges = torch.randint(0, n, (2, 80), generator=g)
    adj = torch.sparse_coo_tensor(torch.cat([edges, edges.flip(0), torch.arange(n).repeat(2, 1)], 1),
                                  torch.rand(2 * 80 + n, generator=g), (n, n), check_invariants=True)  # repeated edges
    y = torch.randint(0, 4, (n,), generator=g)
    model = GCN(12, 8, 4).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=5e-4)
    xs, adj, y = x.to_sparse().to(device), adj.to(device), y.to(device)
    losses = []
    for _ in range(20):
        opt.zero_grad()
        loss = torch.nn.functional.nll_loss(model(xs, adj), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().cpu() for p in model.parameters()]


def _sparse_embedding(device: str, opt: str) -> tuple[list[float], Any]:
    torch.manual_seed(0)
    emb = torch.nn.Embedding(20, 4, sparse=True).to(device)
    o = getattr(torch.optim, opt)(emb.parameters(), lr=0.1)
    losses = []
    for step in range(4):
        idx = torch.tensor([[1, 2, 2, 5], [7, 1, 0, 19 - step]]).to(device)  # a repeated row: a gradient to coalesce
        loss = (emb(idx) ** 2).sum()
        o.zero_grad()
        loss.backward()
        o.step()
        losses.append(loss.item())
    return losses, emb.weight.detach().cpu()


@pytest.mark.parametrize("opt", ["SGD", "Adagrad", "SparseAdam"])
def test_optimizers_on_a_sparse_embedding_gradient_equal_cpu(opt: str, where: None) -> None:
    """``nn.Embedding(sparse=True)``: each optimizer adds a sparse step to a dense tensor (``param.add_(sparse,
    alpha=-lr)``, Adagrad's and SparseAdam's states too) by CPU's kernel on the peer, which adds each nonzero with a
    fused multiply-add (an ``index_put_`` of the scaled values rounds otherwise)."""
    want, got = _sparse_embedding("cpu", opt), _sparse_embedding("ember", opt)
    assert want[0] == got[0] and torch.equal(want[1], got[1])


def test_a_graph_network_with_a_sparse_adjacency_trains_bit_equal_to_cpu(where: None) -> None:
    """``spmm`` and its backward (``adj.t() @ grad``) by CPU torch's own sparse kernel on the peer, which adds each
    nonzero's products in the order of the nonzeros (no composition of dense ops rounds so)."""
    want, got = _gcn("cpu"), _gcn("ember")
    assert want[0] == got[0]
    assert all(torch.equal(a, b) for a, b in zip(want[1], got[1]))


@pytest.mark.parametrize("change,words", [
    (lambda kw: kw["a"].__setitem__(0, 2), "index|size|bound"),        # fewer rows than an index names
    (lambda kw: kw["a"].__setitem__(2, True), "coalesced"),            # a matrix with a repeated index called coalesced
    (lambda kw: kw["a"].__setitem__(1, 1 << 40), "malformed"),         # a side past the limit
    (lambda kw: kw["l"].__setitem__(0, [[2, 6], [6, 1], 0, "int32"]), "int64"),
], ids=["index-past-rows", "false-coalesced", "huge-side", "int32-indices"])
def test_a_hostile_sparse_mm_is_refused_by_the_peer_and_the_session_goes_on(change: Any, words: str) -> None:
    from ember.errors import RemoteExecutionError
    from test_torch_positions import edit_next_op
    with ember.connect("local:torch"):
        a, b = _matrix().to("ember"), _rhs().to("ember")
        with edit_next_op(change, only="torch.sparse_mm"), pytest.raises(RemoteExecutionError, match=words):
            torch.mm(a, b).cpu()
        assert torch.equal(torch.mm(a, b).cpu(), torch.mm(_matrix(), _rhs()))


@pytest.mark.parametrize("change,words", [
    (lambda kw: kw["l"].__setitem__(0, [[2, 5], [5, 1], 0, "float64"]), "size|index|bound"),  # fewer dense rows
    (lambda kw: kw["a"].__setitem__(0, True), "coalesced"),              # a repeated index called coalesced
    (lambda kw: kw["a"].__setitem__(1, "x"), "malformed"),               # alpha not a number
    (lambda kw: kw["l"][2].__setitem__(3, "float32"), "dtype"),           # values of another dtype than the dense
    (lambda kw: kw["l"][1].__setitem__(3, "int32"), "int64"),
], ids=["index-past-rows", "false-coalesced", "alpha", "values-dtype", "int32-indices"])
def test_a_hostile_sparse_add_is_refused_by_the_peer_and_the_session_goes_on(change: Any, words: str) -> None:
    from ember.errors import RemoteExecutionError
    from test_torch_positions import edit_next_op
    with ember.connect("local:torch"):
        d, s = _dense()[:, :, 0].to("ember"), _matrix().to("ember")
        with edit_next_op(change, only="torch.sparse_add"), pytest.raises(RemoteExecutionError, match=words):
            (d + s).cpu()
        assert torch.equal((d + s).cpu(), _dense()[:, :, 0] + _matrix())


def test_a_sparse_tensor_scaled_or_copied_in_place_equals_cpu(where: None) -> None:
    """``sparse.mul_(number)``, ``torch._foreach_mul_`` over sparse tensors (its ``mul.out`` passes the number first)
    and ``sparse.copy_(sparse)``: values scaled, indices and values copied, as CPU does."""
    want, got = _uncoalesced(), _uncoalesced().to("ember")
    want.mul_(0.5)
    got.mul_(0.5)
    torch._foreach_mul_([want], 0.9)
    torch._foreach_mul_([got], 0.9)
    _same(want, got)
    dst = _dense().to("ember").to_sparse(2)
    dst.copy_(got)
    _same(want, dst)
