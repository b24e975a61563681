"""OLMo 2, Granite, SmolLM3, Llama (with biases), GLM, GLM-4, Phi-4-mini's form of Phi-3, StableLM, GPT-NeoX and
Gemma in the engine (tests/models/test_models.py compares the first four's logits with transformers'; the others'
meet transformers here, and their rope in test_rope_scaling.py): the engine's logprobs against transformers'
teacher-forced forward, in-place weight updates from a transformers module, batch invariance, tensor parallelism;
for OLMo2 and GPT-NeoX also `replayllm diff --localize` naming a planted fault. bench/gpu_check.sh runs this file
with the engine on CUDA (REPLAYLLM_TEST_DEVICE=cuda, transformers on the CPU)."""

from __future__ import annotations

import inspect
import os

import pytest
import torch
import transformers
from helpers.hf_reference import gpt_oss_reference_problem, teacher_forced
from helpers.localize_fault import assert_localize_finds_layer_1_attention
from helpers.tolerances import LOGPROB_TOL
from helpers.trace_replay_common import DEVICE

from replayllm import LLM, SamplingParams

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
    # EXAONE 4 without a window: every layer full, every layer rotating
    "exaone4-full": (transformers.Exaone4Config, transformers.Exaone4ForCausalLM, dict(
        head_dim=16, sliding_window=None, layer_types=["full_attention"] * 3)),
}
# transformers' eager attention is the reference: its SDPA path has no soft cap or sinks (5.17, on the GPU machine,
# took another attention for Gemma 2 by default);
# and its eager experts loop, the model's definition (transformers 5.17's default grouped_mm gave GPT-OSS other
# logprobs than that loop on an H200; 5.25's agrees)
EAGER_ARCHS = ("gemma2", "gpt_oss")
EAGER_EXPERTS = ("gpt_oss", "glm4_moe", "deepseek_v2", "deepseek_v3", "granitemoe")
# their configs have layer_norm_eps (StarCoder2: norm_epsilon; GPT-2: layer_norm_epsilon; OPT: none), no rms_norm_eps
LAYER_NORM_ARCHS = ("gpt2", "gpt_bigcode", "gptj", "falcon", "opt", "stablelm", "stablelm-parallel", "stablelm-qknorm",
                    "gpt_neox", "gpt_neox-sequential", "starcoder2", "phi", "cohere", "cohere-qknorm", "cohere2")
# their configs name the MLP width otherwise (n_inner, ffn_dim, ffn_hidden_size): no intermediate_size, as real ones
OWN_MLP_WIDTH = ("gpt2", "gpt_bigcode", "gptj", "falcon", "opt")
ENGINE = dict(device=DEVICE, dtype="float32", skip_tokenizer_init=True, enable_trace_replay=True, max_model_len=128)


def _hf(arch: str, seed: int = 0):
    config_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(seed)
    small = {k: v for k, v in SMALL.items() if not (k == "rms_norm_eps" and (arch in LAYER_NORM_ARCHS or k in extra))
             and not (k == "num_key_value_heads"
                      and arch.startswith(("gpt_neox", "deepseek", "gpt2", "gpt_bigcode", "gptj", "falcon", "opt")))
             and not (k == "intermediate_size" and arch in OWN_MLP_WIDTH)}
    if arch in EAGER_ARCHS:
        extra = dict(extra, attn_implementation="eager")
    if arch in EAGER_EXPERTS:
        extra = dict(extra, experts_implementation="eager")
    model = model_cls(config_cls(**small, **extra)).to(torch.float32).eval()
    with torch.no_grad():  # transformers starts norms at weight 1, bias 0: no test would see them misapplied
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5) if name.endswith("weight") else param.uniform_(-0.3, 0.3)
            elif name.endswith(".sinks"):  # GPT-OSS's: from a negligible to a dominant share of the softmax
                param.uniform_(-1.0, 3.0)
        for name, buffer in model.named_buffers():  # GLM-4-MoE's router correction (zeros at init): one that picks
            if name.endswith("e_score_correction_bias"):  # (and DeepSeek-V3's)
                buffer.uniform_(-0.3, 0.3)
    return model


def skip_without_a_reference(arch: str) -> None:
    """Skip (saying why) a comparison with transformers whose installed release computes another model."""
    problem = gpt_oss_reference_problem() if arch == "gpt_oss" else None
    if problem:
        pytest.skip(problem)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in (4, 17, 40)]


def _outputs(llm: LLM, params: SamplingParams) -> list:
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [{t: (lp.logprob, lp.rank) for t, lp in d.items()} for d in o.outputs[0].logprobs])
            for o in outs]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    """arch -> (checkpoint directory, the transformers model saved there)."""
    out = {}
    for arch in ARCHS:
        hf = _hf(arch)
        path = str(tmp_path_factory.mktemp(arch))
        hf.save_pretrained(path)
        out[arch] = (path, hf)
    return out


@pytest.fixture(params=list(ARCHS))
def checkpoint(request, checkpoints) -> tuple:
    return (*checkpoints[request.param], request.param)


def test_engine_logprobs_match_transformers(checkpoint):
    """Greedy tokens and trace-replay logprobs against transformers' teacher-forced log_softmax."""
    path, hf, arch = checkpoint
    skip_without_a_reference(arch)
    llm = LLM(path, **ENGINE)
    g = torch.Generator().manual_seed(4)
    traces = [torch.randint(3, 300, (8,), generator=g).tolist() for _ in _prompts()]
    replay = llm.generate([{"prompt_token_ids": p} for p in _prompts()],
                          [SamplingParams(trace_decode_token_ids=t, logprobs=0) for t in traces], use_tqdm=False)
    greedy = llm.generate([{"prompt_token_ids": p} for p in _prompts()],
                          SamplingParams(temperature=0, max_tokens=8, logprobs=0, ignore_eos=True), use_tqdm=False)
    for prompt, r, gr, trace in zip(_prompts(), replay, greedy, traces):
        assert r.outputs[0].token_ids == trace
        for comp in (r.outputs[0], gr.outputs[0]):
            lp, tokens = teacher_forced(hf, prompt, comp.token_ids)
            engine = torch.tensor([d[t].logprob for t, d in zip(comp.token_ids, comp.logprobs)])
            assert (engine - lp[torch.arange(len(tokens)), tokens]).abs().max().item() <= LOGPROB_TOL


def _given(value) -> bool:
    """A kernel's flag argument as a bool: True, or a tensor (a residual), counts as given."""
    return value is not None and value is not False


# One architecture per variant of the fused kernels (the interpreter is slow: ~10 s each on CI's cores); the kernels'
# own tests (tests/kernels/test_partial_rotary.py, test_rope_kv_write.py, ...) cover the variants' arithmetic.
@pytest.mark.parametrize("arch", ["glm4", "phi", "cohere", "gemma3", "deepseek_v3", "olmo"])
def test_the_fused_kernels_in_the_engine_match_transformers(checkpoints, arch, monkeypatch):
    """The engine's fused path forced on the CPU (Triton interpreter): the q/k rope + KV-write kernel with an
    interleaved half rotary (GLM-4), a 6-of-16 neox rotary (Phi-2: an odd number of pairs), Cohere's interleaved
    whole-head rotary in fp32 and DeepSeek-V3's interleaved 8 of 24 with every q head its own KV head;
    Gemma 3's (1 + weight) RMSNorm, per-head q/k norms and GeGLU kernels; the LayerNorm kernel with weight and bias
    (Phi-2) and parameter-free with the residual add fused (OLMo); greedy, against transformers.
    On CUDA, test_engine_logprobs_match_transformers runs that path compiled (bench/gpu_check.sh)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the fused path on the CPU runs the Triton interpreter (TRITON_INTERPRET=1); on CUDA "
                    "test_engine_logprobs_match_transformers runs it compiled")
    from replayllm.kernels import dispatch
    from replayllm.model_runner_v2.models import layers

    monkeypatch.setattr(dispatch, "INTERPRET_ON_CPU", True)
    flags = set()  # (kernel, unit_offset / gelu_tanh / a residual given) of each launch
    for name, flag in (("rms_norm_triton", "unit_offset"), ("silu_and_mul_triton", "gelu_tanh"),
                       ("layer_norm_triton", "residual")):
        fn = getattr(layers, name)
        monkeypatch.setattr(layers, name, lambda *a, _fn=fn, _n=name, _f=flag, **k: flags.add(
            (_n, _given(inspect.signature(_fn).bind(*a, **k).arguments.get(_f)))) or _fn(*a, **k))
    path, hf = checkpoints[arch]
    llm = LLM(path, **{**ENGINE, "device": "cpu", "attention_backend": "torch"})
    prompts = _prompts()[:2]  # 4 and 17 tokens (Gemma 3's window is 8): the interpreter's time goes with the tokens
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=5, logprobs=0, ignore_eos=True), use_tqdm=False)
    if arch.startswith("gemma"):
        assert flags == {("rms_norm_triton", True), ("silu_and_mul_triton", True)}, flags
    if arch in ("phi", "olmo"):  # phi: parallel blocks, no add before a norm; olmo: the add fused into the norm
        assert ("layer_norm_triton", arch == "olmo") in flags, flags
    for prompt, out in zip(prompts, outs):
        comp = out.outputs[0]
        lp, tokens = teacher_forced(hf, prompt, comp.token_ids)
        engine = torch.tensor([d[t].logprob for t, d in zip(comp.token_ids, comp.logprobs)])
        assert (engine - lp[torch.arange(len(tokens)), tokens]).abs().max().item() <= LOGPROB_TOL


def test_load_weights_from_a_module_equals_its_checkpoint(checkpoint, tmp_path):
    path, _, arch = checkpoint
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True, skip_reading_prefix_cache=True)
    llm = LLM(path, **ENGINE)
    before = _outputs(llm, params)
    other = _hf(arch, seed=1)
    assert llm.load_weights(other) > 0
    after = _outputs(llm, params)
    assert after != before
    other.save_pretrained(str(tmp_path / "other"))
    assert after == _outputs(LLM(str(tmp_path / "other"), **ENGINE), params)


def test_batch_invariant_rows_equal_solo_runs(checkpoint):
    path, _, _ = checkpoint
    llm = LLM(path, batch_invariant=True, **ENGINE)
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=6, logprobs=3, ignore_eos=True)
    batch = _outputs(llm, params)
    for i, prompt in enumerate(_prompts()):
        solo = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
        assert (solo.token_ids, [{t: (lp.logprob, lp.rank) for t, lp in d.items()} for d in solo.logprobs]) == batch[i]


@pytest.mark.parametrize("arch", ["olmo2", "gpt_neox", "cohere", "gemma3", "gpt_oss", "deepseek_v2", "gpt2", "falcon"])
def test_localize_names_a_fault_planted_in_an_attention_block(checkpoints, tmp_path, arch):
    """Engine against transformers on weights with layer 1's attention output projection perturbed: the first jump
    is layer 1's attention. OLMo2's and Gemma 3's reach the residual stream through a norm after the attention,
    Cohere's in a parallel layer beside the MLP;
    transformers' GPT-NeoX names its parts apart (gpt_neox, embed_in, attention, embed_out), GPT-2 too (transformer,
    h, attn) and Falcon (self_attention, in a parallel layer), and the recorder finds them."""
    skip_without_a_reference(arch)
    path, _ = checkpoints[arch]
    hf_cls = type(checkpoints[arch][1])
    faulty = hf_cls.from_pretrained(path, dtype=torch.float32)
    param = (faulty.gpt_neox.layers[1].attention.dense.weight if arch == "gpt_neox"
             else faulty.transformer.h[1].attn.c_proj.weight if arch == "gpt2"
             else faulty.transformer.h[1].self_attention.dense.weight if arch == "falcon"
             else faulty.model.layers[1].self_attn.o_proj.weight)
    with torch.no_grad():
        param.add_(torch.randn_like(param) * param.std() * 0.3)
    faulty.save_pretrained(str(tmp_path / "faulty"))
    assert_localize_finds_layer_1_attention(path, str(tmp_path / "faulty"))


# TP=2 spawns a rank process per engine (~3 s each on CI's cores): one architecture per way of sharding a layer.
# The rest share one of these layers' sharding (the same projections, norms and MoE blocks) and differ in what TP
# does not touch (rotary, windows, scalars applied per row).
TP_ARCHS = [
    "olmo2",  # q/k norms over every head: their sums of squares all-reduced
    "granite",  # scalars on every rank, logits scaled after the gather
    "llama",  # biases on every projection: row-parallel o_proj / down_proj add theirs once
    "phi4mini",  # fused qkv_proj and gate_up_proj split at load
    "stablelm-qknorm",  # a LayerNorm per head on q and k, a parallel residual
    "gpt_neox",  # per-head grouped query_key_value
    "gemma",  # one KV head for two ranks (replicated)
    "phi",  # a biased LM head
    "cohere-qknorm",  # tied embeddings, logits scaled, per-head LayerNorms
    "gemma3",  # per-head (1 + weight) q/k norms, sliding layers
    "gpt_oss",  # attention sinks per head, experts with biases
    "glm4_moe",  # shared experts, the grouped router
    "deepseek_v3",  # latent attention (replicated latent, per-head q / kv_b), q LoRA
    "gpt2",  # Conv1D weights and the fused c_attn split at load
]


@pytest.mark.parametrize("arch", TP_ARCHS)
def test_tensor_parallel_2_matches_1(checkpoints, arch):
    """TP=2 on CPU (gloo): OLMo2's q/k norms span every head, so its ranks all-reduce each row's sum of squares
    before scaling their own columns; Granite's scalars apply on every rank (the attention scale, the residual
    multiplier, the logits' scaling on the gathered logits). TP=1's greedy tokens, its logprobs within rounding;
    an update from a transformers module reaches both ranks."""
    path, _ = checkpoints[arch]
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=0, ignore_eos=True, skip_reading_prefix_cache=True)
    opts = {**ENGINE, "device": "cpu"}
    one_llm, two_llm = LLM(path, **opts), LLM(path, tensor_parallel_size=2, **opts)
    try:
        for update in (False, True):
            if update:
                assert one_llm.load_weights(_hf(arch, seed=1)) > 0 and two_llm.load_weights(_hf(arch, seed=1)) > 0
            one, two = _outputs(one_llm, params), _outputs(two_llm, params)
            assert [t for t, _ in two] == [t for t, _ in one]
            for (tokens, lp1), (_, lp2) in zip(one, two):
                assert max(abs(a[t][0] - b[t][0]) for t, a, b in zip(tokens, lp1, lp2)) <= LOGPROB_TOL
    finally:
        two_llm.llm_engine.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the compiled kernels against the CPU engine)")
@pytest.mark.parametrize("arch", ["gpt_oss", "deepseek_v2", "deepseek_v3", "ernie4_5", "ministral3", "glm4_moe"])
def test_the_cuda_engine_scores_what_the_cpu_engine_scores(checkpoints, arch):
    """fp32 trace replay on CUDA (compiled kernels, CUDA graphs) against the CPU engine (torch), which meets
    transformers in test_engine_logprobs_match_transformers: the GPU run's check where the GPU machine's
    transformers is no reference (gpt_oss_reference_problem) and a second one for the others."""
    path, _ = checkpoints[arch]
    g = torch.Generator().manual_seed(4)
    traces = [torch.randint(3, 300, (8,), generator=g).tolist() for _ in _prompts()]
    runs = []
    for device in ("cpu", "cuda"):
        llm = LLM(path, **{**ENGINE, "device": device})
        outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()],
                            [SamplingParams(trace_decode_token_ids=t, logprobs=0) for t in traces], use_tqdm=False)
        runs.append(torch.tensor([[d[t].logprob for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                                  for o in outs]))
        llm.llm_engine.shutdown()
    assert (runs[0] - runs[1]).abs().max().item() <= LOGPROB_TOL
