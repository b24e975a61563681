"""StableLM, GPT-NeoX and Phi beyond the engine-vs-transformers tests (tests/models/test_engine_architectures.py): the
LayerNorm against torch's own, the fp32 head's final norm, what is refused, and GPT-NeoX's checkpoint names."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers

from replayllm import LLM, SamplingParams
from replayllm.model_runner_v2.models.layers import LayerNorm

SMALL = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _norm(dtype: torch.dtype) -> LayerNorm:
    norm = LayerNorm(48, 1e-5)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(48, generator=g) + 0.5)
        norm.bias.copy_(torch.rand(48, generator=g) - 0.5)
    return norm.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_layer_norm_is_hf_layer_norm_bit_for_bit(dtype):
    norm, ref = _norm(dtype), torch.nn.LayerNorm(48, eps=1e-5).to(dtype)
    ref.load_state_dict(norm.state_dict())
    g = torch.Generator().manual_seed(1)
    x, res = ((torch.randn(5, 48, generator=g) * 3).to(dtype) for _ in range(2))
    assert torch.equal(norm(x), ref(x))
    normed, stream = norm.add_and_norm(x, res)
    assert torch.equal(stream, res + x) and torch.equal(normed, ref(res + x))
    out, again = norm.norm_then(x, res, torch.nn.Identity())
    assert torch.equal(out, normed) and torch.equal(again, stream)
    # the fp32 head's final norm: the add, the norm and its parameters in fp32, the result left in fp32
    fp32 = norm.add_and_norm_fp32(x, res)
    assert fp32.dtype == torch.float32
    assert torch.equal(fp32, F.layer_norm(x.float() + res.float(), (48,), norm.weight.float(), norm.bias.float(),
                                          1e-5))


def test_per_head_layernorm_is_transformers_cohere_and_stablelm_norms_in_bf16():
    """PerHeadLayerNorm (head_norm.py) against transformers' two forms on the same bf16 input and weights: Cohere's
    CohereLayerNorm((heads, head_dim)) bit for bit (the same ops), StableLM's nn.LayerNorm per head (F.layer_norm:
    fp32 inside, one rounding) within one bf16 rounding."""
    from transformers.models.cohere.modeling_cohere import CohereLayerNorm as HFCohereLayerNorm
    from transformers.models.stablelm.modeling_stablelm import StableLmLayerNormPerHead

    from replayllm.model_runner_v2.models.head_norm import PerHeadLayerNorm

    g = torch.Generator().manual_seed(3)
    heads, dim, eps = 4, 32, 1e-5
    x = (torch.randn(7, heads * dim, generator=g) * 3 + 1).to(torch.bfloat16)
    weight = (torch.rand(heads, dim, generator=g) + 0.5).to(torch.bfloat16)
    ours = PerHeadLayerNorm(heads, dim, eps).to(torch.bfloat16)
    ours.weight.data.copy_(weight)
    out = ours(x)
    cohere = HFCohereLayerNorm((heads, dim), eps=eps).to(torch.bfloat16)
    cohere.weight.data.copy_(weight)
    assert torch.equal(out, cohere(x.view(7, heads, dim)).reshape(7, -1))
    stablelm = StableLmLayerNormPerHead(dim, heads, eps=eps).to(torch.bfloat16)
    for h, norm in enumerate(stablelm.norms):
        norm.weight.data.copy_(weight[h])
    theirs = stablelm(x.view(1, 7, heads, dim).transpose(1, 2)).transpose(1, 2).reshape(7, -1)
    torch.testing.assert_close(out.float(), theirs.float(), rtol=2.0**-8, atol=0)


@pytest.mark.parametrize("bad, match", [(dict(hidden_act="relu"), "hidden_act 'relu' is not supported for GPT-NeoX"),
                                        (dict(num_key_value_heads=2), "num_key_value_heads=2")],
                         ids=["activation", "kv-heads"])
def test_gpt_neox_configs_it_would_not_honour_are_refused(tmp_path, bad, match):
    small = {k: v for k, v in SMALL.items() if k != "num_key_value_heads"}
    config = transformers.GPTNeoXConfig(**small, architectures=["GPTNeoXForCausalLM"])
    for key, value in bad.items():
        setattr(config, key, value)  # transformers' GPT-NeoX ignores num_key_value_heads; config.json may carry it
    torch.manual_seed(0)
    transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**small)).save_pretrained(str(tmp_path / "m"))
    config.save_pretrained(str(tmp_path / "m"))
    with pytest.raises(ValueError, match=match):
        LLM(str(tmp_path / "m"), device="cpu", dtype="float32", skip_tokenizer_init=True)


def test_gpt_neox_checkpoint_names_and_old_buffers(tmp_path):
    """An old GPT-NeoX checkpoint's attention mask and rotary buffers are skipped; a fused query_key_value of the
    wrong size is a ValueError naming it, and the engine keeps its weights."""
    small = {k: v for k, v in SMALL.items() if k != "num_key_value_heads"}
    torch.manual_seed(0)
    transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**small)).save_pretrained(str(tmp_path / "m"))
    llm = LLM(str(tmp_path / "m"), device="cpu", dtype="float32", skip_tokenizer_init=True)
    params = dict(max_tokens=4, temperature=0.0, ignore_eos=True)
    before = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(**params), use_tqdm=False)[0]
    old = {"gpt_neox.layers.0.attention.bias": torch.ones(1, 1, 8, 8, dtype=torch.bool),
           "gpt_neox.layers.0.attention.masked_bias": torch.tensor(-1e9),
           "gpt_neox.layers.0.attention.rotary_emb.inv_freq": torch.ones(2)}
    llm.load_weights(old)  # skipped, not "matches no parameter"
    with pytest.raises(ValueError, match=r"query_key_value.weight.*100 rows, not 3 x 4 heads"):
        llm.load_weights({"gpt_neox.layers.1.attention.query_key_value.weight": torch.zeros(100, 64)})
    after = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(**params), use_tqdm=False)[0]
    assert after.outputs[0].token_ids == before.outputs[0].token_ids


def test_phi_gelu_new_is_transformers_bit_for_bit_and_phi_refusals(tmp_path):
    """Phi's `gelu_new` against transformers' NewGELUActivation in bf16, op for op (F.gelu's tanh form rounds
    otherwise); a Phi checkpoint with per-head q/k LayerNorms, or another activation, is refused."""
    from transformers.activations import NewGELUActivation

    from replayllm.model_runner_v2.models.plain_mlp import gelu_new

    x = (torch.randn(4096, generator=torch.Generator().manual_seed(2)) * 4).to(torch.bfloat16)
    assert torch.equal(gelu_new(x), NewGELUActivation()(x))
    assert not torch.equal(gelu_new(x), F.gelu(x, approximate="tanh"))
    for name, bad, match in (("qk", dict(qk_layernorm=True), "qk_layernorm"),
                             ("relu", dict(hidden_act="relu"), "hidden_act 'relu' is not supported for Phi")):
        torch.manual_seed(0)
        transformers.PhiForCausalLM(transformers.PhiConfig(**SMALL, **bad)).save_pretrained(str(tmp_path / name))
        with pytest.raises(ValueError, match=match):
            LLM(str(tmp_path / name), device="cpu", dtype="float32", skip_tokenizer_init=True)


def test_phi_lm_head_bias_in_the_fp32_head(tmp_path):
    """enable_fp32_lm_head on a bf16 Phi: the head's bias goes to fp32 with its weight (F.linear needs both), and
    the logits are the fp32 head's."""
    torch.manual_seed(0)
    transformers.PhiForCausalLM(transformers.PhiConfig(**SMALL)).save_pretrained(str(tmp_path / "m"))
    llm = LLM(str(tmp_path / "m"), device="cpu", dtype="bfloat16", skip_tokenizer_init=True, enable_fp32_lm_head=True)
    dtypes = llm.apply_model(lambda m: (m.lm_head.weight.dtype, m.lm_head.bias.dtype))[0]
    assert dtypes == (torch.float32, torch.float32)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3, temperature=0.0, logprobs=0,
                                                                       ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3
