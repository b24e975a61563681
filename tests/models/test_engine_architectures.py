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
from helpers.engine_archs import ARCHS, ENGINE, MISSING, RECURRENT_ARCHS, _hf
from helpers.hf_reference import (
    gemma3n_reference_problem,
    gpt_oss_reference_problem,
    mamba2_reference_problem,
    minimax_m2_reference_problem,
    teacher_forced,
    teacher_forced_stepwise,
)
from helpers.localize_fault import assert_localize_finds_layer_1_attention
from helpers.tolerances import LOGPROB_TOL

from replayllm import LLM, SamplingParams


def skip_without_a_reference(arch: str) -> None:
    """Skip (saying why) a comparison with transformers whose installed release computes another model."""
    mamba2 = dict.fromkeys(("granitemoehybrid-mamba", "granitemoehybrid-mamba-moe", "nemotron_h", "nemotron_h-moe",
                            "nemotron_h-latent", "bamba", "falcon_h1", "falcon_h1-nonorm", "mamba2", "zamba2",
                            "zamba2-plain"), mamba2_reference_problem)
    problem = {"gpt_oss": gpt_oss_reference_problem, "minimax_m2": minimax_m2_reference_problem,
               "gemma3n": gemma3n_reference_problem, **mamba2}.get(
        arch, lambda: None)()
    if problem:
        pytest.skip(problem)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in (4, 17, 40)]


def _outputs(llm: LLM, params: SamplingParams) -> list:
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [{t: (lp.logprob, lp.rank) for t, lp in d.items()} for d in o.outputs[0].logprobs])
            for o in outs]


class _Checkpoints(dict):
    """arch -> (checkpoint directory, the transformers model saved there); an architecture the installed
    transformers lacks (engine_archs.MISSING) skips the test asking for it, printing why."""

    def __missing__(self, arch: str):
        if arch in MISSING:
            pytest.skip(MISSING[arch])
        raise KeyError(arch)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    out = _Checkpoints()
    for arch in ARCHS:
        hf = _hf(arch)
        path = str(tmp_path_factory.mktemp(arch))
        hf.save_pretrained(path)
        out[arch] = (path, hf)
    return out


@pytest.fixture(params=[*ARCHS, *MISSING])
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
            lp, tokens = (teacher_forced_stepwise if arch in RECURRENT_ARCHS else teacher_forced)(
                hf, prompt, comp.token_ids)
            engine = torch.tensor([d[t].logprob for t, d in zip(comp.token_ids, comp.logprobs)])
            assert (engine - lp[torch.arange(len(tokens)), tokens]).abs().max().item() <= LOGPROB_TOL


def _given(value) -> bool:
    """A kernel's flag argument as a bool: True, or a tensor (a residual), counts as given."""
    return value is not None and value is not False


# One architecture per variant of the fused kernels (the interpreter is slow: ~10 s each on CI's cores); the kernels'
# own tests (tests/kernels/test_partial_rotary.py, test_rope_kv_write.py, ...) cover the variants' arithmetic.
@pytest.mark.parametrize("arch", ["glm4", "phi", "cohere", "gemma3", "deepseek_v3", "olmo", "llama4", "hunyuan_dense",
                                  "qwen3_5", "granitemoehybrid-mamba", "minimax_text", "bailing_hybrid"])
def test_the_fused_kernels_in_the_engine_match_transformers(checkpoints, arch, monkeypatch):
    """The engine's fused path forced on the CPU (Triton interpreter): the q/k rope + KV-write kernel with an
    interleaved half rotary (GLM-4), a 6-of-16 neox rotary (Phi-2: an odd number of pairs), Cohere's interleaved
    whole-head rotary in fp32 and DeepSeek-V3's interleaved 8 of 24 with every q head its own KV head;
    Gemma 3's (1 + weight) RMSNorm and GeGLU kernels and its (1 + weight) per-head q/k norms inside the rope
    kernel; Llama 4's L2 q/k norms after its interleaved fp32 rope (a second launch of that kernel, the identity
    rotation with the norms, writing the cache); the LayerNorm kernel with weight and bias (Phi-2) and
    parameter-free with the residual add fused (OLMo); Qwen3.5's gated delta rule (kernels/gated_delta.py) in its
    linear-attention layers and Granite 4.0-H's Mamba-2 state update (kernels/mamba_ssm.py), MiniMax's Lightning
    Attention on that update; greedy, against transformers.
    On CUDA, test_engine_logprobs_match_transformers runs that path compiled (bench/gpu_check.sh)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the fused path on the CPU runs the Triton interpreter (TRITON_INTERPRET=1); on CUDA "
                    "test_engine_logprobs_match_transformers runs it compiled")
    skip_without_a_reference(arch)
    from replayllm.kernels import dispatch
    from replayllm.model_runner_v2.models import layers

    monkeypatch.setattr(dispatch, "INTERPRET_ON_CPU", True)
    flags = set()  # (kernel, unit_offset / gelu_tanh / a residual given) of each launch
    for name, flag in (("rms_norm_triton", "unit_offset"), ("silu_and_mul_triton", "gelu_tanh"),
                       ("layer_norm_triton", "residual"), ("qk_norm_rope_triton", "norm_unit_offset")):
        fn = getattr(layers, name)
        monkeypatch.setattr(layers, name, lambda *a, _fn=fn, _n=name, _f=flag, **k: flags.add(
            (_n, _given(inspect.signature(_fn).bind(*a, **k).arguments.get(_f)))) or _fn(*a, **k))
    from replayllm.model_runner_v2.models import gated_deltanet, mamba2, minimax

    for module, name in ((gated_deltanet, "delta_rule_triton"), (mamba2, "ssm_update_triton"),
                         (minimax, "ssm_update_triton")):
        rule = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _rule=rule, _n=name, **k: flags.add((_n, True)) or _rule(*a, **k))
    path, hf = checkpoints[arch]
    llm = LLM(path, **{**ENGINE, "device": "cpu", "attention_backend": "torch"})
    prompts = _prompts()[:2]  # 4 and 17 tokens (Gemma 3's window is 8): the interpreter's time goes with the tokens
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=5, logprobs=0, ignore_eos=True), use_tqdm=False)
    if arch.startswith("gemma"):
        # the q/k norms inside the rope kernel (its (1 + weight) order), not rms_norm launches of their own
        expected = {("rms_norm_triton", True), ("silu_and_mul_triton", True), ("qk_norm_rope_triton", True)}
        assert flags == expected, flags
    if arch in ("phi", "olmo"):  # phi: parallel blocks, no add before a norm; olmo: the add fused into the norm
        assert ("layer_norm_triton", arch == "olmo") in flags, flags
    assert (("delta_rule_triton", True) in flags) == arch.startswith("qwen3"), flags
    assert (("ssm_update_triton", True) in flags) == arch.startswith(("granitemoehybrid-mamba", "minimax")), flags
    for prompt, out in zip(prompts, outs):
        comp = out.outputs[0]
        lp, tokens = (teacher_forced_stepwise if arch in RECURRENT_ARCHS else teacher_forced)(
            hf, prompt, comp.token_ids)
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


@pytest.mark.parametrize("arch", ["olmo2", "gpt_neox", "cohere", "gemma3", "gpt_oss", "deepseek_v2", "gpt2", "falcon",
                                  "gemma4", "axk2", "bailing_hybrid", "dots3_note"])
def test_localize_names_a_fault_planted_in_an_attention_block(checkpoints, tmp_path, arch):
    """Engine against transformers on weights with layer 1's attention output projection perturbed: the first jump
    is layer 1's attention. OLMo2's and Gemma 3's reach the residual stream through a norm after the attention,
    Cohere's in a parallel layer beside the MLP, A.X-K2's behind a gated norm and gated per head, Ling 3's after a
    Kimi Delta Attention layer (under `self_attn`: in the rebuilt stream);
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


@pytest.mark.parametrize("arch", ["beam", "hrm_text", "minimax_text", "hy_v4", "inkling"])
def test_localize_refuses_a_stream_it_cannot_rebuild(checkpoints, arch):
    """Beam's depth-scaled stream, HRM-Text's layers run again and again, MiniMax's normed residuals with their
    factors, HY-V4's hyper-connection streams, Inkling's convolved block outputs: a clear error, not a wrong answer."""
    path, _ = checkpoints[arch]
    with pytest.raises(ValueError, match="--localize does not support"):
        assert_localize_finds_layer_1_attention(path, path)


@pytest.mark.parametrize("arch", ["falcon_h1", "qwen3_5", "lfm2", "lara_mini", "zamba2", "qwen4_exp"])
def test_localize_refuses_a_hybrid_model_by_name(checkpoints, arch):
    """A linear-attention layer's output is not in the rebuilt residual stream: a clear error, not a wrong answer."""
    skip_without_a_reference(arch)
    path, _ = checkpoints[arch]
    with pytest.raises(ValueError, match="--localize does not support .* linear-attention block"):
        assert_localize_finds_layer_1_attention(path, path)


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
    "axk2",  # each head's q | output-gate rows of q_gate_proj on its rank, the gated norms replicated
    "gpt2",  # Conv1D weights and the fused c_attn split at load
    "bloom",  # ALiBi: each rank its own heads' slopes
    "llama4",  # chunked attention, L2 q/k norms per local head, input-scaled experts plus a shared one
    "granitemoehybrid-moe",  # the shared MLP's stacked gate | up rows split per rank, NoPE
    "hunyuan_moe",  # q/k norms after the rope on each rank's heads, an fp32 router replicated
    "granitemoe_swa",  # sinks split with their heads, a rope base per layer, the shared MLP split per rank
    "phimoe",  # LayerNorms with biases, SparseMixer on the replicated router, a biased LM head
    "ernie4_5_moe",  # biased shared experts, the fp32 router and its correction replicated
    "qwen3_next",  # Gated DeltaNet: each rank a key head and its two value heads, their state rows; gated attention
    "granitemoehybrid-mamba-moe",  # Mamba-2: each rank 4 heads and one group of B / C, biased in / out projections
    "lfm2_moe",  # LFM2's short convolution: each rank half of B, C, x and the convolution's channels
    "bamba",  # Mamba-2 in Llama's layers, half of each attention head rotating
    "nemotron_h-latent",  # ungated ReLU² experts split by width, the latent projections replicated
    "falcon_h1",  # attention and Mamba-2 in every layer: each rank 3 Mamba heads, one group, its muP factors' share
    "olmo_hybrid",  # Gated DeltaNet beside OLMo 2's attention: each rank one key head with its two value heads
    "gemma4-moe",  # each rank a KV head of each layer's own shape, half of every expert; the router whole
    "afmoe",  # the output gate's projection split with its heads, sandwich norms, NoPE full layers
    "minicpm5_moe",  # each head's [q | gate] rows on its rank
    "gemma3n-dense",  # AltUp, Laurel and the per-layer inputs whole on every rank, an MLP width per layer split
    "longcat_flash",  # two MLA sub-layers a block, zero experts' identity added once after the ranks' sum
    "laguna",  # q heads per layer split per rank with their softplus gates, the scaled experts plus a shared one
    "jetmoe",  # attention experts' q rows and o columns split by KV head, their bias added once after the sum
    "kimi_linear",  # Kimi Delta Attention: each rank whole heads, their decay channels, conv channels and state rows
    "hrm_text",  # gated heads split per rank, every KV slot of a shared layer on each rank
    "beam",  # the attention gate's per-head bias split with its heads, the depth-scaled residual on every rank
    "lara_mini",  # the hub's fused DeltaNet in_proj cut into its six parts per rank; sliding and NoPE full layers
    "dots3_note",  # per-layer head counts (4 indexed, 2 sliding) split per rank with their g_proj gate rows
    "bailing_hybrid",  # KDA's one-projection gates and MLA's head gate split with their heads, clipped experts
    "hy_v4",  # hyper-connection streams whole on every rank (replicated fp32 mixing), gate rows and sinks per head
    "qwen4_exp",  # Qwen3.5-MoE's split DeltaNet and gated heads under gated residuals whole on every rank
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
@pytest.mark.parametrize("arch", ["gpt_oss", "deepseek_v2", "deepseek_v3", "ernie4_5", "ministral3", "glm4_moe",
                                  "glm4_moe_lite", "minimax_m2", "mistral4", "llama4", "qwen3_next", "qwen3_5",
                                  "granitemoehybrid-mamba-moe", "nemotron_h", "lfm2", "lfm2_moe",
                                  "bamba", "nemotron_h-moe", "nemotron_h-latent", "gemma4", "falcon_h1",
                                  "falcon_h1-nonorm", "olmo_hybrid", "olmo_hybrid-rope", "jamba", "mamba",
                                  "falcon_mamba", "mamba2", "lfm3", "youtu", "minicpm3", "minicpm5_moe", "mellum",
                                  "cohere2_moe", "afmoe", "deepseek_v32", "codegen", "dbrx",
                                  "persimmon", "axk1", "axk2", "dots3_note", "flint", "kolibri1", "xglm",
                                  "apertus1p5",
                                  "gemma3n", "mimo_v2_flash", "sarvam_moe", "sarvam_mla",
                                  "longcat_flash", "laguna", "jetmoe", "kimi_linear", "openai_gpt", "beam", "hrm_text",
                                  "lara_mini", "zamba2", "zamba2-plain", "minimax_text", "hy_v4", "qwen4_exp",
                                  "bailing_hybrid", "bailing_hybrid-unsafe", "inkling"])
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
