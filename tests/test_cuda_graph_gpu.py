"""CUDA graphs on the GPU (marker `gpu`; skipped on CPU): graphs (decode whole, every other step piecewise) vs
enforce_eager=True on the tiny fp32 models (ragged prompts, a shrinking batch, traces) and on the
Qwen3-0.6B-shaped dummy model in bf16; the cudagraph_mode values against each other. Numbers
printed, bounds asserted. Every other CUDA test (parity with HF, the trace-replay e2e suite) also runs with
graphs, the default on CUDA."""

from __future__ import annotations

import gc
import random
import time

import pytest
import torch
from hf_reference import VOCAB
from trace_replay_common import tokens_and_logprobs as _run

from replayllm import LLM, SamplingParams

pytestmark = pytest.mark.gpu


def _max_diff(a, b) -> float:
    return max(abs(x - y) for u, v in zip(a, b) for x, y in zip(u, v))


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_tiny_fp32_graphs_match_eager(tiny_models, arch):
    rng = random.Random(0)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (1, 5, 17, 33, 64, 90, 128, 3, 40, 7, 11)]
    params = [SamplingParams(trace_decode_token_ids=[rng.randrange(VOCAB) for _ in range(5 + 3 * i)], logprobs=1)
              if i % 3 == 1 else SamplingParams(temperature=0, max_tokens=4 + 3 * i, logprobs=1, ignore_eos=True)
              for i in range(len(prompts))]
    runs = {}
    for eager in (True, False):
        llm = LLM(tiny_models[arch], device="cuda", dtype="float32", max_model_len=256, skip_tokenizer_init=True,
                  enable_trace_replay=True, enforce_eager=eager, max_num_seqs=16, enable_prefix_caching=False,
                  trace_replay_chunk_size=1)  # one token a step: the replay below must equal the run bit for bit
        runs[eager] = _run(llm, prompts, params)
        graphs = llm.llm_engine.runner.graph_runner
        if eager:
            assert graphs is None
        else:
            assert graphs.sizes == [1, 2, 4, 8, 16] and graphs.num_replays > 0
            pieces = llm.llm_engine.runner.piecewise  # the prefill and mixed steps: piecewise graphs
            assert pieces is not None and pieces.graphs and pieces.num_replays > 0
            # Replaying every row's output as a trace (same schedule: same lengths, same batches, same graphs)
            # gives the logprobs back bit for bit.
            replay = [SamplingParams(trace_decode_token_ids=tokens, logprobs=1) for tokens in runs[False][0]]
            assert _run(llm, prompts, replay) == runs[False]
        del llm
        gc.collect()
    assert runs[True][0] == runs[False][0]
    d = _max_diff(runs[True][1], runs[False][1])
    print(f"\n[cuda graphs] tiny {arch} fp32: graphs vs eager max |dlogprob| {d:.2e}")
    assert d <= 1e-4


def test_dummy_qwen3_0_6b_bf16_graphs_vs_eager():
    from replayllm.entrypoints.bench.workload import write_dummy_config as write_config

    rng = random.Random(0)
    prompts = [[rng.randrange(100, 150_000) for _ in range(rng.randrange(1, 400))] for _ in range(37)]
    params = [SamplingParams(trace_decode_token_ids=[rng.randrange(100, 150_000) for _ in range(48)], logprobs=0)
              for _ in prompts]
    runs, start_s = {}, {}
    for eager in (True, False):
        t = time.perf_counter()
        llm = LLM(write_config(), load_format="dummy", dtype="bfloat16", device="cuda", skip_tokenizer_init=True,
                  max_model_len=1024, enable_trace_replay=True, enforce_eager=eager, max_num_seqs=64)
        start_s[eager] = time.perf_counter() - t
        runs[eager] = _run(llm, prompts, params)
        assert runs[eager][0] == [p.trace_decode_token_ids for p in params]
        if not eager:
            assert llm.llm_engine.runner.piecewise.num_replays > 0
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    d = torch.tensor([abs(x - y) for u, v in zip(runs[True][1], runs[False][1]) for x, y in zip(u, v)])
    print(f"\n[cuda graphs] 0.6B dummy bf16: graphs vs eager mean |dlogprob| {d.mean():.2e}, max {d.max():.2e} "
          f"over {d.numel()} tokens; engine start-up eager {start_s[True]:.1f} s, with capture {start_s[False]:.1f} s")
    assert d.mean() <= 5e-3 and d.max() <= 5e-2


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_cudagraph_modes_agree(tiny_models, arch):
    """FULL_DECODE_ONLY (eager prefill), PIECEWISE (every step piecewise) and FULL_AND_PIECEWISE on the tiny fp32
    models: the same tokens, logprobs within fp32 noise; each mode's runners served the steps it names."""
    rng = random.Random(3)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (2, 7, 19, 40, 77, 130, 9, 300)]
    params = [SamplingParams(trace_decode_token_ids=[rng.randrange(VOCAB) for _ in range(6 + 2 * i)], logprobs=1)
              if i % 2 else SamplingParams(temperature=0, max_tokens=5 + 2 * i, logprobs=1, ignore_eos=True)
              for i in range(len(prompts))]
    runs = {}
    for mode in ("FULL_DECODE_ONLY", "PIECEWISE", "FULL_AND_PIECEWISE"):
        llm = LLM(tiny_models[arch], device="cuda", dtype="float32", max_model_len=512, skip_tokenizer_init=True,
                  enable_trace_replay=True, cudagraph_mode=mode, max_num_seqs=8, max_num_batched_tokens=256,
                  enable_prefix_caching=False, trace_replay_chunk_size=4)
        runs[mode] = _run(llm, prompts, params)
        runner = llm.llm_engine.runner
        assert (runner.graph_runner is not None) == (mode != "PIECEWISE")
        assert (runner.piecewise is not None) == (mode != "FULL_DECODE_ONLY")
        if runner.piecewise is not None:
            assert runner.piecewise.sizes[-1] == 256 and runner.piecewise.num_replays > 0
        del llm
        gc.collect()
    base_tokens, base_lps = runs["FULL_DECODE_ONLY"]
    for mode in ("PIECEWISE", "FULL_AND_PIECEWISE"):
        assert runs[mode][0] == base_tokens, mode
        d = _max_diff(runs[mode][1], base_lps)
        print(f"\n[cuda graphs] tiny {arch} fp32: {mode} vs FULL_DECODE_ONLY max |dlogprob| {d:.2e}")
        assert d <= 1e-4
