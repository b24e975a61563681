"""Gemma's pieces against transformers' own, bit for bit (the engine-vs-transformers logprobs, weight updates,
batch invariance and tensor parallelism: tests/models/test_engine_architectures.py): the (1 + weight) RMSNorm, the
GeGLU, and the embedding scale rounded to the model dtype; the batch-invariant GeGLU's rows; Gemma 3's rope per kind
of layer, its unstretched limit and its refusals."""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers.tolerances import rounding_tol
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

from replayllm.kernels.activation import gelu_tanh_and_mul_invariant_torch, gelu_tanh_and_mul_torch
from replayllm.model_runner_v2.models.gemma import GemmaForCausalLM
from replayllm.model_runner_v2.models.layers import RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_unit_offset_rms_norm_is_gemmas(dtype):
    g = torch.Generator().manual_seed(0)
    ours, ref = RMSNorm(48, 1e-6, unit_offset=True).to(dtype), GemmaRMSNorm(48, eps=1e-6).to(dtype)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(48, generator=g) * 0.5)
        ref.weight.copy_(ours.weight)
    x, res = ((torch.randn(5, 48, generator=g) * 3).to(dtype) for _ in range(2))
    assert torch.equal(ours(x), ref(x))
    normed, stream = ours.add_and_norm(x, res)
    assert torch.equal(normed, ref(res + x)) and torch.equal(stream, res + x)
    plain = RMSNorm(48, 1e-6, weight_in_fp32=True).to(dtype)
    plain.load_state_dict(ours.state_dict())
    assert not torch.equal(plain(x), ours(x))  # the offset matters


def test_geglu_is_gemmas_and_its_invariant_form_is_row_independent():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(37, 2 * 24, generator=g) * 3
    gate, up = x.chunk(2, dim=-1)
    act = transformers.activations.ACT2FN["gelu_pytorch_tanh"]
    assert torch.equal(gelu_tanh_and_mul_torch(x), act(gate) * up)
    inv = gelu_tanh_and_mul_invariant_torch(x)
    torch.testing.assert_close(inv, act(gate) * up, rtol=rounding_tol(1, steps=8), atol=rounding_tol(x.abs().max(),
                                                                                                    steps=8))
    for rows in (1, 3, 16, 37):  # each row's bits whatever the batch it is computed in
        assert torch.equal(gelu_tanh_and_mul_invariant_torch(x[:rows]), inv[:rows])


def test_the_embedding_scale_is_rounded_to_the_model_dtype():
    config = transformers.GemmaConfig(vocab_size=32, hidden_size=48, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=24)
    default = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.bfloat16)
        with torch.device("meta"):
            model = GemmaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    assert model.model.embed_scale == 6.9375 != 48**0.5  # sqrt(48) = 6.928... in bf16, as HF's normalizer


def _gemma3_config(**extra) -> transformers.Gemma3TextConfig:
    return transformers.Gemma3TextConfig(**{**dict(vocab_size=32, hidden_size=48, intermediate_size=64,
                                                   num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                                   head_dim=24), **extra})


def test_gemma3_rope_per_layer_kind_and_refusals():
    """Gemma 3's rope_parameters are per kind of layer: each kind's theta (the sliding layers' 10k, the full
    ones' 1M by default); a kind the config lacks is refused. Bidirectional attention (EmbeddingGemma) is refused,
    never ignored. The layers' windows follow layer_types (transformers' default: five sliding of every six)."""
    from replayllm.model_config import layer_sliding_windows
    from replayllm.model_runner_v2.models.gemma3 import Gemma3ForCausalLM
    from replayllm.rope_settings import RopeSettings

    config = _gemma3_config(sliding_window=16)
    assert RopeSettings.from_hf_config(config).theta == 1_000_000.0
    assert RopeSettings.from_hf_config(config, layer_type="sliding_attention").theta == 10_000.0
    with pytest.raises(ValueError, match="rope_parameters has no 'chunked_attention' entry"):
        RopeSettings.from_hf_config(config, layer_type="chunked_attention")
    six = _gemma3_config(sliding_window=16, num_hidden_layers=7)
    assert layer_sliding_windows("Gemma3ForCausalLM", six) == (16,) * 5 + (None, 16)
    with pytest.raises(ValueError, match="use_bidirectional_attention=true"), torch.device("meta"):
        Gemma3ForCausalLM(_gemma3_config(use_bidirectional_attention=True))
    with torch.device("meta"):
        model = Gemma3ForCausalLM(_gemma3_config(sliding_window=16, layer_types=["sliding_attention",
                                                                               "full_attention"]))
    local, full = (layer.self_attn.rotary for layer in model.model.layers)
    assert (local.settings.theta, full.settings.theta) == (10_000.0, 1_000_000.0)
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == [16, None]
    assert model.model.layers[0].self_attn.attn.scale == 256**-0.5  # query_pre_attn_scalar's default


def test_gemma3s_limit_already_counts_its_rope_scaling(tmp_path):
    """Gemma-3-4B's text form: linear factor 8 on the global layers only, and a max_position_embeddings that
    already counts it: vLLM does not stretch Gemma 3's limit (it does a Llama's with linear scaling)."""
    from replayllm.config import ModelConfig
    from replayllm.rope_settings import RopeSettings

    scaled = dict(max_position_embeddings=4096, rope_scaling={"rope_type": "linear", "factor": 8.0})
    configs = {"Gemma3ForCausalLM": _gemma3_config(**scaled),
               "LlamaForCausalLM": transformers.LlamaConfig(vocab_size=32, hidden_size=48, intermediate_size=64,
                                                            num_hidden_layers=1, num_attention_heads=2, **scaled)}
    limits = {}
    for arch, config in configs.items():
        config.architectures = [arch]
        config.save_pretrained(str(tmp_path / arch))
        limits[arch] = ModelConfig.from_pretrained(str(tmp_path / arch)).max_position_embeddings
    assert limits == {"Gemma3ForCausalLM": 4096, "LlamaForCausalLM": 8 * 4096}
    g3 = configs["Gemma3ForCausalLM"]
    assert RopeSettings.from_hf_config(g3).factor == 8.0
    assert RopeSettings.from_hf_config(g3, layer_type="sliding_attention").factor == 1.0
