"""An engine gives back what it holds: LLM.shutdown(), `with LLM(...) as llm:`, `del llm`; a shut-down LLM is a
clear error, and the start-up warm-up (run on CUDA) leaves no trace a user could see. The CUDA memory numbers
(five build/generate/shutdown cycles back to the starting memory) are in tests/model_runner/test_gpu_memory.py."""

from __future__ import annotations

import gc
import weakref

import pytest
from helpers.trace_replay_common import _full, _tiny

from replayllm import LLM, SamplingParams
from replayllm.engine.warm_up import warm_up, warm_up_rounds

PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt_token_ids": [11, 12, 13]}]
PARAMS = SamplingParams(max_tokens=6, logprobs=2)  # no seed: drawn from the engine's seed stream


def _held(llm: LLM) -> list[weakref.ref]:
    """Weak references to the big things an engine holds (weights, a KV-cache layer, the runner)."""
    runner = llm.llm_engine.runner
    return [weakref.ref(runner), weakref.ref(runner.model), weakref.ref(runner.kv_caches[0])]


def test_shutdown_releases_the_runner_and_refuses_new_requests(tiny_models):
    llm = _tiny(tiny_models["qwen3"])
    llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    runner = llm.llm_engine.runner
    model, kv = weakref.ref(runner.model), weakref.ref(runner.kv_caches[0])
    llm.shutdown()
    assert llm.llm_engine.is_shut_down
    assert model() is None and kv() is None  # released at once, though the engine object is still referenced
    llm.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    with pytest.raises(RuntimeError, match="shut down"):
        llm.llm_engine.add_request("x", PROMPTS[0], PARAMS)


def test_context_manager_shuts_down_on_exit_even_after_an_error(tiny_models):
    with _tiny(tiny_models["qwen3"]) as llm:
        assert llm.generate(PROMPTS, PARAMS, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.llm_engine.is_shut_down
    with pytest.raises(ValueError), _tiny(tiny_models["qwen3"]) as llm2:
        llm2.generate(PROMPTS, SamplingParams(max_tokens=-1), use_tqdm=False)
    assert llm2.llm_engine.is_shut_down


def test_shutdown_with_requests_in_flight_aborts_them(tiny_models):
    llm = _tiny(tiny_models["qwen3"])
    engine = llm.llm_engine
    engine.add_request("a", PROMPTS[0], SamplingParams(max_tokens=50))
    engine.step()
    llm.shutdown()
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_del_llm_releases_at_once_and_collect_frees_everything(tiny_models):
    """The LLM owns its engine: `del llm` shuts it down at once (no collection needed for the weights and the
    KV cache to go), and a collection then frees the rest."""
    llm = _tiny(tiny_models["qwen3"])
    llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    runner, model, kv = _held(llm)
    engine = weakref.ref(llm.llm_engine)
    del llm
    assert model() is None and kv() is None
    gc.collect()
    assert runner() is None and engine() is None


def test_warm_up_changes_nothing_a_user_sees(tiny_models):
    """The start-up warm-up (run on CUDA only) leaves the engine as it found it: no blocks held, no cached
    prefix, counters at zero, and the next requests (seedless: the engine's seed stream) give the same tokens
    and logprobs as on an engine that never warmed up."""
    cold = _tiny(tiny_models["qwen3"], max_logprobs=5)
    warm = _tiny(tiny_models["qwen3"], max_logprobs=5)
    rounds = warm_up_rounds(warm.llm_engine)
    assert len(rounds[0]) == warm.llm_engine.config.max_num_seqs  # the full batch (the KV cache holds it)
    assert any(p.trace_decode_token_ids for _, p in rounds[0])  # trace replay is on: traces in the batch
    warm_up(warm.llm_engine)
    engine = warm.llm_engine
    assert engine.num_steps == 0 and not engine.block_manager.cached and engine.block_manager.num_prefix_hits == 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    a = cold.generate(PROMPTS, PARAMS, use_tqdm=False)
    b = warm.generate(PROMPTS, PARAMS, use_tqdm=False)
    for x, y in zip(a, b):
        assert y.outputs[0].token_ids == x.outputs[0].token_ids
        assert _full(y.outputs[0]) == _full(x.outputs[0])


@pytest.mark.parametrize("opts", [
    dict(max_model_len=16, max_logprobs=0),  # prompts cut to the context; one logprobs variant
    dict(enable_chunked_prefill=False, max_num_batched_tokens=256, max_num_seqs=3),
    dict(batch_invariant=True),
    dict(enable_trace_replay=False, speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
    dict(num_gpu_blocks_override=20, max_model_len=64),  # a KV cache too small for a full batch
], ids=["tiny-context", "no-chunked-prefill", "batch-invariant", "speculative", "small-kv"])
def test_warm_up_runs_on_every_engine_shape(tiny16, opts):
    """The warm-up (run at start-up on CUDA) on engines of other shapes, here on the CPU: it finishes, frees
    every block, and leaves the counters at zero. tiny16 has a 16-token vocabulary (prompt ids wrap)."""
    llm = _tiny(tiny16, **opts)
    engine = llm.llm_engine
    warm_up(engine)
    assert engine.num_steps == 0 and not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    out = llm.generate(PROMPTS, SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [2, 2]
