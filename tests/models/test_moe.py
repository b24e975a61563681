"""Qwen3-MoE (issue 30, docs/moe.md), Mixtral, OLMoE and Qwen2-MoE: our model vs transformers' forward, the
engine's logprobs and greedy output vs transformers', load_weights in both HF weight layouts, the config rules, and
routed-experts capture."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from helpers.hf_reference import hf_greedy, teacher_forced
from helpers.tolerances import LOGPROB_TOL, TEST_MODEL_HIDDEN, rounding_tol
from helpers.trace_replay_common import DEVICE
from test_models import _run

from replayllm import LLM, SamplingParams
from replayllm.config import EngineConfig, ModelConfig
from replayllm.model_runner_v2 import loader
from replayllm.model_runner_v2.loader import load_model

CPU = torch.device("cpu")
VOCAB = 300
_COMMON = dict(vocab_size=VOCAB, hidden_size=TEST_MODEL_HIDDEN, intermediate_size=128, moe_intermediate_size=32,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, initializer_range=0.5,
               max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
CONFIGS = {
    # 8 experts, top-2 renormalised, 3 layers: 0 and 2 sparse, 1 dense (mlp_only_layers); untied.
    "norm": dict(num_experts=8, num_experts_per_tok=2, num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=True,
                 tie_word_embeddings=False),
    # 4 experts, top-2 not renormalised, 2 layers: only layer 1 sparse (decoder_sparse_step=2); tied.
    "plain": dict(num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, decoder_sparse_step=2,
                  norm_topk_prob=False, tie_word_embeddings=True),
}

# Mixtral: every layer sparse, 4 experts of width 32 (its intermediate_size), top-2 always renormalised; checkpoints
# name the block block_sparse_moe and the experts' tensors w1 / w3 / w2.
MIXTRAL = dict(vocab_size=VOCAB, hidden_size=TEST_MODEL_HIDDEN, intermediate_size=32, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, initializer_range=0.5,
               max_position_embeddings=256, bos_token_id=1, eos_token_id=2, num_local_experts=4, num_experts_per_tok=2,
               num_hidden_layers=2, tie_word_embeddings=False)
# OLMoE: every layer sparse, 4 experts of width 32, top-2 not renormalised; q/k norms over whole projections and
# q, k, v clamped at +-clip_qkv (2.0 clips some of them at this initializer_range).
OLMOE = dict(MIXTRAL, num_experts=4, norm_topk_prob=False, clip_qkv=2.0)
del OLMOE["num_local_experts"]
# Qwen2-MoE: Qwen3-MoE's layer plan (layer 0 dense here) with q/k/v biases and a shared expert of its own width
# (48, the dense layers' 128, the routed experts' 32) gated per token in every sparse layer.
QWEN2MOE = dict(_COMMON, num_experts=4, num_experts_per_tok=2, num_hidden_layers=3, mlp_only_layers=[0],
                shared_expert_intermediate_size=48, norm_topk_prob=False, tie_word_embeddings=False)
MOE_LAYERS = {"norm": (0, 2), "plain": (1,), "mixtral": (0, 1), "olmoe": (0, 1), "qwen2moe": (1, 2)}
ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "olmoe": "OlmoeForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM"}
NAMES = [*CONFIGS, "mixtral", "olmoe", "qwen2moe"]


def _hf_model(name: str, seed: int = 0):
    torch.manual_seed(seed)
    if name == "mixtral":
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(**MIXTRAL)).to(torch.float32).eval()
    if name == "olmoe":
        return transformers.OlmoeForCausalLM(transformers.OlmoeConfig(**OLMOE)).to(torch.float32).eval()
    if name == "qwen2moe":
        return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(**QWEN2MOE)).to(torch.float32).eval()
    cfg = transformers.Qwen3MoeConfig(**_COMMON, **CONFIGS[name])
    return transformers.Qwen3MoeForCausalLM(cfg).to(torch.float32).eval()


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """name -> (checkpoint directory, the transformers model saved there)."""
    out = {}
    for name in NAMES:
        hf = _hf_model(name)
        path = str(tmp_path_factory.mktemp(f"moe_{name}"))
        hf.save_pretrained(path, safe_serialization=True)
        out[name] = (path, hf)
    return out


def _tol(logits: torch.Tensor, num_layers: int) -> float:
    """Engine vs transformers: fp32 rounding at the logits' scale through num_layers + 1 (the head) chains of
    length-hidden reductions (tolerances.LOGPROB_TOL's derivation, for this model's depth)."""
    return rounding_tol(logits, terms=TEST_MODEL_HIDDEN, steps=num_layers + 1)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _llm(path: str, **kw) -> LLM:
    # REPLAYLLM_TEST_DEVICE=cuda (bench/gpu_check.sh): the same checks with the engine on the GPU (fused experts,
    # CUDA graphs).
    opts = dict(device=DEVICE, dtype="float32", skip_tokenizer_init=True, max_model_len=128, block_size=4,
                enable_trace_replay=True)
    return LLM(path, **{**opts, **kw})


def _hf_routes(hf, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """transformers' top-k experts per sparse layer from its router logits: ([T, moe_layers, k] ids, [T, moe_layers]
    margin between the k-th and the (k+1)-th probability: a near-tie may flip under rounding)."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids]), output_router_logits=True).router_logits  # per sparse layer [T, E]
    k = hf.config.num_experts_per_tok
    probs = torch.stack([lg.float().softmax(-1) for lg in logits], dim=1)  # [T, L_moe, E]
    top = probs.topk(k + 1, dim=-1)
    return top.indices[..., :k].numpy(), (top.values[..., k - 1] - top.values[..., k]).numpy()


# -- the model ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers_prefill_and_decode(moe, name):
    path, hf = moe[name]
    mc = ModelConfig.from_pretrained(path)
    assert mc.architecture == ARCHITECTURES.get(name, "Qwen3MoeForCausalLM") and mc.is_moe
    assert mc.moe_layers == MOE_LAYERS[name]
    model = load_model(mc, CPU)
    ids = _prompt(20, 1)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    tol = _tol(ref, mc.num_layers)
    assert (_run(model, mc, ids, [20]) - ref).abs().max().item() <= tol
    assert (_run(model, mc, ids, [12] + [1] * 8) - ref).abs().max().item() <= tol


def test_missing_or_bad_expert_tensors_are_named(moe):
    path, _ = moe["norm"]
    mc = ModelConfig.from_pretrained(path)
    weights = dict(loader.iterate_weights(loader.safetensors_files(path), torch.float32))
    model = load_model(mc, CPU, load_format="dummy")
    del weights["model.layers.2.mlp.experts.5.up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing 1 tensors.*layers.2.mlp.experts.gate_up_proj"):
        model.load_checkpoint(weights.items())
    with pytest.raises(ValueError, match="expert 8 >= num_experts=8"):
        model.load_checkpoint([("model.layers.0.mlp.experts.8.up_proj.weight", torch.zeros(32, 64))])
    with pytest.raises(ValueError, match="layer 1 .* is dense"):
        model.load_checkpoint([("model.layers.1.mlp.experts.0.up_proj.weight", torch.zeros(32, 64))])


# -- the engine --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_engine_logprobs_and_greedy_match_transformers(moe, name):
    path, hf = moe[name]
    llm = _llm(path)
    prompts = [_prompt(n, seed) for n, seed in ((7, 2), (13, 3), (21, 4))]
    greedy = llm.generate([{"prompt_token_ids": p} for p in prompts],
                          SamplingParams(temperature=0, max_tokens=8, logprobs=1, ignore_eos=True), use_tqdm=False)
    rng = np.random.default_rng(5)
    traces = [rng.integers(3, VOCAB, 10).tolist() for _ in prompts]
    replay = llm.generate([{"prompt_token_ids": p} for p in prompts],
                          [SamplingParams(trace_decode_token_ids=t, logprobs=1) for t in traces], use_tqdm=False)
    for prompt, g, r, trace in zip(prompts, greedy, replay, traces):
        for comp in (g.outputs[0], r.outputs[0]):
            lp, tokens = teacher_forced(hf, prompt, comp.token_ids)
            tol = _tol(lp, hf.config.num_hidden_layers)
            engine = torch.tensor([d[t].logprob for t, d in zip(comp.token_ids, comp.logprobs)])
            assert (engine - lp[torch.arange(len(tokens)), tokens]).abs().max().item() <= tol
        assert r.outputs[0].token_ids == trace
        hf_tokens, margins = hf_greedy(hf, prompt, 8)
        tied = next((i for i, m in enumerate(margins) if m <= 2 * tol), len(margins))  # the first near-tie
        assert g.outputs[0].token_ids[:tied + 1] == hf_tokens[:tied + 1]


def test_load_weights_round_trip_both_layouts(moe, tmp_path):
    path, hf = moe["norm"]
    llm = _llm(path)
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True, skip_reading_prefix_cache=True)
    prompts = [{"prompt_token_ids": _prompt(11, 6)}]

    def run():
        out = llm.generate(prompts, params, use_tqdm=False)[0].outputs[0]
        return out.token_ids, [{t: (lp.logprob, lp.rank) for t, lp in d.items()} for d in out.logprobs]

    before = run()
    other = _hf_model("norm", seed=7)
    assert any(v.dim() == 3 for v in other.state_dict().values())  # transformers 5: experts stacked in memory
    llm.load_weights(other)  # the RL path: a module's state_dict, stacked [E, 2I, H] / [E, H, I]
    after = run()
    assert after != before
    other.save_pretrained(str(tmp_path / "other"), safe_serialization=True)
    assert after == (lambda o: (o.token_ids, [{t: (lp.logprob, lp.rank) for t, lp in d.items()}
                                               for d in o.logprobs]))(
        _llm(str(tmp_path / "other")).generate(prompts, params, use_tqdm=False)[0].outputs[0])
    # Back through the checkpoint's per-expert names (safetensors on disk): the first run's bits again.
    llm.llm_engine.update_weights_from_disk(path)
    assert run() == before
    # One expert's up_proj alone: only its rows of the stacked gate_up_proj change.
    experts = llm.llm_engine.runner.model.model.layers[2].mlp.experts
    stacked = experts.gate_up_proj.view(8, 64, 64).clone()
    new = torch.randn(32, 64)
    llm.load_weights([("model.layers.2.mlp.experts.3.up_proj.weight", new)])
    now = experts.gate_up_proj.view(8, 64, 64)
    assert torch.equal(now[3, 32:], new.to(now.device)) and torch.equal(now[3, :32], stacked[3, :32])
    assert torch.equal(now[:3], stacked[:3]) and torch.equal(now[4:], stacked[4:])


def _greedy_bits(llm: LLM) -> tuple:
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True, skip_reading_prefix_cache=True)
    out = llm.generate([{"prompt_token_ids": _prompt(11, 6)}], params, use_tqdm=False)[0].outputs[0]
    return out.token_ids, [{t: (lp.logprob, lp.rank) for t, lp in d.items()} for d in out.logprobs]


@pytest.mark.parametrize("name", ["mixtral", "olmoe", "qwen2moe"])
def test_weights_from_a_module_equal_its_checkpoint(moe, tmp_path, name):
    """LLM.load_weights(module) (transformers 5's in-memory names: stacked mlp.experts tensors, mlp.gate; Qwen2-MoE's
    separate shared expert and its gate) computes exactly what an engine built from that module's checkpoint
    (Mixtral: block_sparse_moe, w1/w3/w2 per expert) computes."""
    path, _ = moe[name]
    llm = _llm(path)
    before = _greedy_bits(llm)
    other = _hf_model(name, seed=7)
    assert "model.layers.1.mlp.experts.gate_up_proj" in other.state_dict()
    assert llm.load_weights(other) > 0
    after = _greedy_bits(llm)
    assert after != before
    other.save_pretrained(str(tmp_path / "other"))
    assert _greedy_bits(_llm(str(tmp_path / "other"))) == after


def test_mixtral_checkpoint_names_and_window(tmp_path):
    """Mixtral's checkpoints keep its own names (what checkpoint_parts maps); its sliding_window is Mistral's: the
    default max_model_len is the position limit, disable_sliding_window caps it at the window."""
    from safetensors import safe_open

    _hf_model("mixtral").save_pretrained(str(tmp_path / "m"))
    with safe_open(str(tmp_path / "m" / "model.safetensors"), "pt") as f:
        assert "model.layers.1.block_sparse_moe.experts.3.w3.weight" in f.keys()
    transformers.MixtralForCausalLM(transformers.MixtralConfig(**{**MIXTRAL, "sliding_window": 48})).save_pretrained(
        str(tmp_path / "windowed"))
    assert EngineConfig(str(tmp_path / "windowed"), device="cpu").max_model_len == MIXTRAL["max_position_embeddings"]
    assert EngineConfig(str(tmp_path / "windowed"), device="cpu", disable_sliding_window=True).max_model_len == 48


def test_qwen2_moe_missing_shared_part_is_named(moe):
    path, _ = moe["qwen2moe"]
    weights = dict(loader.iterate_weights(loader.safetensors_files(path), torch.float32))
    del weights["model.layers.2.mlp.shared_expert.up_proj.weight"]
    model = load_model(ModelConfig.from_pretrained(path), CPU, load_format="dummy")
    with pytest.raises(ValueError, match=r"missing 1 tensors.*layers.2.mlp.shared_expert.gate_up_proj"):
        model.load_checkpoint(weights.items())


def test_config_rules(moe, tiny_models):
    path, _ = moe["plain"]
    # CUDA graphs resolve as for a dense model: the fused experts have static shapes (test_graph_paths_...).
    assert EngineConfig(path, device="cpu").cudagraph_mode == "FULL_AND_PIECEWISE"
    assert EngineConfig(path, device="cpu", cudagraph_mode="PIECEWISE").cudagraph_mode == "PIECEWISE"
    assert EngineConfig(path, device="cpu", tensor_parallel_size=2).tensor_parallel_size == 2  # test_moe_tp.py
    with pytest.raises(ValueError, match="quantization='int8' is not supported with a mixture-of-experts"):
        EngineConfig(path, device="cpu", quantization="int8")
    with pytest.raises(ValueError, match="enable_return_routed_experts=True needs a mixture-of-experts model"):
        EngineConfig(tiny_models["qwen3"], device="cpu", enable_return_routed_experts=True)


# -- routed experts ----------------------------------------------------------------------------------------------
def _routes(llm, prompt, params) -> tuple[list[int], np.ndarray, int]:
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    return out.outputs[0].token_ids, out.outputs[0].routed_experts, out.num_cached_tokens


@pytest.mark.parametrize("name", NAMES)
def test_routed_experts_equal_transformers_top_k(moe, name):
    path, hf = moe[name]
    llm = _llm(path, enable_return_routed_experts=True)
    prompt = _prompt(14, 8)
    tokens, routes, _ = _routes(llm, prompt, SamplingParams(temperature=1.0, seed=3, max_tokens=9, ignore_eos=True))
    mc = llm.llm_engine.model_config
    assert routes.dtype == np.int16 and routes.shape == (len(prompt) + len(tokens) - 1, mc.num_layers, 2)
    dense = [i for i in range(mc.num_layers) if i not in mc.moe_layers]
    assert (routes[:, dense] == -1).all()
    hf_ids, margins = _hf_routes(hf, prompt + tokens[:-1])
    mine = np.sort(routes[:, list(mc.moe_layers)], axis=-1)
    clear = margins > 1e-4  # positions whose k-th expert is not within rounding of the next one
    assert clear.mean() > 0.9  # most of them (Qwen2-MoE's 4 experts: 93%), so the comparison means something
    assert (mine == np.sort(hf_ids, axis=-1))[clear].all()
    # The engine's order is the top-k's (most probable first), as transformers' topk.
    assert (routes[:, list(mc.moe_layers)] == hf_ids)[clear].all()
    off = _llm(path).generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=2), use_tqdm=False)
    assert off[0].outputs[0].routed_experts is None


def test_routes_survive_prefix_cache_chunking_and_fast_replay(moe):
    path, _ = moe["norm"]
    prompt, trace = _prompt(23, 9), _prompt(12, 10)
    # A trace skips the prefix cache unless told otherwise (docs/trace_replay.md); here it may read it.
    one = SamplingParams(trace_decode_token_ids=trace, trace_replay_chunk_size=1, skip_reading_prefix_cache=False)
    llm = _llm(path, enable_return_routed_experts=True)
    tokens, ref, cached = _routes(llm, prompt, one)
    assert tokens == trace and cached == 0
    # A prefix-cache hit: the cached blocks' routes were written by the first run.
    tokens, hit, cached = _routes(llm, prompt, one)
    assert cached > 0 and np.array_equal(hit, ref)
    # Fast replay (8 trace tokens a step) and a prefill chunked over 5-token steps, on a fresh engine.
    fast = SamplingParams(trace_decode_token_ids=trace, trace_replay_chunk_size=8)
    chunked = _llm(path, enable_return_routed_experts=True, max_num_batched_tokens=5, enable_prefix_caching=False)
    assert np.array_equal(_routes(chunked, prompt, fast)[1], ref)
    assert np.array_equal(_routes(chunked, prompt, one)[1], ref)


def test_routes_survive_preemption(moe):
    path, _ = moe["plain"]
    prompts = [_prompt(10, 20 + i) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    single = _llm(path, enable_return_routed_experts=True, enable_prefix_caching=False)
    alone = [_routes(single, p, params)[1] for p in prompts]
    # 4 requests of 30 tokens in 20 blocks of 4: the latest arrivals are preempted and recomputed.
    llm = _llm(path, enable_return_routed_experts=True, num_gpu_blocks_override=20, enable_prefix_caching=False,
               max_model_len=64)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    for prompt, out, ref in zip(prompts, outs, alone):
        comp = out.outputs[0]
        assert comp.routed_experts.shape == (len(prompt) + 19, 2, 2)
        assert (comp.routed_experts[:, 1] >= 0).all() and (comp.routed_experts[:, 0] == -1).all()
        assert np.array_equal(comp.routed_experts, ref)  # the same tokens (greedy), the same routes


def test_sleep_mode_with_a_moe_model(moe):
    """Sleep mode moves the stacked experts like any parameter: level 1 wakes to the same tokens, logprobs and
    routes, exactly (each run computes its whole prompt, alone)."""
    path, _ = moe["norm"]
    llm = _llm(path, enable_sleep_mode=True, enable_return_routed_experts=True)
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=1, ignore_eos=True, skip_reading_prefix_cache=True)

    def run():
        out = llm.generate([{"prompt_token_ids": _prompt(9, 3)}], params, use_tqdm=False)[0].outputs[0]
        return out.token_ids, [d[t].logprob for d, t in zip(out.logprobs, out.token_ids)], out.routed_experts

    before = run()
    llm.sleep(1)
    assert llm.llm_engine.runner.sleep_mode.params.released
    llm.wake_up()
    after = run()
    assert after[:2] == before[:2] and np.array_equal(after[2], before[2])


def test_graph_paths_give_the_eager_tokens_and_routes(moe):
    """Decode steps through the full-graph path and prefill / fast-replay chunks through the piecewise path give
    the eager run's tokens and routes (the graphs write the routes at the step's static slot_mapping; padded rows
    write theirs into the sink block), and a routing-replay step runs eagerly. On CUDA the graphs are captured
    and replayed (fused experts, batch-invariant mode: bitwise equal logprobs); on CPU the same static-buffer
    paths run without capture (replay=False)."""
    from replayllm.model_runner_v2.cuda_graph import CudaGraphRunner
    from replayllm.model_runner_v2.piecewise_graph import PiecewiseGraphRunner

    path, _ = moe["norm"]
    opts = dict(enable_return_routed_experts=True, max_num_seqs=4, max_num_batched_tokens=64,
                max_cudagraph_capture_size=4, max_piecewise_capture_size=32, trace_replay_chunk_size=4,
                enable_prefix_caching=False)
    if DEVICE == "cuda":
        opts.update(batch_invariant=True, attention_backend="triton")
    prompts = [_prompt(n, 30 + n) for n in (5, 11, 19)]
    params = [SamplingParams(temperature=0, max_tokens=6, logprobs=1, ignore_eos=True),
              SamplingParams(trace_decode_token_ids=_prompt(7, 40), logprobs=1),
              SamplingParams(temperature=1.0, seed=5, max_tokens=4, logprobs=1, ignore_eos=True)]

    def run(llm, extra=None):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [(o.outputs[0].token_ids, [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)],
                 o.outputs[0].routed_experts) for o in outs]

    eager = run(_llm(path, enforce_eager=True, **opts))
    llm = _llm(path, **opts)
    runner = llm.llm_engine.runner
    if DEVICE != "cuda":
        cfg, sink = llm.llm_engine.config, runner.num_blocks
        routes = runner.routed_experts.buffer
        runner.graph_runner = CudaGraphRunner(runner.model, runner.kv_caches, cfg, sink, states=runner.req_states,
                                              replay=False, routed_experts=routes)
        runner.piecewise = PiecewiseGraphRunner(runner.model, runner.kv_caches, cfg, sink, replay=False,
                                                routed_experts=routes)
    graphs, pieces = runner.graph_runner, runner.piecewise
    sink_rows = slice(runner.num_blocks * 4, (runner.num_blocks + 1) * 4)
    runner.routed_experts.buffer[sink_rows] = -1
    got = run(llm)
    assert graphs.num_replays > 0 and pieces.num_replays > 0
    for (tok, lps, routes), (ref_tok, ref_lps, ref_routes) in zip(got, eager):
        assert tok == ref_tok and np.array_equal(routes, ref_routes)
        if DEVICE == "cuda":
            assert lps == ref_lps  # batch-invariant mode: graphs and eager give the same bits
        else:
            assert max(abs(a - b) for a, b in zip(lps, ref_lps)) <= LOGPROB_TOL  # padded GEMMs may sum otherwise
    # Padded rows routed into the sink block's slots (real rows never write there).
    assert (runner.routed_experts.buffer[sink_rows][:, list(llm.llm_engine.model_config.moe_layers)] >= 0).any()
    # A routing-replay request (every sparse route shifted to the next expert): its steps run eagerly (no graph
    # has the forced routes) and use the given experts.
    before = (graphs.num_replays, pieces.num_replays)
    shifted = got[0][2].copy()
    sparse = list(llm.llm_engine.model_config.moe_layers)
    shifted[:, sparse] = (shifted[:, sparse] + 1) % 8
    forced = SamplingParams(trace_decode_token_ids=got[0][0], trace_routed_experts=shifted, logprobs=1)
    out = llm.generate([{"prompt_token_ids": prompts[0]}], forced, use_tqdm=False)[0].outputs[0]
    assert (graphs.num_replays, pieces.num_replays) == before
    assert out.token_ids == got[0][0] and np.array_equal(out.routed_experts, shifted)
