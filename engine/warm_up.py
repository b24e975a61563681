"""Start-up warm-up (CUDA): dummy requests through the real step loop, so that the Triton kernel variants, cuBLAS
algorithms and allocator pools a run can need exist before the first user request (as vLLM warms up at start).

Why: Triton compiles a kernel once per process for each new set of compile-time values (tiles chosen from the
step's shapes, the logprobs kernels' top-k width, the trace kernel's fast-replay flag); on a fresh machine each
compile takes ~0.3-1 s, which landed inside the user's first `generate` (W1 ran at half speed in the first
process of a fresh H200). CUDA-graph capture covers the graphed shapes; this covers what runs eagerly around the
graphs: prefill and mixed-step attention, the sampler, the logprobs and trace kernels.

What runs (each round to completion; every request with an explicit seed, so the engine's own seed stream is not
touched, which keeps later seedless requests' outputs as without the warm-up; the prefix cache and the step
counters are reset afterwards):
1. a full batch: `max_num_seqs` requests (fewer when the KV cache is small) whose prompts fill one step's token
   budget, greedy and sampled (top-k, top-p, min-p) rows, a few decode steps at the full batch size, traces in
   both replay modes when trace replay is on;
2. one request alone per prompt-length class (batch-size-1 shapes; the prefill attention kernel's query tile
   follows the longest query), then one per compiled variant of the logprobs kernels (kernels/logprobs.py
   `warm_up_ks`), sampled logprobs and prompt logprobs both.
"""

from __future__ import annotations

import logging
import time

from ..config import FAST_REPLAY_CHUNK_SIZE
from ..kernels.logprobs import warm_up_ks
from ..sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_ID_PREFIX = "__warm_up_"
_DECODE_STEPS = 3  # tokens generated per warm-up request: the prefill's, then decode steps
_FIRST_TOKEN_ID = 10  # prompt token ids cycle through [10, 10 + _ID_SPAN): ordinary ids in any vocabulary
_ID_SPAN = 90
_ALONE_PROMPT_LENS = (1, 2, 5, 9, 17, 33, 65)  # next powers of two 1, 2, 8, ..., 128


def warm_up(engine) -> None:
    """Run the warm-up rounds on `engine` (an LLMEngine, idle, just built; untyped here: llm_engine.py imports
    this module), then forget them: prefix cache, counters."""
    start = time.perf_counter()
    rounds = warm_up_rounds(engine)
    for i, requests in enumerate(rounds):
        for j, (prompt, params) in enumerate(requests):
            engine.add_request(f"{_ID_PREFIX}{i}_{j}", {"prompt_token_ids": prompt}, params)
        while engine.has_unfinished_requests():
            engine.step()
    steps = engine.num_steps
    engine.block_manager.reset_prefix_cache()
    engine.block_manager.num_prefix_hits = 0
    engine.num_steps = engine.max_running_in_step = engine.last_step_num_reqs = 0
    engine.last_step_num_new_tokens = engine.num_overlapped_steps = 0
    engine.scheduler.num_preemptions = 0
    engine._arrivals = 0
    logger.info("warm-up: %d rounds, %d steps in %.1f s", len(rounds), steps, time.perf_counter() - start)


def warm_up_rounds(engine) -> list[list[tuple[list[int], SamplingParams]]]:
    """The warm-up's requests, round by round: [(prompt token ids, params)]."""
    config = engine.config
    max_len = config.max_model_len
    new_tokens = min(_DECODE_STEPS, max_len - 1)
    blocks_free = engine.block_manager.num_free_blocks
    # The full batch: prompts that fill one step's budget, as many requests as the KV cache holds at once.
    prompt_len = max(1, min(-(-config.max_num_batched_tokens // config.max_num_seqs), max_len - new_tokens))
    per_request = -(-(prompt_len + new_tokens) // config.block_size)
    num = max(1, min(config.max_num_seqs, blocks_free // per_request))
    vocab = engine.model_config.vocab_size
    full = [(_prompt(i, prompt_len, vocab), _params(i, new_tokens, config, vocab)) for i in range(num)]
    # Alone, one prompt length per power of two up to 128: the prefill attention kernel's query tile follows the
    # step's longest query (kernels/paged_attention.py), so each length class compiles its own variant.
    rounds = [full]
    for length in sorted({min(n, max_len - new_tokens) for n in _ALONE_PROMPT_LENS}):
        alone = SamplingParams(max_tokens=new_tokens, ignore_eos=True, seed=0)
        rounds.append([(_prompt(num + length, length, vocab), alone)])
    # Then each logprobs variant, with prompt logprobs too (their own kernel launches over the prompt).
    odd_len = max(1, min(17, max_len - new_tokens))
    for k in warm_up_ks(vocab, config.max_logprobs):
        params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, seed=0, temperature=1.0, logprobs=k,
                                prompt_logprobs=k)
        rounds.append([(_prompt(num + 1 + k, odd_len, vocab), params)])
    return rounds


def _token(n: int, vocab: int) -> int:
    return (_FIRST_TOKEN_ID + n % _ID_SPAN) % vocab


def _prompt(i: int, length: int, vocab: int) -> list[int]:
    return [_token(i * 7 + t, vocab) for t in range(length)]


def _params(i: int, max_tokens: int, config, vocab: int) -> SamplingParams:
    """Row i of the full batch: greedy, sampled with every truncation, or (trace replay on) a trace replayed
    one token a step or in fast-replay chunks."""
    kind = i % 4
    if config.enable_trace_replay and kind >= 2:
        trace_token_ids = [_token(i + t, vocab) for t in range(max_tokens)]
        return SamplingParams(trace_decode_token_ids=trace_token_ids, logprobs=min(1, config.max_logprobs), seed=i,
                              trace_replay_chunk_size=1 if kind == 2 else FAST_REPLAY_CHUNK_SIZE)
    if kind % 2:
        return SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=i, temperature=0.8, top_k=20,
                              top_p=0.9, min_p=0.01)
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0, seed=i)
