"""Each architecture's rotary as its transformers module computes it, in bf16, bit for bit: the engine model's own
rotary (built from the architecture's class) against transformers' rotary module and apply_rotary_pos_emb. OLMo's,
OLMo 2's, OLMo 3's and FlexOlmo's tables stay fp32 (not cast to the model dtype) and the rotation runs in fp32 with
one rounding (as Ernie 4.5's); Llama's and Qwen3's tables are cast and the rotation rounds op by op; Cohere's
interleaved pairs rotate in fp32 from cast tables. The fp32 engine tests against transformers
(test_engine_architectures.py) cannot tell these apart: in fp32 they agree. (The engine's OLMo family rounded op by op
until session 46.)"""

from __future__ import annotations

import importlib

import pytest
import torch
import transformers

from replayllm.model_runner_v2.models.registry import get_model_class

SIZES = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=4096)
CASES = {  # arch -> (config class, transformers module, its rotary class, extra config)
    "LlamaForCausalLM": ("LlamaConfig", "llama", "LlamaRotaryEmbedding", {}),
    "OlmoForCausalLM": ("OlmoConfig", "olmo", "OlmoRotaryEmbedding", {}),
    "Olmo2ForCausalLM": ("Olmo2Config", "olmo2", "Olmo2RotaryEmbedding", {}),
    "Olmo3ForCausalLM": ("Olmo3Config", "olmo3", "Olmo3RotaryEmbedding", dict(layer_types=["full_attention"])),
    "CohereForCausalLM": ("CohereConfig", "cohere", "CohereRotaryEmbedding", {}),  # interleaved, fp32 math
    "Ernie4_5ForCausalLM": ("Ernie4_5Config", "ernie4_5", "Ernie4_5RotaryEmbedding", dict(head_dim=16)),
    "Qwen3ForCausalLM": ("Qwen3Config", "qwen3", "Qwen3RotaryEmbedding", dict(head_dim=16)),
    "FlexOlmoForCausalLM": ("FlexOlmoConfig", "flex_olmo", "FlexOlmoRotaryEmbedding", dict(num_experts=2,
                                                                                          num_experts_per_tok=1)),
}


@pytest.mark.parametrize("arch", list(CASES))
def test_the_engines_rotary_is_transformers_in_bf16(arch):
    config_name, module_name, rotary_name, extra = CASES[arch]
    config = getattr(transformers, config_name)(**SIZES, rope_theta=5e5, **extra)
    modeling = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
    rotary = get_model_class([arch])(config).model.layers[0].self_attn.rotary
    g = torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 1, 7, 100, 1001, 3000, 4095])
    q = (torch.randn(7, 4, 16, generator=g) * 3).to(torch.bfloat16)  # [T, Hq, D]
    k = (torch.randn(7, 2, 16, generator=g) * 3).to(torch.bfloat16)
    ours_q, ours_k = rotary(positions, q, k)
    hf_rotary = getattr(modeling, rotary_name)(config)
    args = ("full_attention",) if arch == "Olmo3ForCausalLM" else ()
    cos, sin = hf_rotary(q, positions[None], *args)
    ref_q, ref_k = modeling.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    assert torch.equal(ours_q, ref_q[0].transpose(0, 1).reshape(7, -1))
    assert torch.equal(ours_k, ref_k[0].transpose(0, 1).reshape(7, -1))
