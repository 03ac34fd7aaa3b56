"""torch.func transforms, forward-mode AD and double backward through the layers ember runs its own way (attention's
kernel choice, nn.GRU / nn.RNN a layer per peer call, nn.LSTM by oneDNN, the fused cells): they work, and equal CPU.

Found by a sweep of functional and higher-order autograd code (per-sample gradients, WGAN-GP, Hessians)."""

from __future__ import annotations

from typing import Any, Callable

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn
F = nn.functional

import ember.torch  # noqa: E402,F401

pytestmark = pytest.mark.timeout(180)


def _both(run: Callable[[str], Any]) -> tuple[Any, Any]:
    return run("cpu"), run("ember")


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return torch.equal(a, b.cpu())


LAYERS: dict[str, Callable[[], nn.Module]] = {
    "gru": lambda: nn.GRU(4, 6, batch_first=True), "rnn": lambda: nn.RNN(4, 6, batch_first=True),
    "lstm": lambda: nn.LSTM(4, 6, batch_first=True), "lstm_cell": lambda: nn.LSTMCell(4, 6),
    "gru_cell": lambda: nn.GRUCell(4, 6), "attention": lambda: nn.MultiheadAttention(4, 2, batch_first=True)}


def _forward(name: str, m: nn.Module, x: Any) -> Any:
    if name.endswith("cell"):
        out = m(x[:, 0])
        return out[0] if isinstance(out, tuple) else out
    if name == "attention":
        return m(x, x, x, need_weights=False)[0]
    return m(x)[0]


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_per_sample_gradients_with_torch_func_equal_cpu(name: str) -> None:
    """torch.func.grad over a layer's parameters, per sample (vmap'd where CPU torch can: not the recurrent layers,
    whose in-place cells vmap refuses there too): on ember the layers' own kernels met functorch's wrappers
    ("Cannot access storage of TensorWrapper")."""
    from torch.func import functional_call, grad, vmap

    def run(dev: str) -> Any:
        torch.manual_seed(0)
        m = LAYERS[name]().to(dev)
        params = {k: v.detach() for k, v in m.named_parameters()}
        x = torch.randn(3, 5, 4).to(dev)

        def loss(p: Any, xi: Any) -> Any:
            return _forward(name, lambda *a, **k: functional_call(m, p, a, k), xi[None]).square().sum()  # type: ignore[arg-type]
        if name == "attention":
            return vmap(grad(loss), in_dims=(None, 0))(params, x)
        return [grad(loss)(params, xi) for xi in x]
    cpu, em = _both(run)
    assert _equal(cpu, em)


@pytest.mark.parametrize("name", ["gru", "rnn", "lstm_cell", "gru_cell"])  # (CPU: none for LSTM)
def test_forward_mode_ad_through_recurrent_layers_equals_cpu(name: str) -> None:
    import torch.autograd.forward_ad as fwAD

    def run(dev: str) -> Any:
        torch.manual_seed(0)
        m = LAYERS[name]().to(dev)
        x, t = torch.randn(2, 5, 4).to(dev), torch.randn(2, 5, 4).to(dev)
        with fwAD.dual_level():
            out = _forward(name, m, fwAD.make_dual(x, t))
            return fwAD.unpack_dual(out).tangent
    cpu, em = _both(run)
    assert _equal(cpu, em)


@pytest.mark.parametrize("name", ["gru", "rnn"])
def test_a_gradient_penalty_through_a_recurrent_layer_reaches_its_weights(name: str) -> None:
    """WGAN-GP: ``autograd.grad(create_graph=True)`` through nn.GRU / nn.RNN. The layer's backward was one peer call
    whose results autograd took for constants: the penalty silently added nothing to the weights' gradients."""
    def run(dev: str, penalty: bool = True) -> dict[str, Any]:
        torch.manual_seed(0)
        rnn, head = LAYERS[name]().to(dev), nn.Linear(6, 1).to(dev)
        torch.manual_seed(1)
        x = torch.randn(4, 5, 4).to(dev).requires_grad_(True)
        (g,) = torch.autograd.grad(head(rnn(x)[0][:, -1]).sum(), x, create_graph=True)
        loss = head(rnn(x)[0][:, -1]).mean() + (10 * ((g.flatten(1).norm(2, dim=1) - 1) ** 2).mean() if penalty else 0)
        loss.backward()
        return {k: p.grad.cpu() for k, p in [*rnn.named_parameters(), *head.named_parameters()]}
    cpu, em, without = run("cpu"), run("ember"), run("ember", penalty=False)
    for k in cpu:  # (the recomputed layer sums the two paths' contributions in another order: last bits)
        torch.testing.assert_close(em[k], cpu[k], rtol=1e-5, atol=1e-6)
    assert any(not torch.allclose(without[k], cpu[k]) for k in cpu if k.startswith("weight_hh"))


def test_hessian_through_a_gru_equals_cpu() -> None:
    def run(dev: str) -> Any:
        torch.manual_seed(0)
        m = nn.GRU(2, 3).to(dev)
        x = torch.randn(4, 1, 2).to(dev)
        return torch.autograd.functional.hessian(lambda v: m(v)[0].square().sum(), x)
    cpu, em = _both(run)
    assert cpu.abs().max() > 0
    torch.testing.assert_close(em.cpu(), cpu, rtol=1e-5, atol=1e-6)


def test_attention_picks_cpu_s_kernel_under_inference_mode_and_sdpa_kernel() -> None:
    """The kernel choice is registered on the device's key too (inference mode skips autograd's), and on a CPU peer
    it is CPU torch's own, so ``sdpa_kernel`` contexts count."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 7, 8) for _ in range(3))
    for ctx in (torch.inference_mode, lambda: sdpa_kernel(SDPBackend.MATH),
                lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION)):
        with ctx():
            want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            got = F.scaled_dot_product_attention(q.to("ember"), k.to("ember"), v.to("ember"), is_causal=True)
        assert torch.equal(got.cpu(), want)


def test_a_cpu_peer_s_attention_choice_costs_no_round_trip_for_new_shapes() -> None:
    """A decode step's key length grows by one each token: the choice was asked of the peer for each new shape
    (two round trips a token in ``generate``); a CPU peer's is CPU torch's, computed here."""
    q = torch.randn(1, 2, 1, 8).to("ember")
    from ember.torch._devices import current_device
    s = current_device().session
    before = s.stats["reads"]
    for n in range(3, 9):
        kv = torch.randn(1, 2, n, 8).to("ember")
        F.scaled_dot_product_attention(q, kv, kv)
    assert s.stats["reads"] == before


@pytest.mark.parametrize("case", ["unsqueeze_", "transpose_", "swin_head", "channels_last_pool"])
def test_in_place_views_compile(case: str) -> None:
    """torch.compile's functionalization fixes its wrappers' layouts by running in-place views on them (a channels-last
    ``adaptive_avg_pool2d(x, 1)`` is ``mean(...).as_strided_(...)``): they failed on tensors with no peer storage."""
    fs: dict[str, Callable[[Any], Any]] = {
        "unsqueeze_": lambda x: (x * 2).unsqueeze_(0), "transpose_": lambda x: (x * 2).transpose_(0, 1),
        "swin_head": lambda x: F.adaptive_avg_pool1d(x.transpose(1, 2), 1).flatten(1),
        "channels_last_pool": lambda x: F.adaptive_avg_pool2d(x, 1).flatten(1)}
    torch.manual_seed(0)
    x = {"unsqueeze_": torch.randn(3, 2), "transpose_": torch.randn(3, 2), "swin_head": torch.randn(2, 6, 4),
         "channels_last_pool": torch.randn(2, 4, 3, 3).to(memory_format=torch.channels_last)}[case]
    torch._dynamo.reset()
    got = torch.compile(fs[case], backend="ember")(x.to("ember"))
    want = fs[case](x)
    assert torch.equal(got.cpu(), want) and got.stride() == want.stride()


def test_compiled_torch_func_grad_through_group_norm_runs() -> None:
    """``torch.compile`` of ``torch.func.grad`` through nn.GroupNorm: its backward's ``unsqueeze_`` on a traced
    wrapper raised inside autograd's engine, which aborted the process (a device guard cannot throw there). Run in
    a child process, so that an abort fails this test only."""
    import subprocess
    import sys
    code = ("import torch, torch.nn as nn, ember.torch\n"
            "from torch.func import grad\n"
            "torch.manual_seed(0)\n"
            "gn, x = nn.GroupNorm(2, 4), torch.randn(3, 4, 5)\n"
            "f = lambda m, x: grad(lambda z: m(z).pow(3).sum())(x)\n"
            "want = f(gn, x)\n"
            "gn.to('ember')\n"
            "got = torch.compile(lambda x: f(gn, x), backend='ember')(x.to('ember'))\n"
            "torch.testing.assert_close(got.cpu(), want)\n"
            "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=150,
                       env={**__import__("os").environ, "EMBER_OFFLINE": "1"})
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


def test_multihead_attention_s_inference_fast_path_equals_cpu() -> None:
    """nn.MultiheadAttention in eval takes ``_native_multi_head_attention``, whose CPU kernel projects q, k and v with
    one GEMM when they are one tensor: the peer saw three operands (6e-8 off); now one, and copies where CPU's were
    different tensors of the same memory."""
    torch.manual_seed(0)
    m = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    x, y = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    with torch.no_grad():
        want = [m(x, x, x), m(x, y, y), m(x, x.detach(), x)]
        m.to("ember")
        xe, ye = x.to("ember"), y.to("ember")
        got = [m(xe, xe, xe), m(xe, ye, ye), m(xe, xe.detach(), xe)]
    for w, g in zip(want, got):
        assert torch.equal(g[0].cpu(), w[0]) and torch.equal(g[1].cpu(), w[1])
