"""Tiny Hugging Face models of several families, unchanged, train and generate on ember bit-equal to local CPU:
RoPE with grouped-query attention (Llama), a learned attention bias as SDPA's mask (T5), a Mixture of Experts
routed by ``histc`` and grouped matmuls (Mixtral), ALiBi (BLOOM), an encoder-decoder (BART), GPT-2 in bfloat16.
Each found a bug when first run this way (the mask's requires_grad, float32 grouped matmuls, integer ``histc``,
a half-precision LayerNorm's statistics typed as CUDA types them)."""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest

torch = pytest.importorskip("torch")
T = pytest.importorskip("transformers")

import ember  # noqa: E402
import ember.torch  # noqa: E402,F401

pytestmark = pytest.mark.timeout(300)
D = dict(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
         max_position_embeddings=32)
MODELS: dict[str, Callable[[], Any]] = {
    "llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(**D, num_key_value_heads=2)),
    "t5": lambda: T.T5ForConditionalGeneration(T.T5Config(vocab_size=101, d_model=32, d_ff=64, d_kv=8, num_layers=2,
                                                          num_heads=4, dropout_rate=0.0, decoder_start_token_id=0,
                                                          pad_token_id=0)),
    "mixtral": lambda: T.MixtralForCausalLM(T.MixtralConfig(**D, num_key_value_heads=2, num_local_experts=4,
                                                            num_experts_per_tok=2)),
    "bloom": lambda: T.BloomForCausalLM(T.BloomConfig(vocab_size=101, hidden_size=32, n_layer=2, n_head=4,
                                                      hidden_dropout=0.0, attention_dropout=0.0)),
    "bart": lambda: T.BartForConditionalGeneration(T.BartConfig(
        vocab_size=101, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=2, forced_eos_token_id=None)),
    # LayerNorm in half precision: CPU keeps its saved statistics in bfloat16, its meta kernel says float32
    "gpt2-bfloat16": lambda: T.GPT2LMHeadModel(T.GPT2Config(vocab_size=101, n_embd=32, n_layer=2, n_head=4,
                                                           n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                                                           attn_pdrop=0.0)).to(torch.bfloat16),
}


def run(kind: str, device: str) -> tuple[list[float], list[Any], Any]:
    torch.manual_seed(0)
    m = MODELS[kind]().to(device)
    o = torch.optim.AdamW(m.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        ids = torch.randint(3, 101, (2, 12), generator=g)
        labels = ids.flip(1) if kind in ("t5", "bart") else ids
        out = m(input_ids=ids.to(device), attention_mask=torch.ones_like(ids).to(device), labels=labels.to(device))
        o.zero_grad()
        out.loss.backward()
        o.step()
        losses.append(out.loss.item())
    m.eval()
    prompt = torch.randint(3, 101, (1, 4), generator=g)
    with torch.no_grad():
        gen = m.generate(prompt.to(device), attention_mask=torch.ones_like(prompt).to(device), max_new_tokens=4,
                         do_sample=False, pad_token_id=0)
    return losses, [p.detach().cpu() for p in m.parameters()], gen.cpu()


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_a_tiny_model_trains_and_generates_bit_equal_to_local_cpu(kind: str) -> None:
    with ember.connect("local:torch"):
        cpu, remote = run(kind, "cpu"), run(kind, "ember")
    assert remote[0] == cpu[0]
    assert all(torch.equal(a, b) for a, b in zip(cpu[1], remote[1]))
    assert torch.equal(cpu[2], remote[2])


def test_convolutions_and_pixel_shuffle_lay_out_their_outputs_as_cpu_does() -> None:
    """A convolution of a channels-last input gives a channels-last output on CPU (ConvNeXt's depthwise
    convolutions after a permute). torch's meta kernel says contiguous; the client now asks CPU's own rules,
    so the layouts match and so does a reduction over the result (ConvNeXt's pooled mean was 2e-7 off)."""
    torch.manual_seed(0)
    x = torch.randn(2, 8, 6, 6).contiguous(memory_format=torch.channels_last)
    convs = [torch.nn.Conv2d(8, 8, 3, padding=1, groups=8), torch.nn.Conv2d(8, 4, 3), torch.nn.Conv1d(8, 4, 3)]
    with ember.connect("local:torch"):
        for conv in convs:
            inp = x if isinstance(conv, torch.nn.Conv2d) else x[:, :, 0]
            xc = inp.clone().requires_grad_()
            xe = xc.detach().to("ember").requires_grad_()
            assert xe.stride() == xc.stride()
            yc = conv(xc)
            yc.mean([-1]).pow(2).sum().backward()
            ye = copy.deepcopy(conv).to("ember")(xe)
            ye.mean([-1]).pow(2).sum().backward()
            assert ye.stride() == yc.stride()
            assert xe.grad.stride() == xc.grad.stride() and torch.equal(xe.grad.cpu(), xc.grad)
            assert torch.equal(ye.detach().cpu(), yc.detach())
        xe = x.to("ember")
        assert torch.pixel_shuffle(xe, 2).stride() == torch.pixel_shuffle(x, 2).stride()  # (channels-last too)


@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_a_compiled_model_trains_as_eager_on_cpu(kind: str) -> None:
    """``torch.compile(model, backend="ember")`` of Hugging Face's Llama and Mixtral. Llama's traced graph copies
    tensor constants with ``lift_fresh_copy``, which a peer refuses by name; the client sends it as the
    ``clone`` it is. Mixtral's experts run a custom op that reads its offsets: those graphs run op by op (a
    replay would repeat the first call's slices). Both train bit-equal to eager local CPU."""
    def train(device: str, compiled: bool) -> tuple[list[float], list[Any]]:
        torch.manual_seed(0)
        m = MODELS[kind]().to(device)
        f = torch.compile(m, backend="ember") if compiled else m
        o = torch.optim.AdamW(m.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(3):
            ids = torch.randint(3, 101, (2, 12), generator=g)
            out = f(input_ids=ids.to(device), labels=ids.to(device))
            o.zero_grad()
            out.loss.backward()
            o.step()
            losses.append(out.loss.item())
        return losses, [p.detach().cpu() for p in m.parameters()]
    with ember.connect("local:torch"):
        cpu, compiled = train("cpu", False), train("ember", True)
    assert compiled[0] == cpu[0]
    assert all(torch.equal(a, b) for a, b in zip(cpu[1], compiled[1]))


def test_save_pretrained_of_a_model_on_ember_reloads_equal_with_its_tied_weights(tmp_path: Any) -> None:
    """``save_pretrained`` tells tied weights apart by their storages' ``data_ptr()``, which raised for an ember
    storage ("invalid python storage"); it is now each storage's identity. The checkpoint reloads equal, tied
    weights stay one storage, and a seeded sampling ``generate()`` draws the same tokens as local CPU."""
    cfg = T.LlamaConfig(**D, num_key_value_heads=2, tie_word_embeddings=True)
    with ember.connect("local:torch"):
        torch.manual_seed(0)
        m = T.LlamaForCausalLM(cfg).to("ember")
        st = [p.untyped_storage() for p in m.parameters()]
        assert len({s.data_ptr() for s in st}) == len(st)  # (tied: one parameter, one storage)
        m.save_pretrained(tmp_path)
        cpu = T.LlamaForCausalLM.from_pretrained(tmp_path)
        want = m.state_dict()
        assert all(torch.equal(v, want[k].cpu()) for k, v in cpu.state_dict().items())
        back = T.LlamaForCausalLM.from_pretrained(tmp_path).to("ember")
        head, emb = back.lm_head.weight, back.model.embed_tokens.weight
        assert head.untyped_storage().data_ptr() == emb.untyped_storage().data_ptr()
        ids = torch.randint(3, 101, (1, 4))
        torch.manual_seed(5)
        a = cpu.generate(ids, max_new_tokens=6, do_sample=True, top_k=10, top_p=0.9)
        torch.manual_seed(5)
        b = back.generate(ids.to("ember"), max_new_tokens=6, do_sample=True, top_k=10, top_p=0.9)
        assert torch.equal(a, b.cpu())
