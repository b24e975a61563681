"""No JIT inside the first run (issue 28): after `LLM(...)` returns on CUDA, the requests a user sends first —
a batch greedy and sampled, logprobs and prompt logprobs of several widths, traces one token a step and in
fast-replay chunks, one request alone, a batch of prefix-cache hits — need no Triton kernel variant that
start-up (compile-ahead, graph capture and the warm-up, engine/warm_up.py) has not already made. Run in a fresh
process with an empty Triton cache, so that variants compiled by earlier tests in this process cannot hide a
miss."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

SCRIPT = r"""
import json, random, sys
import triton
from replayllm import LLM, SamplingParams

llm = LLM(sys.argv[1], dtype=sys.argv[2], enable_trace_replay=True, skip_tokenizer_init=True, max_model_len=256)
new = []
triton.knobs.runtime.jit_cache_hook = lambda **kw: new.append(kw["fn"].name) and False
rng = random.Random(0)
vocab = llm.llm_engine.model_config.vocab_size
def prompts(n, lo, hi):
    return [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(rng.randrange(lo, hi))]} for _ in range(n)]
def trace(n):
    return [rng.randrange(vocab) for _ in range(n)]
runs = [
    (prompts(48, 20, 120), [SamplingParams(max_tokens=24, ignore_eos=True, temperature=0)] * 48),
    (prompts(16, 5, 60), [SamplingParams(max_tokens=12, ignore_eos=True, seed=i, top_p=0.9, top_k=40,
                                         logprobs=i % 6, prompt_logprobs=i % 4) for i in range(16)]),
    (prompts(24, 5, 60), [SamplingParams(trace_decode_token_ids=trace(70), logprobs=1) for _ in range(24)]),
    (prompts(8, 5, 60), [SamplingParams(trace_decode_token_ids=trace(70), logprobs=3, trace_replay_chunk_size=64)
                         for _ in range(8)]),
    (prompts(1, 3, 9), [SamplingParams(max_tokens=30, ignore_eos=True, logprobs=20)]),
    # ~14k prompt tokens: one step above the piecewise graphs' 8,192 tokens (eager) where the default budget is
    # 16,384 (a large GPU: config.default_token_budget), two steps elsewhere.
    (prompts(80, 150, 200), [SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)] * 80),
]
# Prefix-cache hits (the first batch's prompts again, an odd number of them: short queries over long contexts; an
# odd batch once moved query_start_loc off 16-byte alignment, another prefill variant).
runs.append((runs[0][0][:47], runs[0][1][:47]))
for p, sp in runs:
    llm.generate(p, sp, use_tqdm=False)
llm.shutdown()
print(json.dumps(new))
"""


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_first_requests_compile_nothing(tiny_models, tmp_path, dtype):
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"), TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, tiny_models["qwen3"], dtype], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    compiled = json.loads(proc.stdout.strip().splitlines()[-1])
    assert compiled == [], f"kernel variants compiled after start-up: {compiled}"


NO_WARM_UP = r"""
import json, random, sys
import triton
from replayllm import LLM, SamplingParams
from replayllm.engine import llm_engine

llm_engine.warm_up = lambda engine: None  # compile-ahead and the graph captures only
llm = LLM(sys.argv[1], dtype="bfloat16", skip_tokenizer_init=True, max_model_len=256)
new = []
triton.knobs.runtime.jit_cache_hook = lambda **kw: new.append(kw["fn"].name) and False
rng = random.Random(0)
vocab = llm.llm_engine.model_config.vocab_size
prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(64)]} for _ in range(32)]
llm.generate(prompts, [SamplingParams(max_tokens=16, ignore_eos=True, temperature=0)] * 32, use_tqdm=False)
llm.shutdown()
print(json.dumps(new))
"""


def test_greedy_batch_compiles_nothing_without_the_warm_up(tiny_models, tmp_path):
    """Compile-ahead alone covers a plain greedy batch's decode steps, the append of sampled tokens (launched
    outside the graphs) included: before it was compiled ahead, `bench/cold_start.py --no-warm-up` met
    `_append_sampled_kernel` inside the first run."""
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"), TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, "-c", NO_WARM_UP, tiny_models["qwen3"]], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    compiled = json.loads(proc.stdout.strip().splitlines()[-1])
    assert compiled == [], f"kernel variants compiled after start-up (no warm-up): {compiled}"
