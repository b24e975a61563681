"""Shared pieces of the trace-replay end-to-end tests: settings (device/dtype from the environment, so the
GPU run can reuse the files) and small helpers. The module-scoped engines they share (`embedded`,
`tiny_llms`, `hf_models`) are fixtures in conftest.py, so each test module gets its own.
"""

from __future__ import annotations

import os
import random

from helpers.hf_reference import VOCAB
from helpers.tolerances import LOGPROB_TOL
from replayllm import LLM

EMBEDDED_VOCAB = 151_936
IM_END = 151_645  # the embedded model's EOS (<|im_end|>); <|endoftext|> is 151_643
ENDOFTEXT = 151_643
TINY_EOS = 2
# The GPU run (bench/gpu_check.sh) re-runs this file with REPLAYLLM_TEST_DEVICE=cuda and both dtypes.
DEVICE = os.environ.get("REPLAYLLM_TEST_DEVICE", "cpu")
DTYPE = os.environ.get("REPLAYLLM_TEST_DTYPE", "float32")
FP32 = DTYPE == "float32"
# Two computations of a logprob: fp32 within tolerances.LOGPROB_TOL (derived there from eps, the logits' scale and
# the models' depth). bf16 (the GPU run only): a few bf16 ulps of |logit| ~10, as set on the GPU runs.
HF_TOL = LOGPROB_TOL if FP32 else 0.25  # engine vs transformers in the same dtype
BATCH_NOISE = LOGPROB_TOL if FP32 else 0.25  # same request, another batch, chunk or a recomputed prefill
# Two logprobs each within HF_TOL of the true value may swap order (rank) only if closer than 2 * HF_TOL.
TIE = 2 * HF_TOL if FP32 else 0.05
# Ranks of two computations of the same request (another batch shape, chunk or a recomputed prefill) are compared
# in fp32 only: a rank counts every vocabulary token above the chosen one, and in bf16 the tiny models' logits tie
# at bf16 resolution all over the vocabulary, so a one-ulp change of one logit (a one-row step runs the GEMV
# kernel, a larger one the library GEMM: kernels/gemv.py) moves a rank without any logprob moving past BATCH_NOISE.
RANKS_COMPARABLE = FP32


def _opts(**extra) -> dict:
    return dict(device=DEVICE, dtype=DTYPE, **extra)


def _tiny(path: str, **extra) -> LLM:
    opts = dict(enable_trace_replay=True, max_model_len=256, skip_tokenizer_init=True)
    opts.update(extra)
    return LLM(path, **_opts(**opts))


def _ids(prompt: list[int]) -> dict:
    return {"prompt_token_ids": prompt}


def _rand_ids(rng: random.Random, n: int, lo: int = 0, hi: int = VOCAB) -> list[int]:
    return [rng.randrange(lo, hi) for _ in range(n)]


def _chosen(comp) -> list[tuple[int, float, int]]:
    """(token, logprob, rank) of every emitted token."""
    return [(t, d[t].logprob, d[t].rank) for t, d in zip(comp.token_ids, comp.logprobs)]


def _full(comp) -> list[dict[int, tuple[float, int]]]:
    """Every reported entry (emitted token + top-k) as plain tuples, for exact comparisons."""
    return [{t: (lp.logprob, lp.rank) for t, lp in d.items()} for d in comp.logprobs]


def _max_delta(a, b) -> float:
    assert [t for t, _, _ in _chosen(a)] == [t for t, _, _ in _chosen(b)]
    return max(abs(x[1] - y[1]) for x, y in zip(_chosen(a), _chosen(b)))


def drive_with_arrivals_and_aborts(engine, requests: list, rng: random.Random) -> tuple[dict, set[str]]:
    """Step `engine` until idle while `requests` [(prompt, params)] arrive 0-3 per step (ids "0", "1", ...) and a
    random running request is aborted in ~5% of the steps. Returns (finished outputs by id, aborted ids)."""
    results, aborted, pending = {}, set(), list(enumerate(requests))
    while pending or engine.has_unfinished_requests():
        for _ in range(rng.randrange(0, 4)):  # requests arrive while others run
            if pending:
                i, (prompt, params) = pending.pop(0)
                engine.add_request(str(i), prompt, params)
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
        if rng.random() < 0.05 and engine.scheduler.running:  # abort a random running request
            victim = rng.choice(engine.scheduler.running).request_id.split("_")[-1]
            if engine.abort_request(victim):
                aborted.add(victim)
    return results, aborted


def tokens_and_logprobs(llm: LLM, prompts: list[list[int]], params) -> tuple[list[list[int]], list[list[float]]]:
    """One `generate` over token-id prompts: each request's tokens and its chosen tokens' logprobs (the CUDA-graph
    tests compare them across graph modes and eager)."""
    outs = llm.generate([_ids(p) for p in prompts], params, use_tqdm=False)
    comps = [o.outputs[0] for o in outs]
    return ([list(c.token_ids) for c in comps],
            [[d[t].logprob for t, d in zip(c.token_ids, c.logprobs)] for c in comps])
