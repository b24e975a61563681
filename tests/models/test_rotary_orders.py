"""Each architecture's rotary as its transformers module computes it, in bf16, bit for bit: the engine model's own
rotary (built from the architecture's class) against transformers' rotary module and apply_rotary_pos_emb. OLMo's,
OLMo 2's, OLMo 3's and FlexOlmo's tables stay fp32 (not cast to the model dtype) and the rotation runs in fp32 with
one rounding (as Ernie 4.5's); Llama's and Qwen3's tables are cast and the rotation rounds op by op; Cohere's
interleaved pairs rotate in fp32 from cast tables. The fp32 engine tests against transformers
(test_engine_architectures.py) cannot tell these apart: in fp32 they agree. (The engine's OLMo family rounded op by op,
and its GPT-J rotated from fp32 tables, until session 46.)"""

from __future__ import annotations

import importlib
import inspect

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
    # every other architecture whose rotary this body can take (session 46's audit; the rest below or in
    # test_gptj_rotary_is_transformers_in_bf16)
    "Qwen2ForCausalLM": ("Qwen2Config", "qwen2", "Qwen2RotaryEmbedding", {}),
    "Qwen3MoeForCausalLM": ("Qwen3MoeConfig", "qwen3_moe", "Qwen3MoeRotaryEmbedding", dict(
        head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
    "Qwen2MoeForCausalLM": ("Qwen2MoeConfig", "qwen2_moe", "Qwen2MoeRotaryEmbedding", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)),
    "MistralForCausalLM": ("MistralConfig", "mistral", "MistralRotaryEmbedding", dict(head_dim=16)),
    "MinistralForCausalLM": ("MinistralConfig", "ministral", "MinistralRotaryEmbedding", dict(head_dim=16)),
    "Ministral3ForCausalLM": ("Ministral3Config", "ministral3", "Ministral3RotaryEmbedding", dict(head_dim=16)),
    "Mistral3ForConditionalGeneration": ("Ministral3Config", "ministral3", "Ministral3RotaryEmbedding",
                                         dict(head_dim=16)),  # built from its text_config
    "MixtralForCausalLM": ("MixtralConfig", "mixtral", "MixtralRotaryEmbedding", dict(
        head_dim=16, num_local_experts=4, num_experts_per_tok=2)),
    "Phi3ForCausalLM": ("Phi3Config", "phi3", "Phi3RotaryEmbedding", dict(partial_rotary_factor=0.75)),  # 12 of 16
    "PhimoeForCausalLM": ("PhimoeConfig", "phimoe", "PhimoeRotaryEmbedding", dict(
        num_local_experts=4, num_experts_per_tok=2)),
    "GraniteForCausalLM": ("GraniteConfig", "granite", "GraniteRotaryEmbedding", {}),
    "GraniteMoeForCausalLM": ("GraniteMoeConfig", "granitemoe", "GraniteMoeRotaryEmbedding", dict(
        num_local_experts=4, num_experts_per_tok=2)),
    "GraniteMoeSharedForCausalLM": ("GraniteMoeSharedConfig", "granitemoeshared", "GraniteMoeSharedRotaryEmbedding",
                                    dict(num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=48)),
    "GraniteSWAForCausalLM": ("GraniteSWAConfig", "granite_swa", "GraniteSWARotaryEmbedding", {}),
    "GraniteMoeSWAForCausalLM": ("GraniteMoeSWAConfig", "granitemoe_swa", "GraniteMoeSWARotaryEmbedding", dict(
        num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=48)),
    "HyperCLOVAXForCausalLM": ("HyperCLOVAXConfig", "hyperclovax", "HyperCLOVAXRotaryEmbedding", dict(head_dim=16)),
    "OlmoeForCausalLM": ("OlmoeConfig", "olmoe", "OlmoeRotaryEmbedding", dict(num_experts=4, num_experts_per_tok=2)),
    "SmolLM3ForCausalLM": ("SmolLM3Config", "smollm3", "SmolLM3RotaryEmbedding", {}),  # layer 0 rotates
    "GlmForCausalLM": ("GlmConfig", "glm", "GlmRotaryEmbedding", dict(head_dim=16)),  # interleaved, half the head
    "Glm4ForCausalLM": ("Glm4Config", "glm4", "Glm4RotaryEmbedding", dict(head_dim=16)),
    "Glm4MoeForCausalLM": ("Glm4MoeConfig", "glm4_moe", "Glm4MoeRotaryEmbedding", dict(
        head_dim=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
    "SolarOpenForCausalLM": ("SolarOpenConfig", "solar_open", "SolarOpenRotaryEmbedding", dict(
        head_dim=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_group=1, topk_group=1)),
    "GemmaForCausalLM": ("GemmaConfig", "gemma", "GemmaRotaryEmbedding", dict(head_dim=16)),
    "Gemma2ForCausalLM": ("Gemma2Config", "gemma2", "Gemma2RotaryEmbedding", dict(head_dim=16)),
    "VaultGemmaForCausalLM": ("VaultGemmaConfig", "vaultgemma", "VaultGemmaRotaryEmbedding", dict(head_dim=16)),
    "Starcoder2ForCausalLM": ("Starcoder2Config", "starcoder2", "Starcoder2RotaryEmbedding", {}),
    "SeedOssForCausalLM": ("SeedOssConfig", "seed_oss", "SeedOssRotaryEmbedding", dict(head_dim=16)),
    "Cohere2ForCausalLM": ("Cohere2Config", "cohere2", "Cohere2RotaryEmbedding", {}),  # layer 0 sliding: rotates
    "Exaone4ForCausalLM": ("Exaone4Config", "exaone4", "Exaone4RotaryEmbedding", dict(head_dim=16)),
    "ExaoneMoeForCausalLM": ("ExaoneMoeConfig", "exaone_moe", "ExaoneMoeRotaryEmbedding", dict(
        head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_group=1, topk_group=1)),
    "ExaoneForCausalLM": ("ExaoneConfig", "llama", "LlamaRotaryEmbedding", dict(head_dim=16)),  # Llama's module
    "InternLM3ForCausalLM": ("InternLM3Config", "llama", "LlamaRotaryEmbedding", dict(head_dim=16)),
    "FalconForCausalLM": ("FalconConfig", "falcon", "FalconRotaryEmbedding", {}),
    "NemotronForCausalLM": ("NemotronConfig", "nemotron", "NemotronRotaryEmbedding", dict(head_dim=16)),  # half
    "ArceeForCausalLM": ("ArceeConfig", "arcee", "ArceeRotaryEmbedding", dict(head_dim=16)),
    "HeliumForCausalLM": ("HeliumConfig", "helium", "HeliumRotaryEmbedding", dict(head_dim=16)),  # interleaved
    "MiniMaxM2ForCausalLM": ("MiniMaxM2Config", "minimax_m2", "MiniMaxM2RotaryEmbedding", dict(
        head_dim=16, rotary_dim=8, num_local_experts=4, num_experts_per_tok=2)),
    "ApertusForCausalLM": ("ApertusConfig", "apertus", "ApertusRotaryEmbedding", dict(head_dim=16)),  # llama3
    "Dots1ForCausalLM": ("Dots1Config", "dots1", "Dots1RotaryEmbedding", dict(
        head_dim=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
    "HunYuanDenseV1ForCausalLM": ("HunYuanDenseV1Config", "hunyuan_v1_dense", "HunYuanDenseV1RotaryEmbedding",
                                  dict(head_dim=16)),  # the rope alone: its q/k norms come after it
    "HunYuanMoEV1ForCausalLM": ("HunYuanMoEV1Config", "hunyuan_v1_moe", "HunYuanMoEV1RotaryEmbedding", dict(
        head_dim=16, num_experts=4, moe_topk=[2])),
    "Jais2ForCausalLM": ("Jais2Config", "jais2", "Jais2RotaryEmbedding", dict(head_dim=16)),
    "HYV3ForCausalLM": ("HYV3Config", "hy_v3", "HYV3RotaryEmbedding", dict(
        head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
    "Ernie4_5_MoeForCausalLM": ("Ernie4_5_MoeConfig", "ernie4_5_moe", "Ernie4_5_MoeRotaryEmbedding", dict(
        head_dim=16, moe_num_experts=4, moe_k=2, moe_intermediate_size=32)),  # interleaved, fp32 tables and math
    "CwmForCausalLM": ("CwmConfig", "cwm", "CwmRotaryEmbedding", dict(head_dim=16)),
    "AfmoeForCausalLM": ("AfmoeConfig", "afmoe", "AfmoeRotaryEmbedding", dict(
        head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),  # layer 0 sliding: rotates
    "MiniCPM5MoeForCausalLM": ("MiniCPM5MoeConfig", "minicpm5_moe", "MiniCPM5MoeRotaryEmbedding", dict(
        head_dim=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
    "Kolibri1ForCausalLM": ("Kolibri1Config", "kolibri1", "Kolibri1RotaryEmbedding", dict(
        head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),  # layer 0 sliding: rotates
    "DbrxForCausalLM": ("DbrxConfig", "dbrx", "DbrxRotaryEmbedding", dict(
        d_model=64, n_heads=4, max_seq_len=4096, attn_config=dict(kv_n_heads=2),
        ffn_config=dict(ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2))),
    "Lfm2ForCausalLM": ("Lfm2Config", "lfm2", "Lfm2RotaryEmbedding", dict(layer_types=["full_attention"])),
    # the Qwen-VL language models: M-RoPE, every section of a text position the same
    "Qwen2VLForConditionalGeneration": ("Qwen2VLTextConfig", "qwen2_vl", "Qwen2VLRotaryEmbedding", dict(
        rope_parameters={"rope_type": "default", "rope_theta": 5e5, "mrope_section": [2, 3, 3]})),
    "Qwen2_5_VLForConditionalGeneration": ("Qwen2_5_VLTextConfig", "qwen2_5_vl", "Qwen2_5_VLRotaryEmbedding", dict(
        rope_parameters={"rope_type": "default", "rope_theta": 5e5, "mrope_section": [2, 3, 3]})),
    "Qwen3VLForConditionalGeneration": ("Qwen3VLTextConfig", "qwen3_vl", "Qwen3VLTextRotaryEmbedding", dict(
        head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 5e5, "mrope_section": [2, 3, 3],
                                      "mrope_interleaved": True})),
    "Qwen3VLMoeForConditionalGeneration": ("Qwen3VLMoeTextConfig", "qwen3_vl_moe", "Qwen3VLMoeTextRotaryEmbedding",
                                           dict(head_dim=16, num_experts=4, num_experts_per_tok=2,
                                                moe_intermediate_size=32,
                                                rope_parameters={"rope_type": "default", "rope_theta": 5e5,
                                                                 "mrope_section": [2, 3, 3],
                                                                 "mrope_interleaved": True})),
    "GptOssForCausalLM": ("GptOssConfig", "gpt_oss", "GptOssRotaryEmbedding", dict(
        head_dim=16, num_local_experts=4, num_experts_per_tok=2)),  # its class default rope: YaRN
    "Cohere2MoeForCausalLM": ("Cohere2MoeConfig", "cohere2_moe", "Cohere2MoeRotaryEmbedding", dict(
        head_dim=16, num_experts=4, num_experts_per_tok=2)),
    "Lfm2MoeForCausalLM": ("Lfm2MoeConfig", "lfm2_moe", "Lfm2MoeRotaryEmbedding", dict(
        layer_types=["full_attention"], num_dense_layers=1, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32)),
    "BambaForCausalLM": ("BambaConfig", "bamba", "BambaRotaryEmbedding", dict(
        attn_layer_indices=[0], mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16,
        mamba_chunk_size=8)),  # half of each head rotating
    "GraniteMoeHybridForCausalLM": ("GraniteMoeHybridConfig", "granitemoehybrid", "GraniteMoeHybridRotaryEmbedding",
                                    dict(layer_types=["attention"], position_embedding_type="rope",
                                         num_local_experts=0, shared_intermediate_size=80)),
    "FalconH1ForCausalLM": ("FalconH1Config", "falcon_h1", "FalconH1RotaryEmbedding", dict(
        head_dim=16, mamba_d_ssm=64, mamba_n_heads=4, mamba_n_groups=1, mamba_d_state=8, mamba_chunk_size=8)),
    "Qwen3NextForCausalLM": ("Qwen3NextConfig", "qwen3_next", "Qwen3NextRotaryEmbedding", dict(
        head_dim=16, layer_types=["full_attention"], num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48)),  # a quarter of each head rotating
    "FlintForCausalLM": ("FlintConfig", "flint", "FlintRotaryEmbedding", dict(
        head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[0],
        layer_types=["sliding_attention"])),  # only its sliding layers rotate
    "Qwen3_5ForCausalLM": ("Qwen3_5TextConfig", "qwen3_5", "Qwen3_5TextRotaryEmbedding", dict(
        head_dim=16, layer_types=["full_attention"])),  # a quarter of each head rotating
    "Qwen3_5ForConditionalGeneration": ("Qwen3_5TextConfig", "qwen3_5", "Qwen3_5TextRotaryEmbedding", dict(
        head_dim=16, layer_types=["full_attention"])),  # built from its text_config
    "Qwen3_5MoeForCausalLM": ("Qwen3_5MoeTextConfig", "qwen3_5_moe", "Qwen3_5MoeTextRotaryEmbedding", dict(
        head_dim=16, layer_types=["full_attention"], num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48)),
    "Qwen3_5MoeForConditionalGeneration": ("Qwen3_5MoeTextConfig", "qwen3_5_moe", "Qwen3_5MoeTextRotaryEmbedding",
                                           dict(head_dim=16, layer_types=["full_attention"], num_experts=4,
                                                num_experts_per_tok=2, moe_intermediate_size=32,
                                                shared_expert_intermediate_size=48)),
    "Apertus1p5TextForCausalLM": ("Apertus1p5TextConfig", "apertus1p5", "Apertus1p5TextRotaryEmbedding", dict(
        head_dim=16, output_vocab_size=64)),
    "Apertus1p5ForConditionalGeneration": ("Apertus1p5TextConfig", "apertus1p5", "Apertus1p5TextRotaryEmbedding",
                                           dict(head_dim=16, output_vocab_size=64)),  # built from its text_config
    # the rotary of the kind config.layer_types[0] names
    "Gemma3ForCausalLM": ("Gemma3TextConfig", "gemma3", "Gemma3RotaryEmbedding", dict(
        head_dim=16, layer_types=["sliding_attention"])),  # its local rope
    "Gemma3ForConditionalGeneration": ("Gemma3TextConfig", "gemma3", "Gemma3RotaryEmbedding", dict(
        head_dim=16, layer_types=["full_attention"])),  # built from its text_config; the global rope
    "MellumForCausalLM": ("MellumConfig", "mellum", "MellumRotaryEmbedding", dict(
        head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, layer_types=["full_attention"],
        mlp_layer_types=["dense"])),
    "MiMoV2FlashForCausalLM": ("MiMoV2FlashConfig", "mimo_v2_flash", "MiMoV2FlashRotaryEmbedding", dict(
        head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        layer_types=["sliding_attention"], rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}})),
    "LagunaForCausalLM": ("LagunaConfig", "laguna", "LagunaRotaryEmbedding", dict(
        head_dim=16, num_attention_heads_per_layer=[4], num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, layer_types=["full_attention"])),
    "BeamForCausalLM": ("BeamConfig", "beam", "BeamRotaryEmbedding", dict(
        head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, layer_types=["sliding_attention"],
        mlp_layer_types=["dense"], rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 5e4},
                                                    "full_attention": None})),  # fp32 tables and math (OLMo's)
    "Lfm3ForCausalLM": ("Lfm3Config", "lfm3", "Lfm3RotaryEmbedding", dict(
        head_dim=16, layer_types=["sliding_attention"])),  # fp32 tables and math
    "LaraMiniForCausalLM": ("LaraMiniConfig", "lara_mini", "LaraMiniRotaryEmbedding", dict(
        head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        layer_types=["sliding_attention"])),  # only its sliding layers rotate (the whole head)
}


def _modeling(config_name: str, module_name: str, rotary_name: str):
    """transformers' modeling module of the case; the test skipped (saying why) where the installed release lacks
    the config or the rotary class (the GPU machine's older one)."""
    try:
        modeling = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
    except ImportError:
        modeling = None
    if not hasattr(transformers, config_name) or not hasattr(modeling, rotary_name):
        pytest.skip(f"transformers {transformers.__version__} has no {config_name} / {rotary_name}")
    return modeling


def _engine_rotation(arch: str, config, kv_heads: int) -> tuple[torch.Tensor, ...]:
    """(positions [7], q [7, 4, 16], k [7, kv_heads, 16] random bf16, and the engine's rotated q, k): the rotary
    of the architecture's first layer over positions from 0 to 4095."""
    rotary = get_model_class([arch])(config).model.layers[0].self_attn.rotary
    g = torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 1, 7, 100, 1001, 3000, 4095])
    q = (torch.randn(7, 4, 16, generator=g) * 3).to(torch.bfloat16)  # [T, Hq, D]
    k = (torch.randn(7, kv_heads, 16, generator=g) * 3).to(torch.bfloat16)
    return positions, q, k, *rotary(positions, q, k)


@pytest.mark.parametrize("arch", list(CASES))
def test_the_engines_rotary_is_transformers_in_bf16(arch):
    config_name, module_name, rotary_name, extra = CASES[arch]
    modeling = _modeling(config_name, module_name, rotary_name)
    config = getattr(transformers, config_name)(**SIZES, rope_theta=5e5, **extra)
    positions, q, k, ours_q, ours_k = _engine_rotation(arch, config, kv_heads=2)
    hf_rotary = getattr(modeling, rotary_name)(config)
    args = (config.layer_types[0],) if "layer_type" in inspect.signature(hf_rotary.forward).parameters else ()
    cos, sin = hf_rotary(q, positions[None], *args)
    ref_q, ref_k = modeling.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    assert torch.equal(ours_q, ref_q[0].transpose(0, 1).reshape(7, -1))
    assert torch.equal(ours_k, ref_k[0].transpose(0, 1).reshape(7, -1))


@pytest.mark.parametrize("arch, config_name, module_name, rotary_name", [
    ("GPTJForCausalLM", "GPTJConfig", "gptj", "GPTJRotaryEmbedding"),
    ("CodeGenForCausalLM", "CodeGenConfig", "codegen", "CodeGenRotaryEmbedding")])
def test_gptj_rotary_is_transformers_in_bf16(arch, config_name, module_name, rotary_name):
    """GPT-J's and CodeGen's rotary as their attention applies it: rotate_every_two (interleaved pairs) over the first
    rotary_dim elements of each [B, T, H, D] head, the rest passed through. GPT-J's tables are cast to q's dtype and
    the rotation rounds op by op (transformers 5.25's GPTJRotaryEmbedding); CodeGen's stay fp32, so its rotation runs
    in fp32 and is rounded once (`.to(value.dtype)`)."""
    modeling = _modeling(config_name, module_name, rotary_name)
    config = getattr(transformers, config_name)(vocab_size=64, n_embd=64, n_layer=1, n_head=4, n_inner=96,
                                                n_positions=4096, rotary_dim=6)
    positions, q, k, ours_q, ours_k = _engine_rotation(arch, config, kv_heads=4)
    sin, cos = getattr(modeling, rotary_name)(config)(q, positions[None])

    def reference(x):  # [T, H, D] -> transformers' rotated [T, H * D]
        x = x[None]  # [B, T, H, D], as its attention holds q and k here
        rot = modeling.apply_rotary_pos_emb(x[..., :6], sin, cos)
        return torch.cat([rot, x[..., 6:]], dim=-1).to(x.dtype)[0].reshape(7, -1)

    assert torch.equal(ours_q, reference(q))
    assert torch.equal(ours_k, reference(k))
