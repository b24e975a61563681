"""config.json files of public models' shapes, for benchmarks with dummy weights (no checkpoint needed).

Usage: python bench/arch_shapes.py NAME [DIR]   writes DIR/config.json (a new temporary folder without DIR) and
                                               prints the folder; then
       replayllm bench throughput --model FOLDER --load-format dummy
       python bench/arch_shapes.py --list       the names
bench/gpu_check.sh's `W1-<name>` rows run W1 (256 x (256 in + 256 out)) on each. The sizes, heads, widths and
layer plans are the published configs' (the ones a decode step's cost depends on); rope factor lists and token ids
are placeholders of the right length, which no timing depends on."""

from __future__ import annotations

import json
import os
import sys
import tempfile

_LONGROPE = {"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [1.0 + i / 8 for i in range(48)]}

SHAPES: dict[str, dict] = {
    "phi-4-mini": {  # 3.8B: 0.75 of each 128-wide head rotates, longrope
        "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 200064, "hidden_size": 3072,
        "intermediate_size": 8192, "num_hidden_layers": 32, "num_attention_heads": 24, "num_key_value_heads": 8,
        "max_position_embeddings": 131072, "original_max_position_embeddings": 4096, "partial_rotary_factor": 0.75,
        "rope_scaling": _LONGROPE, "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
        "sliding_window": 262144, "hidden_act": "silu", "bos_token_id": 199999, "eos_token_id": 199999,
        "pad_token_id": 199999, "dtype": "bfloat16"},
    "glm-4-9b": {  # GLM-4-9B-0414: interleaved half rotary, norms after the sub-blocks
        "architectures": ["Glm4ForCausalLM"], "model_type": "glm4", "vocab_size": 151552, "hidden_size": 4096,
        "intermediate_size": 13696, "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 2,
        "head_dim": 128, "partial_rotary_factor": 0.5, "attention_bias": True, "max_position_embeddings": 32768,
        "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "hidden_act": "silu", "pad_token_id": 151329,
        "eos_token_id": [151329, 151336, 151338], "dtype": "bfloat16"},
    "stablelm-2-1.6b": {
        "architectures": ["StableLmForCausalLM"], "model_type": "stablelm", "vocab_size": 100352,
        "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 24, "num_attention_heads": 32,
        "num_key_value_heads": 32, "partial_rotary_factor": 0.25, "use_qkv_bias": True, "layer_norm_eps": 1e-5,
        "max_position_embeddings": 4096, "rope_theta": 10000.0, "hidden_act": "silu", "bos_token_id": 100257,
        "eos_token_id": 100257, "dtype": "bfloat16"},
    "pythia-1.4b": {  # GPT-NeoX: parallel residual, GELU MLP, a quarter rotary
        "architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "vocab_size": 50304,
        "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 24, "num_attention_heads": 16,
        "rotary_pct": 0.25, "rotary_emb_base": 10000, "max_position_embeddings": 2048,
        "use_parallel_residual": True, "hidden_act": "gelu", "layer_norm_eps": 1e-5, "bos_token_id": 0,
        "eos_token_id": 0, "dtype": "float16"},
    "olmo-2-1b": {
        "architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2", "vocab_size": 100352, "hidden_size": 2048,
        "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 16,
        "max_position_embeddings": 4096, "rope_theta": 500000.0, "rms_norm_eps": 1e-6, "hidden_act": "silu",
        "pad_token_id": 100277, "eos_token_id": 100257, "dtype": "bfloat16"},
    "granite-3.3-2b": {
        "architectures": ["GraniteForCausalLM"], "model_type": "granite", "vocab_size": 49159, "hidden_size": 2048,
        "intermediate_size": 8192, "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 8,
        "max_position_embeddings": 131072, "rope_theta": 10000000.0, "rms_norm_eps": 1e-5,
        "embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.015625,
        "logits_scaling": 8.0, "tie_word_embeddings": True, "hidden_act": "silu", "bos_token_id": 0,
        "eos_token_id": 0, "pad_token_id": 0, "dtype": "bfloat16"},
    "smollm3-3b": {  # every 4th layer without rope
        "architectures": ["SmolLM3ForCausalLM"], "model_type": "smollm3", "vocab_size": 128256,
        "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36, "num_attention_heads": 16,
        "num_key_value_heads": 4, "no_rope_layers": [0 if (i + 1) % 4 == 0 else 1 for i in range(36)],
        "max_position_embeddings": 65536, "rope_theta": 5000000.0, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True, "hidden_act": "silu", "bos_token_id": 128000, "eos_token_id": 128012,
        "pad_token_id": 128004, "dtype": "bfloat16"},
    "gemma-2b": {  # MQA, 256-wide heads, GeGLU, a 256k vocabulary
        "architectures": ["GemmaForCausalLM"], "model_type": "gemma", "vocab_size": 256000, "hidden_size": 2048,
        "intermediate_size": 16384, "num_hidden_layers": 18, "num_attention_heads": 8, "num_key_value_heads": 1,
        "head_dim": 256, "max_position_embeddings": 8192, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
        "hidden_act": "gelu_pytorch_tanh", "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1,
        "pad_token_id": 0, "dtype": "bfloat16"},
    "gemma-2-2b": {  # soft-capped attention scores (50) and logits (30), a 4096-token window every other layer
        "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "vocab_size": 256000, "hidden_size": 2304,
        "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 256, "query_pre_attn_scalar": 256, "max_position_embeddings": 8192, "rope_theta": 10000.0,
        "sliding_window": 4096, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
        "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
        "bos_token_id": 2, "eos_token_id": [1, 107], "pad_token_id": 0, "dtype": "bfloat16"},
    "gemma-3-1b": {  # a 512-token window in five of every six layers (their own rope base), q/k norms, MQA
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262144,
        "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 256, "query_pre_attn_scalar": 256, "max_position_embeddings": 32768,
        "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rope_scaling": None, "sliding_window": 512,
        "sliding_window_pattern": 6, "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": None, "attn_logit_softcapping": None, "tie_word_embeddings": True,
        "bos_token_id": 2, "eos_token_id": [1, 106], "pad_token_id": 0, "dtype": "bfloat16"},
    "phi-2": {  # one LayerNorm a layer (parallel attention and MLP), biases, 0.4 of each head rotating, a biased head
        "architectures": ["PhiForCausalLM"], "model_type": "phi", "vocab_size": 51200, "hidden_size": 2560,
        "intermediate_size": 10240, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
        "partial_rotary_factor": 0.4, "max_position_embeddings": 2048, "rope_theta": 10000.0,
        "layer_norm_eps": 1e-5, "hidden_act": "gelu_new", "tie_word_embeddings": False, "bos_token_id": 50256,
        "eos_token_id": 50256, "dtype": "float16"},
    "aya-expanse-8b": {  # Cohere: one mean-centred LayerNorm a layer, interleaved rotary in fp32, scaled logits
        "architectures": ["CohereForCausalLM"], "model_type": "cohere", "vocab_size": 256000, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "max_position_embeddings": 8192, "rope_theta": 10000.0, "layer_norm_eps": 1e-5, "logit_scale": 0.125,
        "use_qk_norm": False, "tie_word_embeddings": True, "hidden_act": "silu", "bos_token_id": 5,
        "eos_token_id": 255001, "pad_token_id": 0, "dtype": "float16"},
    "starcoder2-3b": {  # LayerNorms, biases everywhere, a plain GELU MLP, a 4096-token window in every layer
        "architectures": ["Starcoder2ForCausalLM"], "model_type": "starcoder2", "vocab_size": 49152,
        "hidden_size": 3072, "intermediate_size": 12288, "num_hidden_layers": 30, "num_attention_heads": 24,
        "num_key_value_heads": 2, "max_position_embeddings": 16384, "sliding_window": 4096,
        "rope_theta": 999999.4420358813, "norm_epsilon": 1e-5, "use_bias": True, "hidden_act": "gelu_pytorch_tanh",
        "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 0, "dtype": "bfloat16"},
    "mistral-7b-v0.1": {  # a 4096-token sliding window in every layer (the default max_model_len runs it past W)
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": 32000, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "max_position_embeddings": 32768, "sliding_window": 4096, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
        "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
        "dtype": "bfloat16"},
    "olmoe-1b-7b": {  # 64 experts, 8 per token
        "architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "vocab_size": 50304, "hidden_size": 2048,
        "intermediate_size": 1024, "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 16,
        "num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": False, "max_position_embeddings": 4096,
        "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "hidden_act": "silu", "pad_token_id": 1, "eos_token_id": 50279,
        "dtype": "bfloat16"},
    "gpt-oss-20b": {  # 32 experts (4 per token) with biases, attention sinks, a 128-token window every other layer;
        # openai's checkpoint keeps the experts in MXFP4, dequantized to bf16 at load (~42 GB of bf16 weights)
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880,
        "intermediate_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8,
        "head_dim": 64, "num_local_experts": 32, "num_experts_per_tok": 4, "experts_per_token": 4,
        "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 12, "attention_bias": True,
        "max_position_embeddings": 131072, "rope_theta": 150000.0,
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 4096},
        "rms_norm_eps": 1e-5, "swiglu_limit": 7.0, "hidden_act": "silu", "tie_word_embeddings": False,
        "pad_token_id": 199999, "eos_token_id": 200002, "dtype": "bfloat16"},
    "deepseek-v2-lite": {  # MLA (no q LoRA; the cache expanded to 16 heads x 192: docs/features.md), layer 0 dense,
        # then 64 experts (6 per token, a softmax router) and 2 shared ones; YaRN x40
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 102400,
        "hidden_size": 2048, "intermediate_size": 10944, "num_hidden_layers": 27, "num_attention_heads": 16,
        "num_key_value_heads": 16, "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 64, "n_shared_experts": 2,
        "moe_intermediate_size": 1408, "num_experts_per_tok": 6, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "topk_method": "greedy", "n_group": 1, "topk_group": 1, "norm_topk_prob": False, "routed_scaling_factor": 1.0,
        "scoring_func": "softmax", "max_position_embeddings": 163840, "rope_theta": 10000,
        "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
                         "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096},
        "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False,
        "bos_token_id": 100000, "eos_token_id": 100001, "torch_dtype": "bfloat16"},
    "starcoderbase-1b": {  # GPT-BigCode: multi-query attention (one K/V head for 16 query heads), learned positions
        "architectures": ["GPTBigCodeForCausalLM"], "model_type": "gpt_bigcode", "vocab_size": 49152, "n_embd": 2048,
        "n_layer": 24, "n_head": 16, "n_inner": 8192, "n_positions": 8192, "multi_query": True,
        "activation_function": "gelu_pytorch_tanh", "layer_norm_epsilon": 1e-5, "scale_attn_weights": True,
        # the published config says float32 (this engine's dtype="auto" would run fp32; vLLM's runs half precision)
        "bos_token_id": 0, "eos_token_id": 0, "torch_dtype": "bfloat16"},
    "gpt-j-6b": {  # GPT-J: the parallel layer, 64 of 256 elements of each head rotating (interleaved), an LM head
        # with a bias; its published config says float32 as well
        "architectures": ["GPTJForCausalLM"], "model_type": "gptj", "vocab_size": 50400, "n_embd": 4096,
        "n_layer": 28, "n_head": 16, "rotary_dim": 64, "n_inner": None, "n_positions": 2048,
        "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "tie_word_embeddings": False,
        "bos_token_id": 50256, "eos_token_id": 50256, "torch_dtype": "bfloat16"},
    "falcon-7b": {  # Falcon: multi-query (71 query heads of 64, one K/V head), attention and MLP over one norm
        "architectures": ["FalconForCausalLM"], "model_type": "falcon", "vocab_size": 65024, "hidden_size": 4544,
        "num_hidden_layers": 32, "num_attention_heads": 71, "multi_query": True, "parallel_attn": True,
        "new_decoder_architecture": False, "alibi": False, "bias": False, "layer_norm_epsilon": 1e-5,
        "max_position_embeddings": 2048, "rope_theta": 10000.0, "bos_token_id": 11, "eos_token_id": 11,
        "torch_dtype": "bfloat16"},
    "olmo-1b": {  # the first OLMo: Llama's layers with parameter-free fp32 LayerNorms (OLMo-1B-hf; float32 published)
        "architectures": ["OlmoForCausalLM"], "model_type": "olmo", "vocab_size": 50304, "hidden_size": 2048,
        "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 16,
        "max_position_embeddings": 2048, "rope_theta": 10000.0, "clip_qkv": None, "tie_word_embeddings": True,
        "hidden_act": "silu", "pad_token_id": 1, "eos_token_id": 50279, "torch_dtype": "bfloat16"},
    "nemotron-4-15b": {  # Nemotron-4 15B (its paper's table: 32 layers, 6144 wide, 48 q / 8 KV heads, 256k vocab):
        # LayerNorm1P norms, half rotary, ReLU² MLP 4x wide, untied embeddings
        "architectures": ["NemotronForCausalLM"], "model_type": "nemotron", "vocab_size": 256000,
        "hidden_size": 6144, "intermediate_size": 24576, "num_hidden_layers": 32, "num_attention_heads": 48,
        "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 4096, "partial_rotary_factor": 0.5,
        "rope_theta": 10000.0, "norm_eps": 1e-5, "hidden_act": "relu2", "tie_word_embeddings": False,
        "bos_token_id": 2, "eos_token_id": 3, "torch_dtype": "bfloat16"},
    "bloom-560m": {  # BLOOM: ALiBi (no positions), 16 heads of 64, a LayerNorm on the 250,880-token embeddings
        "architectures": ["BloomForCausalLM"], "model_type": "bloom", "vocab_size": 250880, "hidden_size": 1024,
        "n_layer": 24, "n_head": 16, "layer_norm_epsilon": 1e-5, "apply_residual_connection_post_layernorm": False,
        "pretraining_tp": 1, "slow_but_exact": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3,
        "torch_dtype": "bfloat16"},  # published float16; no max_position_embeddings: the engine's 2048 (vLLM's)
    "mpt-7b": {  # MPT-7B: ALiBi (32 heads of 128), bias-free LayerNorms and projections, exact-GELU MLP 4x wide
        "architectures": ["MPTForCausalLM"], "model_type": "mpt", "vocab_size": 50432, "d_model": 4096,
        "n_layers": 32, "n_heads": 32, "expansion_ratio": 4, "max_seq_len": 2048, "no_bias": True,
        "layer_norm_epsilon": 1e-5, "attn_config": {"alibi": True, "alibi_bias_max": 8, "clip_qkv": None,
                                                     "qk_ln": False, "softmax_scale": None, "prefix_lm": False},
        "eos_token_id": 0, "torch_dtype": "bfloat16"},
}


def write_shape(name: str, root: str | None = None) -> str:
    """The folder holding SHAPES[name] as config.json (a new temporary folder unless root is given)."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    path = root or tempfile.mkdtemp(prefix=f"{name}-dummy-")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(SHAPES[name], f)
    return path


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1] == "--list":
        print("\n".join(SHAPES))
    elif len(sys.argv) in (2, 3):
        print(write_shape(*sys.argv[1:]))
    else:
        sys.exit(__doc__)
