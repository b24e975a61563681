"""A step's launches never wait for the device (async scheduling's premise, docs/architecture.md): on CUDA,
`execute_model` and `sample_tokens` of every step after start-up run under torch's sync debug mode "error", so a
host synchronisation inside them (`.item()`, `.cpu()`, `nonzero`, a blocking copy or stream sync) raises where it
happens. Such a sync would make the host wait for step N before it can queue step N + 1, leaving the GPU idle for
the rest of N + 1's launches: the gap inside each step that docs/benchmarks.md measured (session 16: a 4.31 ms span
around 3.7 ms of kernels) and could not yet place. Prompt logprobs are left out: they are copied to the host in
their step by design (model_runner_v2/prompt_logprobs.py)."""

from __future__ import annotations

import random

import pytest
import torch

from replayllm import LLM, SamplingParams

pytestmark = pytest.mark.gpu

WORKLOADS = {
    # W1's path: greedy, EOS ignored (decode graphs, mixed and prefill steps on piecewise graphs)
    "greedy": lambda rng, vocab: SamplingParams(max_tokens=40, ignore_eos=True, temperature=0),
    # serving's sampled path with its logprobs
    "sampled": lambda rng, vocab: SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.8, top_p=0.9,
                                                 top_k=50, seed=rng.randrange(1 << 30), logprobs=3),
    # trace replay one token a step (W2/W3) and in fast-replay chunks
    "trace": lambda rng, vocab: SamplingParams(trace_decode_token_ids=[rng.randrange(vocab) for _ in range(40)],
                                               logprobs=1),
    "fast-replay": lambda rng, vocab: SamplingParams(trace_decode_token_ids=[rng.randrange(vocab) for _ in range(90)],
                                                     logprobs=1, trace_replay_chunk_size=64),
}


@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_step_launches_never_synchronize(tiny_models, workload):
    llm = LLM(tiny_models["qwen3"], device="cuda", dtype="bfloat16", skip_tokenizer_init=True, max_model_len=256,
              enable_trace_replay=True, max_num_batched_tokens=512)  # several mixed steps, not one prefill step
    runner = llm.llm_engine.runner
    calls = {"execute_model": 0, "sample_tokens": 0}

    def guarded(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            torch.cuda.set_sync_debug_mode("error")
            try:
                return fn(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return call

    rng = random.Random(0)
    vocab = llm.llm_engine.model_config.vocab_size
    prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(rng.randrange(8, 120))]} for _ in range(24)]
    params = [WORKLOADS[workload](rng, vocab) for _ in prompts]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # a first run outside the guard (lazy initialisation)
    runner.execute_model = guarded("execute_model", runner.execute_model)
    runner.sample_tokens = guarded("sample_tokens", runner.sample_tokens)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert calls["execute_model"] >= 5 and calls["sample_tokens"] == calls["execute_model"]
    assert all(len(o.outputs[0].token_ids) >= 40 for o in outs)
