"""The small transformers models the architecture tests build (tests/models/test_engine_architectures.py and the
per-architecture files that reuse them): ARCHS maps a name to (config class, model class, config overrides) on top
of SMALL; `_hf` builds one with its norms' weights and biases moved off their 1 / 0 initialisation."""

from __future__ import annotations

import torch
import transformers

from helpers.layer_plan_archs import LAYER_PLAN_ARCHS, LING3, QWEN4_EXP, STEPPED
from helpers.recent_archs import RECENT_ARCHS
from helpers.trace_replay_common import DEVICE

SMALL = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, rms_norm_eps=1e-6, initializer_range=0.5, max_position_embeddings=256,
             pad_token_id=0, bos_token_id=1, eos_token_id=2)
# DeepSeek's latent attention: a latent of 32, q/k heads of 16 + 8 rotary, v heads of 16, a KV head per q head (as
# the released configs say; V3's class default is 128); its MoE layout
_MLA = dict(num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
            first_k_dense_replace=1)
ARCHS = {
    "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM, {}),
    # Granite's four scalars, none a power of two and none its default
    "granite": (transformers.GraniteConfig, transformers.GraniteForCausalLM,
                dict(embedding_multiplier=1.7, residual_multiplier=0.3, attention_multiplier=0.2, logits_scaling=2.5)),
    # Llama with its optional biases on every projection (row-parallel o_proj / down_proj add theirs once)
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(attention_bias=True, mlp_bias=True)),
    # SmolLM3: layer 1 of 3 applies no rope (NoPE)
    "smollm3": (transformers.SmolLM3Config, transformers.SmolLM3ForCausalLM, dict(no_rope_layers=[1, 0, 1])),
    # GLM: half of each head rotates, in interleaved pairs; q/k/v biases; GLM-4 adds norms after the sub-blocks
    "glm": (transformers.GlmConfig, transformers.GlmForCausalLM, dict(head_dim=16)),
    "glm4": (transformers.Glm4Config, transformers.Glm4ForCausalLM, dict(head_dim=16)),
    # Phi-4-mini's form: 12 of 16 elements rotate, longrope's short factors (max_model_len 128 = the pretraining
    # context) and its attention factor sqrt(1 + ln 2 / ln 128)
    "phi4mini": (transformers.Phi3Config, transformers.Phi3ForCausalLM, dict(
        original_max_position_embeddings=128, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "short_factor": [1.0, 1.2, 1.5, 2.0, 3.0, 5.0], "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]})),
    # StableLM: LayerNorms with biases, a quarter of each head rotating, q/k/v biases; and StableLM-2-12B's
    # parallel residual (attention and MLP over the same normed input)
    "stablelm": (transformers.StableLmConfig, transformers.StableLmForCausalLM, dict(use_qkv_bias=True)),
    "stablelm-parallel": (transformers.StableLmConfig, transformers.StableLmForCausalLM,
                          dict(use_parallel_residual=True)),
    # StableLM-2-12B's form: the parallel layer with a LayerNorm per head on q and k (qk_layernorm)
    "stablelm-qknorm": (transformers.StableLmConfig, transformers.StableLmForCausalLM,
                        dict(use_parallel_residual=True, qk_layernorm=True)),
    # GPT-NeoX (Pythia): per-head grouped query_key_value, a GELU MLP with biases, a quarter rotary; parallel
    # residual (the default) and not
    "gpt_neox": (transformers.GPTNeoXConfig, transformers.GPTNeoXForCausalLM, {}),
    "gpt_neox-sequential": (transformers.GPTNeoXConfig, transformers.GPTNeoXForCausalLM,
                            dict(use_parallel_residual=False, hidden_act="gelu_pytorch_tanh")),
    # Gemma: (1 + weight) RMSNorms in fp32, GeGLU, embeddings times sqrt(hidden) rounded to the model dtype; MQA
    "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM, dict(head_dim=32)),
    # OLMo 3: OLMo 2's layers, a window of 8 in three of every four layers (here layers 0 and 1 of 3), a rope per
    # kind of layer (the full one's scaled)
    "olmo3": (transformers.Olmo3Config, transformers.Olmo3ForCausalLM, dict(
        sliding_window=8, rope_scaling={"rope_type": "linear", "factor": 4.0})),
    # Phi-2: one LayerNorm for attention and MLP, biases everywhere (the LM head too), 0.4 of each head rotating
    # (6 of 16: an odd number of pairs)
    "phi": (transformers.PhiConfig, transformers.PhiForCausalLM, dict(partial_rotary_factor=0.4)),
    # Cohere: one mean-centred LayerNorm for attention and MLP, interleaved rope in fp32, tied, logits scaled
    "cohere": (transformers.CohereConfig, transformers.CohereForCausalLM, dict(logit_scale=0.3)),
    # Command-R+'s form: Cohere's layers with its LayerNorm per head on q and k (use_qk_norm)
    "cohere-qknorm": (transformers.CohereConfig, transformers.CohereForCausalLM, dict(logit_scale=0.3,
                                                                                      use_qk_norm=True)),
    # Cohere 2: Cohere's layers, a window of 8 in the sliding layers, no rotary in the full one
    "cohere2": (transformers.Cohere2Config, transformers.Cohere2ForCausalLM, dict(
        logit_scale=0.3, sliding_window=8, layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    # Seed-OSS: q/k/v biases without an o_proj one, and an MLP bias
    "seed_oss": (transformers.SeedOssConfig, transformers.SeedOssForCausalLM, dict(
        head_dim=16, attention_bias=True, attention_out_bias=False, mlp_bias=True)),
    # StarCoder2: LayerNorms (norm_epsilon), biases everywhere, a plain GELU MLP, a window of 8 in every layer
    "starcoder2": (transformers.Starcoder2Config, transformers.Starcoder2ForCausalLM, dict(
        sliding_window=8, use_bias=True, hidden_act="gelu_pytorch_tanh", norm_epsilon=1e-5)),
    # Gemma 2: four (1 + weight) norms a layer, attention scores and logits soft-capped (caps low enough to bite),
    # a window of 8 in every other layer, a softmax scale from query_pre_attn_scalar
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM, dict(
        head_dim=32, query_pre_attn_scalar=24, sliding_window=8, attn_logit_softcapping=1.5,
        final_logit_softcapping=2.0)),
    # Gemma 3: four (1 + weight) norms a layer, per-head q/k norms, a softmax scale from query_pre_attn_scalar; a
    # window of 8 in the sliding layers (the 40-token prompt outgrows it) with their own rope base; the full layer's
    # rope scaled (linear, as Gemma-3-4B's), the sliding ones' not
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, dict(
        head_dim=32, query_pre_attn_scalar=24, sliding_window=8, rope_scaling={"rope_type": "linear", "factor": 4.0},
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    # GPT-OSS: attention sinks (set in _hf to move most of the softmax's mass at times), q/k/v/o biases, a window of
    # 8 in the sliding layers, YaRN without truncation; every layer a MoE of 4 experts (top 2 of the router's
    # logits, a softmax over them) with biases and the clamped SwiGLU (a limit low enough to clamp)
    "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM, dict(
        head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8, swiglu_limit=3.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_theta=150000.0, rope_scaling={"rope_type": "yarn", "factor": 16.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                           "truncate": False, "original_max_position_embeddings": 16})),
    # GLM-4-MoE: q/k/v biases, per-head q/k RMSNorms, half of each head rotating; layer 0 dense, then 8 experts in
    # 2 groups (the best group only, top 2 in it) chosen on sigmoid scores plus a correction bias (set in _hf), a
    # shared expert, weights renormalised and scaled by 2.5
    "glm4_moe": (transformers.Glm4MoeConfig, transformers.Glm4MoeForCausalLM, dict(
        head_dim=16, attention_bias=True, use_qk_norm=True, n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, norm_topk_prob=True)),
    # DeepSeek-V2 (V2-Lite's form: no q LoRA): multi-head latent attention (an 8-of-24 interleaved rotary in fp32, v
    # heads of 16 padded to 24 in the cache), YaRN with mscale_all_dim (the softmax scale times mscale^2); layer 0
    # dense, then 8 experts, a softmax router taking the top 2 inside the best of 2 groups, scaled by 1.5, not
    # renormalised; a shared expert
    "deepseek_v2": (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM, dict(
        _MLA, q_lora_rank=None, topk_method="group_limited_greedy", n_group=2, topk_group=1,
        routed_scaling_factor=1.5, rope_scaling={"rope_type": "yarn", "factor": 4.0, "mscale": 0.707,
                                                 "mscale_all_dim": 0.707, "original_max_position_embeddings": 64})),
    # DeepSeek-V3: MLA with a q LoRA (q_a_proj, its norm, q_b_proj), V3's interleaved rotary in the model dtype;
    # GLM-4-MoE's router (a correction bias set in _hf, the best group, renormalised, scaled by 2.5); the layers' norms
    # at an eps of 0.05, the latent norms at transformers' fixed 1e-6
    "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM, dict(
        _MLA, rms_norm_eps=0.05, q_lora_rank=24, n_group=2, topk_group=1, routed_scaling_factor=2.5,
        norm_topk_prob=True)),
    # Ministral 3: Mistral's layers, YaRN, and Llama 4's query temperature past the pretraining context of 16 (the
    # 40-token prompt reaches factors 1 + 0.1 ln(1 + floor(p / 16)) of up to 1 + 0.1 ln 3)
    "ministral3": (transformers.Ministral3Config, transformers.Ministral3ForCausalLM, dict(
        head_dim=16, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                      "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0,
                                      "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1})),
    # Ernie 4.5: Llama's layers with a bias on every projection, the whole head rotating in interleaved pairs in fp32
    # (fp32 cos/sin, one rounding); tied embeddings
    "ernie4_5": (transformers.Ernie4_5Config, transformers.Ernie4_5ForCausalLM, dict(head_dim=16, use_bias=True)),
    # EXAONE 4: OLMo 2's post norms (Llama's order), per-head q/k norms; a window of 8 in the sliding layers (0 and 1;
    # the 40-token prompt outgrows it) and no rotary in the full one
    "exaone4": (transformers.Exaone4Config, transformers.Exaone4ForCausalLM, dict(
        head_dim=16, sliding_window=8, layer_types=["sliding_attention", "sliding_attention", "full_attention"])),
    # Granite MoE: Granite's four scalars, 4 experts in every layer, a softmax over the router's top 2 logits
    "granitemoe": (transformers.GraniteMoeConfig, transformers.GraniteMoeForCausalLM, dict(
        embedding_multiplier=1.7, residual_multiplier=0.3, attention_multiplier=0.2, logits_scaling=2.5,
        num_local_experts=4, num_experts_per_tok=2)),
    # GPT-2: learned absolute positions, no rotary, Conv1D weights, fused c_attn; gelu_new; tied head
    "gpt2": (transformers.GPT2Config, transformers.GPT2LMHeadModel, dict(n_inner=96)),
    # GPT-BigCode (StarCoder's form): GPT-2's layer with nn.Linear weights and multi-query attention (one K/V head)
    "gpt_bigcode": (transformers.GPTBigCodeConfig, transformers.GPTBigCodeForCausalLM, dict(n_inner=96)),
    # GPT-J: Phi-2's parallel layer, no attention biases, 6 of 16 elements rotating in interleaved pairs (fp32)
    "gptj": (transformers.GPTJConfig, transformers.GPTJForCausalLM, dict(n_inner=96, rotary_dim=6)),
    # Falcon-7B's form: multi-query, attention and the MLP over one norm (test_falcon.py: the other forms)
    "falcon": (transformers.FalconConfig, transformers.FalconForCausalLM, dict(ffn_hidden_size=96)),
    # OLMo (the first): parameter-free fp32 LayerNorms, q/k/v clamped (clip_qkv)
    "olmo": (transformers.OlmoConfig, transformers.OlmoForCausalLM, dict(clip_qkv=0.5)),
    # OPT (opt-125m's form): learned positions at position + 2, no rotary, fc1 -> ReLU -> fc2, LayerNorms eps 1e-5
    "opt": (transformers.OPTConfig, transformers.OPTForCausalLM, dict(ffn_dim=96, word_embed_proj_dim=64)),
    # Nemotron: LayerNorm1P (weight + 1, with a bias), half of each head rotating by NemotronConfig's default, a ReLU²
    # MLP without a gate; biases on the attention projections
    "nemotron": (transformers.NemotronConfig, transformers.NemotronForCausalLM, dict(
        head_dim=16, norm_eps=1e-5, attention_bias=True)),
    # Arcee (AFM): Llama's layers with Nemotron's ReLU² MLP (biased here)
    "arcee": (transformers.ArceeConfig, transformers.ArceeForCausalLM, dict(head_dim=16, mlp_bias=True)),
    # Helium: OLMo 2's RMSNorm order in Llama's places, q/k/v biases without an o_proj one
    "helium": (transformers.HeliumConfig, transformers.HeliumForCausalLM, dict(head_dim=16, attention_bias=True)),
    # BLOOM: ALiBi instead of positions (4 heads: slopes 1/4 .. 1/256), a LayerNorm on the embeddings, fused
    # per-head query_key_value, BLOOM's tanh GELU, biases everywhere, tied head
    "bloom": (transformers.BloomConfig, transformers.BloomForCausalLM, dict(layer_norm_epsilon=1e-5)),
    # MPT: ALiBi with MPT's slopes, bias-free LayerNorms and projections, the fused [q | k | v] Wqkv, exact GELU
    "mpt": (transformers.MptConfig, transformers.MptForCausalLM, dict(layer_norm_epsilon=1e-5, max_seq_len=256)),
    # Llama 4 (Scout's form): layers 0 and 2 rotate (interleaved pairs in fp32, llama3 rope from a context of 32),
    # L2-norm q and k after it and attend in chunks of 8; layer 1 rotates nothing, attends to all and scales its
    # queries from position 3 on (floor_scale 4); layers 0 and 2 sparse (4 experts, top 1, the token scaled by its
    # sigmoid score before the expert, a shared expert), layer 1 a dense MLP of its own width
    "llama4": (transformers.Llama4TextConfig, transformers.Llama4ForCausalLM, dict(
        head_dim=16, intermediate_size_mlp=128, num_local_experts=4, num_experts_per_tok=1,
        moe_layers=[0, 2], no_rope_layers=[1, 0, 1], attention_chunk_size=8, floor_scale=4, attn_scale=0.5,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    # Llama 4 Maverick's form: no q/k norm, every other layer sparse (layer 1), no rope scaling, chunks of 16
    "llama4-maverick": (transformers.Llama4TextConfig, transformers.Llama4ForCausalLM, dict(
        head_dim=16, intermediate_size_mlp=128, num_local_experts=4, num_experts_per_tok=1,
        interleave_moe_layer_step=2, no_rope_layers=[1, 0, 1], attention_chunk_size=16, use_qk_norm=False,
        floor_scale=8, attn_scale=0.3)),
    # EXAONE 4 without a window: every layer full, every layer rotating
    "exaone4-full": (transformers.Exaone4Config, transformers.Exaone4ForCausalLM, dict(
        head_dim=16, sliding_window=None, layer_types=["full_attention"] * 3)),
}
# Architectures a transformers release may lack (the GPU machine's is older than CI's): name -> (config class, model
# class, overrides) by class name; built into ARCHS where the installed transformers has both classes, else listed
# in MISSING with the reason the tests print when they skip them
_GRANITE_H = dict(embedding_multiplier=1.7, residual_multiplier=0.3, attention_multiplier=0.2, logits_scaling=2.5,
                  layer_types=["mamba", "attention", "mamba"], mamba_n_heads=8, mamba_d_head=16, mamba_expand=2,
                  mamba_d_state=16, mamba_n_groups=2, mamba_d_conv=4, mamba_chunk_size=8)
_OPTIONAL = {
    # GLM-4.7-Flash: DeepSeek-V3's MLA (q LoRA, rotate-half rope here: rope_interleave false) and router; the sparse
    # layers from mlp_layer_types (layers 0 and 2; 1 dense)
    "glm4_moe_lite": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", dict(
        _MLA, q_lora_rank=24, n_group=2, topk_group=1, routed_scaling_factor=1.8, norm_topk_prob=True,
        rope_interleave=False, mlp_layer_types=["sparse", "dense", "sparse"])),
    # MiniMax-M2: q/k RMSNorms over whole projections, 8 of 16 elements rotating (the hub's `rotary_dim`), 8 experts
    # in every layer chosen on sigmoid scores plus a correction bias (set in _hf), renormalised
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM", dict(
        head_dim=16, rotary_dim=8, num_local_experts=8, num_experts_per_tok=2)),
    # Apertus: Llama's layers with per-head q/k norms, its own norm names, xIELU (its scalars set in _hf) in an
    # ungated MLP, llama3 rope
    "apertus": ("ApertusConfig", "ApertusForCausalLM", dict(head_dim=16)),
    # Ministral: Mistral's layers with a window of 8 in layers 0 and 2 only (the 40-token prompt outgrows it)
    "ministral": ("MinistralConfig", "MinistralForCausalLM", dict(
        head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    # Mistral 4 (Mistral Small 4's language model): MLA with a q LoRA, YaRN from a context of 16 with Llama 4's query
    # temperature (the 40-token prompt reaches factors up to 1 + 0.1 ln 3); layer 0 dense, then 8 experts in 2
    # groups chosen by a softmax router in the model dtype (the best group, top 2), renormalised, x 1.5
    "mistral4": ("Mistral4Config", "Mistral4ForCausalLM", dict(
        _MLA, q_lora_rank=24, n_group=2, topk_group=1, routed_scaling_factor=1.5, norm_topk_prob=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0,
                         "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1})),
    # dots.llm1: Qwen3's attention with biases; layer 0 dense, then 8 experts in 2 groups (the best group, top 2) on
    # sigmoid scores plus a correction bias (set in _hf), a shared expert, renormalised, scaled by 2.5; a window of 8
    # in layer 2 (max_window_layers 2)
    "dots1": ("Dots1Config", "Dots1ForCausalLM", dict(
        head_dim=16, attention_bias=True, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, sliding_window=8, max_window_layers=2)),
    # Granite MoE with a shared MLP (48 wide) beside its 4 experts, top 2
    "granitemoeshared": ("GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM", dict(
        embedding_multiplier=1.7, residual_multiplier=0.3, attention_multiplier=0.2, logits_scaling=2.5,
        num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=48)),
    # Granite 4.0 micro's form: every layer attention, no experts, the shared MLP (80 wide, not intermediate_size) as
    # each layer's MLP, rope, tied embeddings
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(
        embedding_multiplier=1.7, residual_multiplier=0.3, attention_multiplier=0.2, logits_scaling=2.5,
        num_local_experts=0, shared_intermediate_size=80, layer_types=["attention"] * 3,
        position_embedding_type="rope", tie_word_embeddings=True)),
    # its MoE form without rope (NoPE), as the hybrid checkpoints' attention layers: 4 experts, top 2, the shared MLP
    "granitemoehybrid-moe": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(
        embedding_multiplier=1.7, residual_multiplier=0.3, attention_multiplier=0.2, logits_scaling=2.5,
        num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=48, layer_types=["attention"] * 3,
        position_embedding_type=None)),
    # Granite 4.0-H's forms: Mamba-2 in layers 0 and 2 (8 heads of 16, 2 groups of B / C of 16, a convolution of 4
    # with its bias), attention in layer 1 (NoPE); dense (h-micro) and with 4 experts, rope and biased projections
    "granitemoehybrid-mamba": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(
        _GRANITE_H, num_local_experts=0, shared_intermediate_size=80, position_embedding_type=None)),
    "granitemoehybrid-mamba-moe": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(
        _GRANITE_H, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=48,
        position_embedding_type="rope", mamba_proj_bias=True)),
    # NemotronH (Nemotron-H, Nemotron Nano 2): one mixer per layer, Mamba-2 (8 heads of 16, 2 groups), attention
    # (NoPE), an ungated ReLU² MLP, Mamba-2, from the checkpoints' pattern string
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM", dict(
        hybrid_override_pattern="M*-M", head_dim=16, mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16,
        n_groups=2, conv_kernel=4, chunk_size=8, layer_norm_epsilon=1e-5)),
    # HunYuan (dense): Llama's layers, q/k heads RMS-normed after the rope, the checkpoints' "dynamic" rope with a
    # fixed alpha (NTK: the base stretched), tied embeddings
    "hunyuan_dense": ("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", dict(
        head_dim=16, tie_word_embeddings=True,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 1000.0, "factor": 1.0})),
    # HunYuan-A13B's form: the same attention, 8 experts in every layer (top 2 per layer, as its per-layer list) chosen
    # by an fp32 softmax router, renormalised, plus an ungated shared MLP
    "hunyuan_moe": ("HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM", dict(
        head_dim=16, num_experts=8, moe_topk=[2, 2, 2],
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 1000.0, "factor": 1.0})),
    # EXAONE 3.x: Llama's model (transformers runs it with LlamaForCausalLM) saved under the hub's GPT-2-style names
    # (transformer.h.N.attn.attention.q_proj, mlp.c_fc_0, ...) with model_type "exaone", llama3 rope, tied embeddings
    "exaone": ("ExaoneConfig", "LlamaForCausalLM", dict(
        head_dim=16, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 1e6, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    # InternLM3: Llama's layers (transformers runs it with LlamaForCausalLM) with q/k/v/o and MLP biases (qkv_bias,
    # bias) and its dynamic NTK rope (factor 6: the default frequencies within max_position_embeddings)
    "internlm3": ("InternLM3Config", "LlamaForCausalLM", dict(
        head_dim=16, qkv_bias=True, bias=True, rope_parameters={"rope_type": "dynamic", "rope_theta": 50000.0,
                                                                "factor": 6.0})),
    # Solar Open: GLM-4-MoE's sparse block (8 experts in 2 groups, a shared expert, scaled by 1.5) in every layer under
    # Llama's attention with q/k/v biases, the whole head rotating
    "solar_open": ("SolarOpenConfig", "SolarOpenForCausalLM", dict(
        head_dim=16, attention_bias=True, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=1.5, norm_topk_prob=True)),
    # FlexOlmo: OLMo 2's layers (post-norms, whole-projection q/k norms) around OLMoE's block: 7 experts, top 5, not
    # renormalised
    "flex_olmo": ("FlexOlmoConfig", "FlexOlmoForCausalLM", dict(num_experts=7, num_experts_per_tok=5)),
    # Jais 2: Llama's layers with LayerNorms, biases on q/k/v/o and an ungated ReLU² MLP with biases
    "jais2": ("Jais2Config", "Jais2ForCausalLM", dict(head_dim=16)),
    # HyperCLOVA X: Granite's scalars (the logits multiplied), a post-norm after each sub-block before the multiplier
    "hyperclovax": ("HyperCLOVAXConfig", "HyperCLOVAXForCausalLM", dict(
        head_dim=16, embedding_multiplier=1.7, residual_multiplier=0.3, attention_multiplier=0.2, logits_scaling=2.5)),
    # K-EXAONE's form: EXAONE 4's attention (q/k norms; a window of 8 in layers 0 and 1, NoPE in layer 2) in pre-norm
    # layers, layer 0 dense, then DeepSeek-V3's block: 8 experts in 2 groups, a shared expert, scaled by 2.5
    "exaone_moe": ("ExaoneMoeConfig", "ExaoneMoeForCausalLM", dict(
        head_dim=16, sliding_window=8, sliding_window_pattern=3, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, num_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, norm_topk_prob=True)),
    # HY-V3: Qwen3's attention, layer 0 dense, then 8 experts on corrected sigmoid scores (one group), renormalised,
    # scaled by 2.8, plus a shared expert
    "hy_v3": ("HYV3Config", "HYV3ForCausalLM", dict(
        head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, num_shared_experts=1,
        router_scaling_factor=2.8)),
    # Ernie 4.5 MoE (21B-A3B's form): Ernie 4.5's biased attention and interleaved fp32 rope; layer 0 dense, then 8
    # experts chosen on softmax + a correction bias (set in _hf), top 2, plus 2 shared ones with biases
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM", dict(
        head_dim=16, use_bias=True, moe_num_experts=8, moe_k=2, moe_intermediate_size=32, moe_num_shared_experts=2,
        moe_layer_start_index=1)),
    # CWM: Llama's layers, llama3 rope, a window of 8 in the layers layer_types calls sliding (1 and 2 here)
    "cwm": ("CwmConfig", "CwmForCausalLM", dict(
        head_dim=16, sliding_window=8, layer_types=["full_attention", "sliding_attention", "sliding_attention"],
        rope_parameters={"rope_type": "llama3", "rope_theta": 1e6, "factor": 16.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    # VaultGemma: Gemma 2 (soft caps, query_pre_attn_scalar, a window of 8 every other layer) without the post norms
    "vaultgemma": ("VaultGemmaConfig", "VaultGemmaForCausalLM", dict(
        head_dim=16, query_pre_attn_scalar=24, sliding_window=8, attn_logit_softcapping=20.0,
        final_logit_softcapping=15.0)),
    # nanochat: weightless norms (one on the embeddings too), its reversed rope then q/k norms, ReLU², capped logits
    "nanochat": ("NanoChatConfig", "NanoChatForCausalLM", dict(head_dim=16, final_logit_softcapping=15.0)),
    # GPT-Neo: GPT-2's model with unbiased q/k/v, unscaled scores, a window of 8 in its "local" layers (1 and 2)
    "gpt_neo": ("GPTNeoConfig", "GPTNeoForCausalLM", dict(
        window_size=8, attention_types=[[["global", "local"], 1], [["local"], 1]])),
    # Granite SWA: Granite's scalars, sinks in every layer, a window of 8 in layers 1 and 2, a rope base per layer
    # (layer 1 NoPE)
    "granite_swa": ("GraniteSWAConfig", "GraniteSWAForCausalLM", dict(
        embedding_multiplier=1.7, residual_multiplier=0.3, attention_multiplier=0.2, logits_scaling=2.5,
        sliding_window=8, layer_rope_theta=[10000.0, 0, 500000.0])),
    # its MoE form: Granite MoE Shared's block (4 experts, top 2, a shared MLP) under the same attention
    "granitemoe_swa": ("GraniteMoeSWAConfig", "GraniteMoeSWAForCausalLM", dict(
        embedding_multiplier=1.7, residual_multiplier=0.3, attention_multiplier=0.2, logits_scaling=2.5,
        num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=48, sliding_window=8,
        layer_rope_theta=[10000.0, 0, 500000.0])),
    # Phi-3.5-MoE: Mixtral's layers with LayerNorms, q/k/v/o and LM-head biases, 4 experts picked two by SparseMixer
    # (a wide jitter eps: some second picks weigh several logits, some one), longrope with its own mscales (the short
    # ones: max_model_len 128 is within the pretraining context, as transformers' rotary always takes them)
    "phimoe": ("PhimoeConfig", "PhimoeForCausalLM", dict(
        num_local_experts=4, num_experts_per_tok=2, attention_bias=True, lm_head_bias=True, router_jitter_noise=0.3,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 128,
                         "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
                         "long_factor": [1.0, 1.5, 2.2, 3.0, 4.1, 5.3, 6.8, 8.4],
                         "short_mscale": 1.2, "long_mscale": 1.35})),
}
_OPTIONAL.update(LAYER_PLAN_ARCHS)
_OPTIONAL.update(RECENT_ARCHS)
MISSING: dict[str, str] = {}  # name -> why it is not built here
for _name, (_config, _model, _extra) in _OPTIONAL.items():
    if hasattr(transformers, _config) and hasattr(transformers, _model):
        ARCHS[_name] = (getattr(transformers, _config), getattr(transformers, _model), _extra)
    else:
        _lacks = " or ".join(name for name in (_config, _model) if not hasattr(transformers, name))
        MISSING[_name] = f"transformers {transformers.__version__} has no {_lacks} (the reference)"
# transformers' eager attention is the reference: its SDPA path has no soft cap or sinks (5.17, on the GPU machine,
# took another attention for Gemma 2 by default);
# and its eager experts loop, the model's definition (transformers 5.17's default grouped_mm gave GPT-OSS other
# logprobs than that loop on an H200; 5.25's agrees)
EAGER_ARCHS = ("gemma2", "gpt_oss", "vaultgemma", "granite_swa", "granitemoe_swa", "flint", "hy_v4", "inkling")
EAGER_EXPERTS = ("gpt_oss", "glm4_moe", "deepseek_v2", "deepseek_v3", "granitemoe", "minimax_m2", "glm4_moe_lite",
                 "dots1", "mistral4", "granitemoeshared", "granitemoehybrid-moe", "hunyuan_moe", "phimoe",
                 "solar_open", "flex_olmo", "exaone_moe", "hy_v3", "inkling",
                 "ernie4_5_moe", "granitemoe_swa", "qwen3_next", "qwen3_5_moe",
                 "granitemoehybrid-mamba-moe", "lfm2_moe", "nemotron_h-moe", "nemotron_h-latent",
                 "gemma4-moe", "jamba", "mellum", "cohere2_moe", "cohere2_moe-rms",
                 "deepseek_v32", "glm_moe_dsa", "afmoe", "minicpm5_moe", "axk1", "axk2", "axk2-groups",
                 "flint", "kolibri1", "sarvam_moe", "param2moe", "sarvam_mla", "mimo_v2_flash",
                 "longcat_flash", "laguna", "laguna-elem", "jetmoe", *QWEN4_EXP,
                 "kimi_linear", "beam", "lara_mini", "minimax_text", "dots3_note", "dots3_note-full", "hy_v4") + LING3
# their configs have layer_norm_eps (StarCoder2: norm_epsilon; GPT-2: layer_norm_epsilon; OPT: none), no rms_norm_eps
LAYER_NORM_ARCHS = ("gpt2", "gpt_bigcode", "gptj", "falcon", "opt", "stablelm", "stablelm-parallel", "stablelm-qknorm",
                    "gpt_neox", "gpt_neox-sequential", "starcoder2", "phi", "cohere", "cohere-qknorm", "cohere2",
                    "nemotron", "bloom", "mpt", "jais2", "gpt_neo", "nemotron_h", "nemotron_h-moe", "nemotron_h-latent",
                    "mamba", "falcon_mamba", "mamba2", "codegen", "persimmon", "xglm")
# their configs name the MLP width otherwise (n_inner, ffn_dim, ffn_hidden_size): no intermediate_size, as real ones
OWN_MLP_WIDTH = ("gpt2", "gpt_bigcode", "gptj", "falcon", "opt", "bloom", "mpt", "codegen", "xglm")
# hybrid models (Gated DeltaNet, Mamba-2 layers): compared with transformers' stepwise forward (hf_reference.py says
# why; LFM2's short convolutions keep no recurrence: its one-pass forward is the reference; so is the attention-free
# Mamba models', within 8e-5 of the engine, whose transformers forward takes no past_key_values)
RECURRENT_ARCHS = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "granitemoehybrid-mamba", "granitemoehybrid-mamba-moe",
                   "nemotron_h", "bamba", "nemotron_h-moe", "nemotron_h-latent", "falcon_h1", "falcon_h1-nonorm",
                   "olmo_hybrid", "olmo_hybrid-rope", "jamba", "kimi_linear", "lara_mini", "minimax_text") + STEPPED
ENGINE = dict(device=DEVICE, dtype="float32", skip_tokenizer_init=True, enable_trace_replay=True, max_model_len=128)


def _hf(arch: str, seed: int = 0):
    config_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(seed)
    small = {k: v for k, v in SMALL.items() if k not in extra and not (k == "rms_norm_eps" and arch in LAYER_NORM_ARCHS)
             and not (k == "num_key_value_heads"
                      and arch.startswith(("gpt_neox", "deepseek", "glm4_moe_lite", "mistral4", "gpt2", "gpt_bigcode",
                                           "gptj", "falcon", "opt", "bloom", "mpt", "gpt_neo", "codegen", "xglm")))
             and not (k == "intermediate_size" and arch in OWN_MLP_WIDTH)}
    if arch in EAGER_ARCHS:
        extra = dict(extra, attn_implementation="eager")
    if arch in EAGER_EXPERTS:
        extra = dict(extra, experts_implementation="eager")
    model = model_cls(config_cls(**small, **extra)).to(torch.float32).eval()
    with torch.no_grad():  # transformers starts norms at weight 1, bias 0: no test would see them misapplied
        for name, param in model.named_parameters():
            if "norm" in name and "layernorm.mlp.fc" not in name:  # (A.X-K2's gated norms' MLPs: as initialised)
                param.uniform_(0.5, 1.5) if name.endswith("weight") else param.uniform_(-0.3, 0.3)
            elif name.endswith((".act_fn.alpha_p", ".act_fn.alpha_n")):  # Apertus's xIELU: away from its init
                param.uniform_(-1.0, 1.0)
            elif name.endswith((".D", ".dt_bias", ".dt_proj.bias", "z_L_init")):  # Mamba's skip (1 at init), dt biases;
                param.uniform_(-1.0, 1.0)  # HRM-Text's z_L_init (zeros)
            elif name.endswith((".router.scale", ".per_expert_scale")):  # Gemma 4's router scales (1 at init)
                param.uniform_(0.5, 1.5)
            elif name.endswith((".correct_output_scale", ".experts.bias", ".mlp.bias", ".gate_bias")):  # zeros at
                param.uniform_(0.5, 1.5)  # init: Gemma 3n's AltUp scale, JetMoE's biases, Beam's attention gate's
            elif name.endswith(".sinks"):  # GPT-OSS's: from a negligible to a dominant share of the softmax
                param.uniform_(-1.0, 3.0)
            elif name.endswith(("e_score_correction_bias", ".expert_bias")):  # Ernie 4.5 MoE's, AFMoE's (parameters)
                param.uniform_(-0.05, 0.05)
        for name, buffer in model.named_buffers():  # GLM-4-MoE's router correction (zeros at init): one that picks
            if name.endswith("e_score_correction_bias"):  # (and DeepSeek-V3's)
                buffer.uniform_(-0.3, 0.3)
            elif name.endswith(".expert_bias"):  # LFM2-MoE's (zeros at init), added to sigmoid scores
                buffer.uniform_(-0.3, 0.3)
            elif name.endswith(".layer_scalar"):  # Gemma 4's (1 at init): each layer's whole output scaled
                buffer.uniform_(0.5, 1.5)
    return model
