"""The small transformers models of the architectures transformers 5.25 added late in 2026 (Youtu-LLM, ...):
names -> (config class, model class, config overrides) as engine_archs._OPTIONAL's, on top of its SMALL (engine_archs
merges them; the classes named by string, absent from older transformers releases)."""

from __future__ import annotations

_COHERE2_MOE = dict(
    num_hidden_layers=5, head_dim=16, intermediate_size=32, prefix_dense_intermediate_size=80, logit_scale=0.25,
    layer_norm_eps=1e-5, rms_norm_eps=None, sliding_window=8, sliding_window_pattern=4,
    prefix_dense_sliding_window_pattern=1, first_k_dense_replace=1, num_experts=4, num_experts_per_tok=2,
    num_shared_experts=1, rope_theta=50000.0)

# DeepSeek-V3.2's form: engine_archs' deepseek_v3 (a q LoRA of 24, a latent of 32, heads of 16 + 8, 8 experts, the
# best of 2 groups) and an indexer of 4 heads of 16 keeping each query's best 128 keys: every key within the tests'
# max_model_len of 128
_DSA = dict(num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
            first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True, index_topk=128,
            index_head_dim=16, index_n_heads=4)

_AXK2 = dict({k: v for k, v in _DSA.items() if k != "first_k_dense_replace"}, gated_norm_rank=8,
             mlp_layer_types=["dense", "sparse", "sparse"])

# Dots 3 Note: the deepseek_v32 form (index_topk 128: dense) in its indexed layers 0 and 2; sliding layers 1 and 3 (a
# window of 8) with their own geometry (2 heads, a q LoRA of 20, a latent of 28, heads of 24 + 8, v of 12: the hub's
# swa_* keys) and rope theta; shared experts of 48 (not moe_intermediate_size's); n_group 2
_DOTS3 = dict({k: v for k, v in _DSA.items() if k != "first_k_dense_replace"}, num_hidden_layers=4, head_dim=24,
              shared_experts_intermediate_size=48, n_group=2, topk_group=1, rms_norm_eps=1e-5, sliding_window=8,
              layer_types=["indexed_attention", "sliding_attention", "indexed_attention", "sliding_attention"],
              swa_num_attention_heads=2, swa_num_key_value_heads=2, swa_q_lora_rank=20, swa_kv_lora_rank=28,
              swa_head_dim=32, swa_qk_nope_head_dim=24, swa_v_head_dim=12)

_LFM3 = dict(num_hidden_layers=4, head_dim=16, norm_eps=1e-5, conv_L_cache=3, sliding_window=8,
             layer_types=["conv", "full_attention", "conv", "sliding_attention"])

_BAILING = dict(head_dim=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True)

RECENT_ARCHS = {
    # Youtu-LLM: DeepSeek-V3's latent attention (a q LoRA of 24, a latent of 32, q/k heads of 16 + 8 rotary in
    # interleaved pairs, v heads of 16) in every layer over a dense SwiGLU; tied embeddings (its default); the layers'
    # norms at an eps of 0.05, the latent norms at transformers' fixed 1e-6
    "youtu": ("YoutuConfig", "YoutuForCausalLM", dict(
        num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, rms_norm_eps=0.05)),
    # Mellum 2: Qwen3-MoE's layers, layer 0 dense (mlp_layer_types), 4 experts (top 2, renormalised) in layers 1
    # and 2; a window of 8 in layers 0 and 1 (the 40-token prompt outgrows it), a rope per kind of layer (the sliding
    # layers' theta 1e4, the full one's 5e5); biases on q, k, v and o
    "mellum": ("MellumConfig", "MellumForCausalLM", dict(
        head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse", "sparse"], attention_bias=True)),
    # CodeGen: GPT-J's model (6 of 16 elements rotating in interleaved pairs, the parallel layer, an MLP of 96) with
    # q, k and v in one qkv_proj stored as 4 shards of [q | v | k]
    "codegen": ("CodeGenConfig", "CodeGenForCausalLM", dict(n_inner=96, rotary_dim=6)),
    # MiniCPM3: DeepSeek's latent attention (a q LoRA of 24, a latent of 32, heads of 16 + 8 rotating in rotate-half
    # pairs) over dense layers; the embeddings times 12, each sub-block times 1.4 / sqrt(3), the final hidden divided
    # by 64 / 16 before the head; untied
    "minicpm3": ("MiniCPM3Config", "MiniCPM3ForCausalLM", dict(
        num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, scale_emb=12, scale_depth=1.4, dim_model_base=16, tie_word_embeddings=False)),
    # Cohere 2 MoE (Command A+): Cohere 2's parallel layers with Cohere's LayerNorm; layer 0 a dense SwiGLU of 80 with
    # the rotary forced on, layers 1-3 sliding (a window of 8) and layer 4 full without a rotary, each with 4 experts
    # (the top-2 logits softmaxed) and a shared expert averaged in; cohere2_moe-rms: RMSNorms, the sigmoid router
    # renormalised, the shared expert summed
    "cohere2_moe": ("Cohere2MoeConfig", "Cohere2MoeForCausalLM", _COHERE2_MOE),
    "cohere2_moe-rms": ("Cohere2MoeConfig", "Cohere2MoeForCausalLM", dict(
        _COHERE2_MOE, rms_norm_eps=1e-5, expert_selection_fn="sigmoid", shared_expert_combination_strategy="sum")),
    # DeepSeek-V3.2 and GLM-5 (one expert group, v heads of 24 = nope + rope, layer 1 reusing layer 0's key choice)
    # AFMoE (Arcee Trinity): layer 0 dense, layers 1-3 with 4 experts (top 2 of sigmoid scores + an expert bias,
    # renormalised, times 2.5) and a shared expert; sliding layers 0 and 2 (a window of 8, the rotary), full layers 1
    # and 3 without one; the output gate; OLMo 2's norm order everywhere; the embeddings times sqrt(64) (muP)
    "afmoe": ("AfmoeConfig", "AfmoeForCausalLM", dict(
        num_hidden_layers=4, head_dim=16, num_dense_layers=1, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, num_shared_experts=1, route_scale=2.5, global_attn_every_n_layers=2,
        sliding_window=8, mup_enabled=True)),
    # MiniCPM5 MoE: DeepSeek-V3's MoE (4 experts, top 2, a shared one, times 3.66) in layers 1 and 2, the gated
    # output attention (a [q | gate] projection per head)
    "minicpm5_moe": ("MiniCPM5MoeConfig", "MiniCPM5MoeForCausalLM", dict(
        head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
        routed_scaling_factor=3.66)),
    # LFM3: short convolutions (a kernel of 3) in layers 0 and 2, full attention in layer 1 (the hub's "default"
    # rope with a partial factor transformers ignores, theta 1e6), sliding attention in layer 3 (a window of 8,
    # theta 1e4), per-head output gates, sandwich norms; lfm3-proportional: the config class's default rope
    "lfm3": ("Lfm3Config", "Lfm3ForCausalLM", dict(_LFM3, rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    "lfm3-proportional": ("Lfm3Config", "Lfm3ForCausalLM", _LFM3),
    # DBRX: Wqkv (4 q heads, 2 KV heads) clamped at 0.5, bias-free LayerNorms, 4 experts (top 2 of a model-dtype
    # softmax, divided by their L1 norm) stored flat (w1 / v1 / w2)
    "dbrx": ("DbrxConfig", "DbrxForCausalLM", dict(
        d_model=64, n_heads=4, n_layers=3, max_seq_len=256,
        attn_config=dict(kv_n_heads=2, clip_qkv=0.5, rope_theta=500000.0),
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        ffn_config=dict(ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2))),
    # Persimmon: GPT-NeoX's sequential layer, a LayerNorm shared by the heads of q and k (weight and bias), half of
    # each head rotating at theta 25000, a ReLU² MLP with biases; MHA
    "persimmon": ("PersimmonConfig", "PersimmonForCausalLM", dict(
        num_key_value_heads=4, intermediate_size=128, rope_parameters={
            "rope_type": "default", "rope_theta": 25000.0, "partial_rotary_factor": 0.5})),
    # A.X-K1: DeepSeek-V3 (the deepseek_v32 form without an indexer) whose sparse layers norm their output
    "axk1": ("AXK1Config", "AXK1ForCausalLM", dict(
        {k: v for k, v in _DSA.items() if not k.startswith("index_")}, n_group=2, topk_group=1)),
    # A.X-K2: the deepseek_v32 form (its index_topk of 128: dense) with gated norms of rank 8 (every layer's input
    # norm, layers 1 and 2's second; layer 0 dense), each head's query and output gate from one q_gate_proj over
    # [q_a_layernorm(q_a) | q_a], no expert groups; axk2-groups: the best of 2 groups, the others' experts scored 0.0
    "axk2": ("AXK2Config", "AXK2ForCausalLM", _AXK2),
    "axk2-groups": ("AXK2Config", "AXK2ForCausalLM", dict(_AXK2, n_group=2, topk_group=1)),
    # Flint: Qwen3-MoE's layers in OLMo 2's norm order, fp32 attention sinks, the rotary and a window of 8 in the
    # sliding layer 1 alone; layer 0 dense, layers 1 and 2 with 4 experts (top 2 of fp32 sigmoid scores,
    # renormalised) and an ungated shared expert of 48
    "flint": ("FlintConfig", "FlintForCausalLM", dict(
        head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, mlp_only_layers=[0], sliding_window=8,
        layer_types=["full_attention", "sliding_attention", "full_attention"])),
    # Kolibri-1: EXAONE 4's attention (a window of 8 and the rotary in layers 0 and 1, neither in layer 2) in GLM-4's
    # sandwich layer; every layer 4 experts picked on logits + a correction bias, weighed by sigmoid(logit),
    # renormalised; an ungated shared expert of 48
    "kolibri1": ("Kolibri1Config", "Kolibri1ForCausalLM", dict(
        head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, sliding_window=8, norm_topk_prob=True,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"])),
    # XGLM: OPT's fairseq layers with fixed sinusoidal positions at offset 2, the embeddings times sqrt(64), the
    # exact GELU, a tied head
    "xglm": ("XGLMConfig", "XGLMForCausalLM", dict(d_model=64, ffn_dim=128, num_layers=3, attention_heads=4)),
    # Apertus 1.5: Apertus with an LM head of 300 rows under an embedding of 400 (ids 300-399: image / audio codes,
    # prompt-only)
    "apertus1p5": ("Apertus1p5TextConfig", "Apertus1p5TextForCausalLM", dict(
        head_dim=16, vocab_size=400, output_vocab_size=300, tie_word_embeddings=False)),
    # Sarvam-30B (sarvam_moe) and Param2 (param2moe): transformers' GLM-4-MoE with the whole head rotating and q/k
    # norms, saved under Bailing-MoE's names (a fused query_key_value, word_embeddings, gate.expert_bias); Param2 ties
    # its embeddings and its shared expert is two wide. Sarvam-105B (sarvam_mla): DeepSeek-V3 without a q LoRA, its
    # config's own keys for the experts. IQuest-Coder: Llama under its own model_type
    "sarvam_moe": ("SarvamMoEConfig", "Glm4MoeForCausalLM", dict(_BAILING, n_shared_experts=1)),
    "param2moe": ("Param2MoeConfig", "Glm4MoeForCausalLM", dict(_BAILING, n_shared_experts=2)),
    "sarvam_mla": ("SarvamMLAConfig", "DeepseekV3ForCausalLM", dict(
        num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, num_shared_experts=1,
        first_k_dense_replace=1, routed_scaling_factor=2.5)),
    "iquestcoder": ("IQuestCoderConfig", "LlamaForCausalLM", dict(head_dim=16)),
    # MiMo-V2-Flash: full layers 0 and 3 (one KV head), sliding layers 1 and 2 (two KV heads, sinks, a window of 8);
    # q/k heads of 24 (8 rotating), V heads of 16 scaled by 0.707; layer 0 dense, then 4 experts (top 2 of sigmoid
    # scores plus a correction, renormalised, times 1.5), no shared one; q/k/v biases
    "mimo_v2_flash": ("MiMoV2FlashConfig", "MiMoV2FlashForCausalLM", dict(
        num_hidden_layers=4, num_key_value_heads=1, head_dim=24, v_head_dim=16, moe_intermediate_size=32,
        n_routed_experts=4, num_experts_per_tok=2, routed_scaling_factor=1.5, sliding_window=8, attention_bias=True,
        layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"])),
    # LongCat-Flash: 2 blocks of two MLA sub-layers (a q LoRA of 24, a latent of 32, heads of 16 + 8, v of 16) and a
    # shortcut MoE of 4 experts and 2 zero (identity) experts, top 2 of a softmax plus a correction, times 6
    # (num_layers too: transformers 5.17 builds num_layers blocks, its default 28, whatever num_hidden_layers says)
    "longcat_flash": ("LongcatFlashConfig", "LongcatFlashForCausalLM", dict(
        num_hidden_layers=4, num_layers=2, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16,
        qk_rope_head_dim=8, head_dim=8, v_head_dim=16, n_routed_experts=4, zero_expert_num=2, moe_topk=2,
        expert_ffn_hidden_size=32, ffn_hidden_size=96, routed_scaling_factor=6.0)),
    # Laguna: full layers 0 and 3 (4 q heads, half of each head rotating), sliding layers 1 and 2 (8 q heads, a window
    # of 8, the whole head rotating, another base), 2 KV heads of 16 everywhere, a softplus gate per head; layer 0
    # dense, then 4 experts (top 2 of sigmoid scores plus a correction, renormalised), times 2.5, plus a shared expert
    "laguna": ("LagunaConfig", "LagunaForCausalLM", dict(
        num_hidden_layers=4, head_dim=16, num_attention_heads_per_layer=[4, 8, 8, 4], num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48, sliding_window=8,
        gating="per-head", moe_routed_scaling_factor=2.5, attention_bias=True,
        layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 5e5, "partial_rotary_factor": 0.5},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    "laguna-elem": ("LagunaConfig", "LagunaForCausalLM", dict(
        head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        gating="per-element", moe_router_logit_softcapping=2.0)),
    # Beam: sliding layers 0 and 2 (a window of 8, rope theta 5e4 in fp32), full layers 1 and 3 (NoPE, the scaled q),
    # q/k norms, the gated output with its per-head bias; dense layers 0 and 3, grouped sigmoid routing over 8 experts
    # (the best 2 of 4 groups, top 2) in 1 and 2, times 2.5; the depth-scaled sandwich residual, the logits capped at 30
    "beam": ("BeamConfig", "BeamForCausalLM", dict(
        num_hidden_layers=4, head_dim=16, num_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
        moe_intermediate_size=32, routed_scaling_factor=2.5, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse", "sparse", "dense"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 5e4}, "full_attention": None})),
    # HRM-Text: two stacks of 2 layers (weightless norms, gated multi-head attention, rope theta 5e4), L applied 3
    # times per H pass, 2 H cycles: 16 KV slots; 2 KV heads ignored; weights of std 0.1 (0.5 makes 32 layer passes
    # chaotic: transformers' own fp32 and fp64 then differ by 5 in a logprob), the embeddings times 1 / 0.1
    "hrm_text": ("HrmTextConfig", "HrmTextForCausalLM", dict(
        num_hidden_layers=2, head_dim=16, H_cycles=2, L_cycles=3, intermediate_size=128, initializer_range=0.1,
        rope_parameters={"rope_type": "default", "rope_theta": 5e4})),
    # JetMoE: 4 attention experts (q / o per expert, 2 KV heads of 16 shared) and 4 MLP experts (width 32), top 2 of
    # each with their routers; biases after both sums; the layers' norms at eps 1e-6, the final one at the config's
    "jetmoe": ("JetMoeConfig", "JetMoeForCausalLM", dict(
        num_key_value_heads=2, kv_channels=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
        rms_norm_eps=0.05)),
    # OpenAI GPT (GPT-1): GPT-2's Conv1D layout and learned positions in post-norm layers, no final norm, gelu_new
    "openai_gpt": ("OpenAIGPTConfig", "OpenAIGPTLMHeadModel", dict(num_key_value_heads=4, layer_norm_epsilon=1e-5)),
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM", dict(_DSA, n_group=2, topk_group=1)),
    "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", dict(
        _DSA, v_head_dim=24, n_group=1, topk_group=1, rms_norm_eps=1e-5, index_topk_pattern="FSF")),
    # Dots 3 Note (_DOTS3): layer 0 dense, layers 1-3 sparse; the sliding layers' KV cache its own shape.
    # dots3_note-full: use_dsa false (full attention, no indexer: no context cap), one expert group, 2 shared experts
    "dots3_note": ("Dots3NoteTextConfig", "Dots3NoteForCausalLM", _DOTS3),
    "dots3_note-full": ("Dots3NoteTextConfig", "Dots3NoteForCausalLM", dict(
        _DOTS3, use_dsa=False, n_group=1, n_shared_experts=2,
        layer_types=["full_attention", "sliding_attention", "full_attention", "sliding_attention"])),
    # HY-V4: the deepseek_v32 form (index_topk 128: dense) with 3 hyper-connection streams (post scaled by 1.5), an
    # fp32 sink and a sigmoid output gate per head, "shared" indexer layer 2; layer 0 dense, layers 1 and 2 V3's
    # router over one group with a shared expert and experts whose gate and up clamp at 1.5 (the values cross it)
    "hy_v4": ("HYV4Config", "HYV4ForCausalLM", dict(
        {k: v for k, v in _DSA.items() if k != "first_k_dense_replace"}, hc_mult=3, hc_magnitude=1.5,
        swiglu_limit=1.5, rms_norm_eps=1e-5)),
    # Inkling: full layers 0 and 2 (4 heads of 16, 2 KV heads, a relative bias over 12 distances, q and the bias
    # scaled logarithmically past position 6), sliding layer 1 (a window of 8, its own 4 KV heads of 8); layer 0 dense,
    # layers 1-2 8 experts (top 2) and 2 shared experts in the router's normalisation; convolutions of 4 taps
    "inkling": ("InklingTextConfig", "InklingForCausalLM", dict(
        head_dim=16, swa_num_attention_heads=4, swa_num_key_value_heads=4, swa_head_dim=8, sliding_window_size=8,
        d_rel=4, rel_extent=12, log_scaling_n_floor=6, log_scaling_alpha=0.5, layer_types=[
            "hybrid", "hybrid_sliding", "hybrid"], mlp_layer_types=["dense", "sparse", "sparse"],
        moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2, route_scale=2.5,
        logits_mup_width_multiplier=2.0)),
}
