"""Piecewise CUDA graphs (`model_runner_v2/piecewise_graph.py`) without a GPU: the padded token counts, the config
switches, and the static-buffer path with attention handed over between pieces, run eagerly (`replay=False`) —
the exact inputs a replay would see, so staging, padding, the hand-over and the sink block are checked here.
Real capture and replay on the H200: tests/model_runner/test_cuda_graph.py."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from helpers.hf_reference import VOCAB
from helpers.tolerances import LOGPROB_TOL
from helpers.trace_replay_common import tokens_and_logprobs as _run

from replayllm import LLM, SamplingParams
from replayllm.config import EngineConfig
from replayllm.model_runner_v2.kv_cache import activation_reserve_bytes, piecewise_graph_bytes
from replayllm.model_runner_v2.piecewise_graph import PiecewiseGraphRunner, piecewise_sizes


def test_piecewise_sizes():
    assert piecewise_sizes(1) == [1]
    assert piecewise_sizes(8) == [8]
    assert piecewise_sizes(100) == [8, 16, 32, 64, 100]
    sizes = piecewise_sizes(8192)
    assert sizes[:6] == [8, 16, 32, 64, 128, 256] and sizes[-1] == 8192 and sizes == sorted(set(sizes))
    assert {384, 1024, 1280, 2048, 2560, 4096, 5120, 7168} <= set(sizes) and 4608 not in sizes
    # Padding above 512 tokens stays within a quarter of the step.
    i = sizes.index(512)
    assert all(b <= 1.25 * a for a, b in zip(sizes[i:], sizes[i + 1 :]))
    assert piecewise_sizes(3000)[-3:] == [2048, 2560, 3000]


def test_config_switches(tiny_models):
    cfg = EngineConfig(tiny_models["qwen3"], max_num_batched_tokens=512)
    assert cfg.cudagraph_mode == "FULL_AND_PIECEWISE" and cfg.max_piecewise_capture_size == 512
    assert EngineConfig(tiny_models["qwen3"]).max_piecewise_capture_size == 8192
    assert EngineConfig(tiny_models["qwen3"], max_num_batched_tokens=20000).max_piecewise_capture_size == 8192
    # CPU: no graphs of either kind, and no memory reserved for them.
    assert not cfg.use_full_cuda_graphs and not cfg.use_piecewise_cuda_graphs and piecewise_graph_bytes(cfg) == 0
    with pytest.raises(ValueError, match="cudagraph_mode"):
        EngineConfig(tiny_models["qwen3"], cudagraph_mode="FULL")
    with pytest.raises(ValueError, match="max_piecewise_capture_size"):
        EngineConfig(tiny_models["qwen3"], max_piecewise_capture_size=0)
    llm = LLM(tiny_models["qwen3"], skip_tokenizer_init=True, max_model_len=64)
    assert llm.llm_engine.runner.piecewise is None


def test_piecewise_graph_bytes_follow_the_mode(tiny_models, monkeypatch):
    """On CUDA the KV cache leaves room for the pool: the bound grows with max_piecewise_capture_size and is 0
    when the mode has no piecewise graphs (the properties are what decides; CPU stands in for CUDA here)."""
    monkeypatch.setattr(EngineConfig, "use_cuda_graphs", property(lambda self: True))
    small = EngineConfig(tiny_models["qwen3"], max_piecewise_capture_size=256)
    big = EngineConfig(tiny_models["qwen3"], max_piecewise_capture_size=4096)
    assert 0 < piecewise_graph_bytes(small) < piecewise_graph_bytes(big)
    assert activation_reserve_bytes(big) - activation_reserve_bytes(small) == (piecewise_graph_bytes(big)
                                                                             - piecewise_graph_bytes(small))
    off = EngineConfig(tiny_models["qwen3"], cudagraph_mode="FULL_DECODE_ONLY")
    assert off.use_full_cuda_graphs and not off.use_piecewise_cuda_graphs and piecewise_graph_bytes(off) == 0
    only = EngineConfig(tiny_models["qwen3"], cudagraph_mode="PIECEWISE")
    assert only.use_piecewise_cuda_graphs and not only.use_full_cuda_graphs
    assert not EngineConfig(tiny_models["qwen3"], cudagraph_mode="NONE").use_piecewise_cuda_graphs


def _prompt_lps(llm, prompts, params) -> list[np.ndarray]:
    """The prompt logprobs of the requests that asked for them (each prompt token's own, the first has none)."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [np.array([d[t].logprob for t, d in zip(p[1:], o.prompt_logprobs[1:])])
            for p, o, sp in zip(prompts, outs, params) if sp.prompt_logprobs]


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_static_path_with_attention_handed_over_matches_eager(tiny_models, arch):
    """Ragged prompts in chunked prefill mixed with decodes, fast-replay chunks and plain decode steps, most of
    them padded (token counts between the sizes), some too big for the largest size (eager): the piecewise path
    gives the eager tokens and logprobs, and padded tokens wrote their K/V only into the sink block."""
    llm = LLM(tiny_models[arch], skip_tokenizer_init=True, dtype="float32", max_model_len=160, max_num_seqs=8,
              enable_trace_replay=True, block_size=8, max_num_batched_tokens=72, max_piecewise_capture_size=64,
              trace_replay_chunk_size=6, enable_prefix_caching=False)
    runner = llm.llm_engine.runner
    rng = random.Random(2)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (3, 9, 17, 30, 5, 12, 40, 70)]
    params = []
    for i in range(len(prompts)):
        if i % 3 == 2:
            params.append(SamplingParams(trace_decode_token_ids=[rng.randrange(VOCAB) for _ in range(5 + 3 * i)],
                                         logprobs=2))
        else:  # two of them also score their prompt: prompt logprobs read the piecewise hidden states
            params.append(SamplingParams(temperature=0, max_tokens=3 + 2 * i, logprobs=2, ignore_eos=True,
                                         prompt_logprobs=2 if i in (1, 6) else None))
    eager_tokens, eager_lps = _run(llm, prompts, params)
    eager_plps = _prompt_lps(llm, prompts, params)

    pieces = PiecewiseGraphRunner(runner.model, runner.kv_caches, llm.llm_engine.config,
                                  sink_block=runner.num_blocks, replay=False)
    assert pieces.sizes == [8, 16, 32, 64]
    runner.piecewise = pieces
    sink = [kv[:, runner.num_blocks].clone() for kv in runner.kv_caches]
    piece_tokens, piece_lps = _run(llm, prompts, params)
    piece_plps = _prompt_lps(llm, prompts, params)

    assert pieces.num_replays > 0 and pieces.hidden is not None
    assert piece_tokens == eager_tokens
    for p, traced in zip(params, piece_tokens):
        if p.trace_decode_token_ids is not None:
            assert traced == p.trace_decode_token_ids
    diff = max(abs(a - b) for x, y in zip(piece_lps, eager_lps) for a, b in zip(x, y))
    assert diff <= LOGPROB_TOL, diff  # padded GEMMs may block their sums differently (see test_cuda_graph.py)
    assert len(piece_plps) == len(eager_plps) == 2
    np.testing.assert_allclose(np.concatenate(piece_plps), np.concatenate(eager_plps), atol=LOGPROB_TOL, rtol=0)
    # Padded tokens wrote their K/V into the sink block (and, by the equal outputs, nowhere a request reads).
    assert any(not torch.equal(kv[:, runner.num_blocks], s) for kv, s in zip(runner.kv_caches, sink))


def test_stale_tokens_are_reset_to_the_sink(tiny_models):
    """A smaller step after a bigger one on the same size: tokens past the new step held live slots a step
    ago; they must point at the sink (position 0, id 0) before the forward."""
    llm = LLM(tiny_models["qwen3"], skip_tokenizer_init=True, dtype="float32", max_model_len=64, block_size=8,
              max_num_batched_tokens=32, max_piecewise_capture_size=32)
    runner = llm.llm_engine.runner
    pieces = PiecewiseGraphRunner(runner.model, runner.kv_caches, llm.llm_engine.config,
                                  sink_block=runner.num_blocks, replay=False)
    runner.piecewise = pieces
    llm.generate([{"prompt_token_ids": list(range(1, 30))}], SamplingParams(max_tokens=1), use_tqdm=False)
    assert pieces.num_replays == 1  # 29 prompt tokens, padded to 32
    assert pieces.slot_mapping[29:32].tolist() == [pieces.sink_slot] * 3 == [runner.num_blocks * 8] * 3
    llm.generate([{"prompt_token_ids": list(range(3, 14))}], SamplingParams(max_tokens=1), use_tqdm=False)
    assert pieces.num_replays == 2  # 11 tokens, padded to 16: tokens 11..15 are padding again
    assert pieces.slot_mapping[11:16].tolist() == [pieces.sink_slot] * 5
    assert pieces.input_ids[11:16].tolist() == [0] * 5 and pieces.positions[11:16].tolist() == [0] * 5
    assert pieces.input_ids[:11].tolist() == list(range(3, 14))


def test_fp32_head_keeps_its_fp32_hidden_states(tiny_models):
    """enable_fp32_lm_head on a bf16 model: the final norm's fp32 output lands in an fp32 static buffer (a bf16
    one would round the head's input away); tokens as eager, logprobs within bf16 noise."""
    llm = LLM(tiny_models["qwen3"], skip_tokenizer_init=True, dtype="bfloat16", enable_fp32_lm_head=True,
              max_model_len=96, block_size=8, max_num_batched_tokens=64, max_piecewise_capture_size=64,
              enable_prefix_caching=False)
    runner = llm.llm_engine.runner
    rng = random.Random(4)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (5, 14, 23)]
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=1, ignore_eos=True)
    eager_tokens, eager_lps = _run(llm, prompts, params)
    pieces = PiecewiseGraphRunner(runner.model, runner.kv_caches, llm.llm_engine.config,
                                  sink_block=runner.num_blocks, replay=False)
    runner.piecewise = pieces
    piece_tokens, piece_lps = _run(llm, prompts, params)
    assert pieces.num_replays > 0 and pieces.hidden.dtype == torch.float32
    assert piece_tokens == eager_tokens
    # bf16 layers: padded GEMMs may round an activation to the other bf16 neighbour (2^-8 relative), 2e-2 kept.
    assert max(abs(a - b) for x, y in zip(piece_lps, eager_lps) for a, b in zip(x, y)) <= 2e-2


def test_a_too_small_kv_cache_names_the_piecewise_reserve(tiny_models, monkeypatch):
    """A KV budget from the GPU's free memory that cannot hold one sequence: the error says how much the piecewise
    graphs keep and how to free it (CUDA stood in for: the properties and mem_get_info are patched)."""
    from replayllm.model_runner_v2.kv_cache import determine_num_blocks

    monkeypatch.setattr(EngineConfig, "use_cuda_graphs", property(lambda self: True))
    cfg = EngineConfig(tiny_models["qwen3"], max_model_len=256)
    cfg.torch_device = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (3 << 29, 2 << 30))  # 1.8 GiB usable, 0.5 used
    with pytest.raises(ValueError, match="piecewise CUDA graphs keep .* GiB .*max_piecewise_capture_size"):
        determine_num_blocks(cfg)
    cfg.kv_cache_memory_bytes = 1 << 10  # an explicit budget: the graphs take nothing from it, no hint
    with pytest.raises(ValueError, match="lower max_model_len$"):
        determine_num_blocks(cfg)
