"""The small transformers models of the hybrid architectures and of those whose layers differ in shape (Qwen3-Next
/ Qwen3.5, Gemma 4, Falcon-H1, OLMo Hybrid, Jamba, the attention-free Mamba models, Bamba, Zamba2, LFM2, NemotronH's MoE
forms): names -> (config class, model class, config overrides) as engine_archs._OPTIONAL's, on top of its SMALL
(engine_archs merges them; the classes named by string, absent from older transformers releases)."""

from __future__ import annotations

_QWEN3_NEXT = dict(head_dim=16, layer_types=["linear_attention", "full_attention", "linear_attention"],
                   linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                   linear_conv_kernel_dim=4)
_FALCON_H1 = dict(num_key_value_heads=2, head_dim=24, mamba_d_ssm=96, mamba_n_heads=6, mamba_d_head="auto",
                  mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, mamba_chunk_size=8, mamba_conv_bias=True,
                  mamba_proj_bias=True, projectors_bias=True, attention_bias=True, mlp_bias=True, rms_norm_eps=1e-5,
                  embedding_multiplier=2.0, lm_head_multiplier=0.5, key_multiplier=0.8, attention_in_multiplier=1.2,
                  attention_out_multiplier=0.7, ssm_in_multiplier=1.1, ssm_out_multiplier=0.6,
                  mlp_multipliers=[1.5, 0.5], ssm_multipliers=[0.9, 1.1, 0.8, 1.2, 1.3])
# (engine_archs.RECURRENT_ARCHS: against transformers' stepwise forward)
ZAMBA2 = ("zamba2", "zamba2-plain", "zamba2-untied")
# Ling 3 (BailingHybrid; also engine_archs.EAGER_EXPERTS)
LING3 = ("bailing_hybrid", "bailing_hybrid-unsafe")
# Qwen4-Exp (also engine_archs.EAGER_EXPERTS)
QWEN4_EXP = ("qwen4_exp", "qwen4_exp-sigmoid")
STEPPED = ZAMBA2 + LING3 + QWEN4_EXP  # engine_archs.RECURRENT_ARCHS' layer plans
_LING3 = dict(num_hidden_layers=4, layer_group_size=2, num_key_value_heads=4, head_dim=16, kv_lora_rank=32,
              qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, num_local_experts=8, n_group=2, topk_group=1,
              num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
              swiglu_limits=[0, 1.5, 0, 2.0], swiglu_limits_shared=[0, 1.0, 1.5, 0])
_QWEN4_EXP = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                  hc_count=3, hc_lowrank=8, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16,
                  indexer_budget=128, indexer_compress_ratio=4)
_OLMO_HYBRID = dict(layer_types=["linear_attention", "full_attention", "linear_attention"], linear_num_key_heads=2,
                    linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=16,
                    linear_conv_kernel_dim=4, linear_allow_neg_eigval=True)

LAYER_PLAN_ARCHS = {
    # Qwen3-Next: Gated DeltaNet in layers 0 and 2 (2 key heads, 4 value heads: each key head serves two; Dk = Dv =
    # 16, a convolution of 4), gated attention in layer 1 (a quarter of each head rotating); 8 experts + a shared
    # one in layers 0 and 2, layer 1 dense
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        _QWEN3_NEXT, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, mlp_only_layers=[1])),
    # Qwen3.5 (dense) and Qwen3.5-MoE (every layer sparse): the same linear and gated-attention layers
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(_QWEN3_NEXT)),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(
        _QWEN3_NEXT, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48)),
    # Qwen4-Exp: Qwen3.5-MoE's layers (the attention layer "indexed": QSA with a budget of 128 in blocks of 4, dense
    # up to 131 tokens, max_model_len 128) behind gated residuals over 3 streams (a mixing rank of 8); "-sigmoid": the
    # DeltaNet's sigmoid output gate, 2 streams, the top 2 of 8 not renormalised, the attention layer first
    "qwen4_exp": ("Qwen4ExpTextConfig", "Qwen4ExpForCausalLM", dict(
        _QWEN3_NEXT, layer_types=["linear_attention", "indexed_attention", "linear_attention"], **_QWEN4_EXP)),
    "qwen4_exp-sigmoid": ("Qwen4ExpTextConfig", "Qwen4ExpForCausalLM", dict(
        _QWEN3_NEXT, layer_types=["indexed_attention", "linear_attention", "linear_attention"],
        **dict(_QWEN4_EXP, hc_count=2, output_gate_type="sigmoid", norm_topk_prob=False))),
    # Lara-4-Mini: the released period of five (Gated DeltaNet in layers 0 and 2 as Qwen3.5's, Qwen3 attention with
    # the rotary and a window of 8 in layers 1 and 4, without either in layer 3); Helium's fp32-weight norms; every
    # layer 4 experts (top 2 of an fp32 softmax, renormalised) and an ungated shared expert of 48; tied embeddings
    "lara_mini": ("LaraMiniConfig", "LaraMiniForCausalLM", dict(
        _QWEN3_NEXT, num_hidden_layers=5, sliding_window=8, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=48, layer_types=[
            "linear_attention", "sliding_attention", "linear_attention", "full_attention", "sliding_attention"])),
    # Gemma 4 (E2B's form, every feature but MoE): sliding layers 0, 1, 3 (a window of 8, head dim 16, 2 KV heads),
    # full layers 2 and 4 (head dim 32, one KV head, V = K's projection, the proportional rope); layers 3 and 4 attend
    # over layers 1's and 2's caches (KV sharing) with double-wide MLPs; per-layer inputs of 8; capped logits
    "gemma4": ("Gemma4TextConfig", "Gemma4ForCausalLM", dict(
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                     "full_attention"], num_hidden_layers=5, head_dim=16, global_head_dim=32,
        num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=8, num_kv_shared_layers=2,
        use_double_wide_mlp=True, hidden_size_per_layer_input=8, vocab_size_per_layer_input=300,
        final_logit_softcapping=30.0, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}})),
    # gemma-4-26B-A4B's form: no per-layer inputs or sharing, K = V full layer 2 (2 KV heads of 32); in every layer 4
    # GeGLU experts (top 2 of a softmax, renormalised, times per_expert_scale) beside the dense MLP
    "gemma4-moe": ("Gemma4TextConfig", "Gemma4ForCausalLM", dict(
        layer_types=["sliding_attention", "sliding_attention", "full_attention"], head_dim=16, global_head_dim=32,
        num_global_key_value_heads=2, attention_k_eq_v=True, sliding_window=8, hidden_size_per_layer_input=0,
        enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
        final_logit_softcapping=30.0, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}})),
    # Gemma 3n (E2B's form at small size): Gemma 4's sliding / full layers in one head shape (16 x 2 KV heads), layers
    # 3 and 4 over layers 1's and 2's caches; an MLP width per layer, the first two sparse (gaussian top-k); AltUp over
    # 4 streams, Laurel of rank 8, per-layer inputs of 8 from a table shorter than the vocabulary (ids past it: row 0)
    "gemma3n": ("Gemma3nTextConfig", "Gemma3nForCausalLM", dict(
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                     "full_attention"], num_hidden_layers=5, head_dim=16, sliding_window=8, num_kv_shared_layers=2,
        intermediate_size=[96, 64, 128, 96, 64], activation_sparsity_pattern=[0.95, 0.95, 0.0, 0.0, 0.0],
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=280, altup_num_inputs=4, laurel_rank=8,
        final_logit_softcapping=30.0, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1e6}})),
    # gemma3n-dense: the same without sparse MLPs (tensor parallelism: test_engine_architectures.py's TP_ARCHS)
    "gemma3n-dense": ("Gemma3nTextConfig", "Gemma3nForCausalLM", dict(
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], head_dim=16, sliding_window=8,
        num_kv_shared_layers=1, intermediate_size=[96, 64, 128], activation_sparsity_pattern=[0.0] * 3,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=300, altup_num_inputs=3, laurel_rank=8,
        final_logit_softcapping=30.0)),
    # Kimi Linear: Kimi Delta Attention in layers 0 and 2 (4 heads of 16, a convolution of 4, a decay per key channel),
    # DeepSeek-V3's latent attention without a rotary in layers 1 and 3 (4 heads of 16 + 8, v of 16, a latent of 32);
    # layer 0 dense, then 4 experts (top 2 of sigmoid scores plus a correction, renormalised, times 2.446) and a
    # shared one
    "kimi_linear": ("KimiLinearConfig", "KimiLinearForCausalLM", dict(
        num_hidden_layers=4, num_key_value_heads=4, linear_attn_config={
            "head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4, "full_attn_layers": [2, 4],
            "kda_layers": [1, 3]}, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        moe_intermediate_size=32, num_experts=4, num_experts_per_token=2, first_k_dense_replace=1)),
    # Ling 3: Kimi Delta Attention in layers 0 and 2 (4 heads of 16, a convolution of 4, the bounded forget gate),
    # gated MLA with an interleaved rotary (8 of 16 + 8) in layers 1 and 3; layer 0 dense, then 8 experts in 2 groups
    # (top 2 of the best group) and a shared one, their SwiGLU clipped where the layer's limit is not 0 (experts in
    # layers 1 and 3, shared experts in layers 1 and 2); "-unsafe": the softplus forget gate and a q LoRA
    "bailing_hybrid": ("BailingHybridConfig", "BailingHybridForCausalLM", dict(_LING3)),
    "bailing_hybrid-unsafe": ("BailingHybridConfig", "BailingHybridForCausalLM", dict(
        _LING3, kda_safe_gate=False, q_lora_rank=24)),
    # MiniMax-Text-01: Lightning Attention in layers 0, 1 and 3 (4 heads of 16; layer 3, the last, decays by
    # under 1e-5 a token), Mixtral's attention in layer 2; transformers' prefill blocks of 8 (a 40-token prompt: 5);
    # every residual factor off 1; the layers' norms at eps 1e-5 (the output norm's: 1e-6); 4 experts, top 2, in
    # every layer. initializer_range 0.25: each layer's output
    # (no residual stream: the normed input plus the block) feeds the next whole, and at 0.5 transformers' own fp32
    # forms (stepwise, block-wise) sit up to 2e-3 from its float64 forward (here all three within 7e-5 of it)
    "minimax_text": ("MiniMaxConfig", "MiniMaxForCausalLM", dict(
        num_hidden_layers=4, initializer_range=0.25, layer_types=[
            "linear_attention", "linear_attention", "full_attention", "linear_attention"], block_size=8,
        rms_norm_eps=1e-5, num_local_experts=4, num_experts_per_tok=2, full_attn_alpha_factor=1.3,
        full_attn_beta_factor=0.8, linear_attn_alpha_factor=0.7, linear_attn_beta_factor=1.2, mlp_alpha_factor=1.1,
        mlp_beta_factor=0.9)),
    # Falcon-H1: attention (head dim 24, not hidden / heads) and Mamba-2 (d_ssm 96: 6 heads of 16, 2 groups) in
    # every layer, every muP multiplier off 1, every bias on, the gated norm before the gate; falcon_h1-nonorm: the
    # 0.5B's form (no gated norm: y * silu(z))
    "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM", dict(_FALCON_H1, mamba_rms_norm=True,
                                                                mamba_norm_before_gate=True)),
    "falcon_h1-nonorm": ("FalconH1Config", "FalconH1ForCausalLM", dict(_FALCON_H1, mamba_rms_norm=False,
                                                                       mamba_norm_before_gate=False)),
    # OLMo Hybrid: Gated DeltaNet (2 key heads of 8, 4 value heads of 16, beta up to 2) in layers 0 and 2, OLMo 2's
    # attention without a rotary in layer 1 (the released form); olmo_hybrid-rope: the whole head rotating in fp32
    "olmo_hybrid": ("OlmoHybridConfig", "OlmoHybridForCausalLM", dict(
        _OLMO_HYBRID, rope_parameters={"rope_type": "default", "rope_theta": None})),
    "olmo_hybrid-rope": ("OlmoHybridConfig", "OlmoHybridForCausalLM", dict(
        _OLMO_HYBRID, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # Jamba: Mamba-1 (d_inner 128, 8 states, dt rank 4, biased convolution) in layers 0 and 2, attention without a
    # positional encoding in layer 1; 4 experts (top 2 of a softmax, unnormalised) in layer 1
    "jamba": ("JambaConfig", "JambaForCausalLM", dict(
        attn_layer_period=3, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, num_experts=4,
        num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4,
        mamba_conv_bias=True, mamba_proj_bias=False, use_mamba_kernels=False)),
    # attention-free: Mamba (Mamba-1: inner 128, 8 states, dt rank 4), FalconMamba (the same with weightless dt / B / C
    # norms), Mamba-2 (8 heads of 16, 2 groups), every layer a mixer
    "mamba": ("MambaConfig", "MambaForCausalLM", dict(
        state_size=8, conv_kernel=4, expand=2, intermediate_size=128, time_step_rank=4, use_conv_bias=True)),
    "falcon_mamba": ("FalconMambaConfig", "FalconMambaForCausalLM", dict(
        state_size=8, conv_kernel=4, expand=2, intermediate_size=128, time_step_rank=4, use_conv_bias=True,
        mixer_rms_eps=1e-5)),
    "mamba2": ("Mamba2Config", "Mamba2ForCausalLM", dict(
        num_heads=8, head_dim=16, n_groups=2, state_size=16, conv_kernel=4, expand=2, chunk_size=8)),
    # Bamba: Llama's layers, Mamba-2 (8 heads of 16, 2 groups, biased convolution) in layers 0 and 2, attention
    # rotating half of each head in layer 1
    "bamba": ("BambaConfig", "BambaForCausalLM", dict(
        attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16,
        mamba_d_conv=4, mamba_chunk_size=8, mamba_conv_bias=True, rms_norm_eps=1e-5)),
    # Zamba2 (Zamba2-1.2B's form): Mamba-2 (8 heads of 16, 2 groups) in every layer, layers 1, 3 and 4 hybrid: two
    # shared blocks round-robin (block 0 at hybrid 0 and 2, each with its own KV cache and adapters), q / k / v and
    # gate | up adapters of rank 8, the rotary, every add_bias_linear bias; zamba2-plain (Zamba2-2.7B's form): one
    # block for both hybrid layers, no attention adapters, no rotary, 2 KV heads, no biases. initializer_range 0.1:
    # the blocks' outputs enter the stream unnormed (through `linear`), and at 0.5 they reach ~5e3, where
    # transformers' own fp32 forward sits up to 1e-2 from its float64 one (here within 2e-6)
    "zamba2": ("Zamba2Config", "Zamba2ForCausalLM", dict(
        num_hidden_layers=6, layers_block_type=["mamba", "hybrid", "mamba", "hybrid", "hybrid", "mamba"],
        num_mem_blocks=2, num_key_value_heads=4, use_shared_attention_adapter=True, adapter_rank=8, use_mem_rope=True,
        add_bias_linear=True, n_mamba_heads=8, mamba_ngroups=2, mamba_d_state=16, mamba_d_conv=4, chunk_size=8,
        initializer_range=0.1)),
    # zamba2-untied: untied embeddings, where transformers leaves every hybrid layer its own copy of the block
    "zamba2-untied": ("Zamba2Config", "Zamba2ForCausalLM", dict(
        num_hidden_layers=5, layers_block_type=["hybrid", "mamba", "hybrid", "hybrid", "mamba"], num_mem_blocks=2,
        num_key_value_heads=4, use_shared_attention_adapter=True, adapter_rank=8, use_mem_rope=True,
        n_mamba_heads=8, mamba_ngroups=2, mamba_d_state=16, mamba_d_conv=4, chunk_size=8, initializer_range=0.1,
        tie_word_embeddings=False)),
    "zamba2-plain": ("Zamba2Config", "Zamba2ForCausalLM", dict(
        num_hidden_layers=4, layers_block_type=["mamba", "hybrid", "mamba", "hybrid"], num_mem_blocks=1,
        use_shared_attention_adapter=False, adapter_rank=8, use_mem_rope=False, add_bias_linear=False,
        n_mamba_heads=8, mamba_ngroups=1, mamba_d_state=16, mamba_d_conv=4, chunk_size=8, initializer_range=0.1)),
    # LFM2: gated short convolutions (width 3, with biases) in layers 0 and 2, attention with q/k norms in layer 1; the
    # feed-forward's width adjusted (96 -> 64 -> x 1.3 = 83 -> a multiple of 32: 96), the final norm its
    # `embedding_norm`, tied embeddings
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", dict(
        layer_types=["conv", "full_attention", "conv"], conv_L_cache=3, conv_bias=True, norm_eps=1e-5,
        block_multiple_of=32, block_ffn_dim_multiplier=1.3, block_auto_adjust_ff_dim=True)),
    # LFM2-MoE (LFM2-8B-A1B's form): the same operators, layer 0 dense, then 8 experts on sigmoid scores plus an
    # fp32 expert bias (set in _hf), top 2, renormalised, scaled by 1.5
    "lfm2_moe": ("Lfm2MoeConfig", "Lfm2MoeForCausalLM", dict(
        layer_types=["conv", "full_attention", "conv"], conv_L_cache=3, norm_eps=1e-5, num_dense_layers=1,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, routed_scaling_factor=1.5,
        use_expert_bias=True, norm_topk_prob=True)),
    # Nemotron 3 Nano's form: Mamba-2, MoE, attention, MoE: 8 ungated ReLU² experts chosen in 2 groups on corrected
    # sigmoid scores (set in _hf), top 2, scaled by 2.5, a shared ReLU² expert of 48; nemotron_h-latent: the experts
    # in 24 dims between the latent projections (Nemotron 3 Super's form)
    "nemotron_h-moe": ("NemotronHConfig", "NemotronHForCausalLM", dict(
        hybrid_override_pattern="ME*E", head_dim=16, mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16,
        n_groups=2, conv_kernel=4, chunk_size=8, layer_norm_epsilon=1e-5, n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, routed_scaling_factor=2.5, n_group=2,
        topk_group=1, norm_topk_prob=True)),
    "nemotron_h-latent": ("NemotronHConfig", "NemotronHForCausalLM", dict(
        hybrid_override_pattern="ME*E", head_dim=16, mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16,
        n_groups=2, conv_kernel=4, chunk_size=8, layer_norm_epsilon=1e-5, n_routed_experts=8, num_experts_per_tok=3,
        moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, moe_latent_size=24,
        routed_scaling_factor=1.5, norm_topk_prob=True)),
}
