"""CUDA graphs for speculative verify steps on the GPU (marker `gpu`; skipped on CPU): a speculative engine with
real verify graphs against plain decoding (greedy tokens) and against the same engine with enforce_eager=True
(tokens and logprobs), on the tiny 16-token Qwen3 in fp32 (conftest `tiny16`)."""

from __future__ import annotations

import pytest

from replayllm import LLM, SamplingParams

pytestmark = pytest.mark.gpu

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PROMPTS = [[5, 9, 3, 5, 9, 3, 5], [7, 4, 12, 7, 4], [3, 3, 8, 11, 3, 8, 11, 3, 8], [13, 6, 13, 6, 13]]
OPTS = dict(device="cuda", skip_tokenizer_init=True, dtype="float32", max_model_len=128, max_num_seqs=4,
            block_size=8, enable_prefix_caching=False, max_cudagraph_capture_size=20)


def _run(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    comps = [o.outputs[0] for o in outs]
    return ([list(c.token_ids) for c in comps],
            [[d[t].logprob for t, d in zip(c.token_ids, c.logprobs)] for c in comps])


def test_verify_graphs_match_eager_and_plain(tiny16):
    plain, _ = _run(LLM(tiny16, enforce_eager=True, **OPTS), PROMPTS)
    eager = LLM(tiny16, speculative_config=SPEC, enforce_eager=True, **OPTS)
    spec = LLM(tiny16, speculative_config=SPEC, **OPTS)
    graphs = spec.llm_engine.runner.graph_runner
    assert graphs.verify.q == 5 and graphs.verify.sizes == [1, 2, 4] and set(graphs.verify.graphs) == {1, 2, 4}
    for prompts in (PROMPTS, PROMPTS[:1], PROMPTS[3:]):  # a batch of 4 (mostly ragged steps), then batch 1
        tokens, lps = _run(spec, prompts)
        eager_tokens, eager_lps = _run(eager, prompts)
        assert tokens == eager_tokens
        d = max(abs(a - b) for x, y in zip(lps, eager_lps) for a, b in zip(x, y))
        print(f"\n[verify graphs] {len(prompts)} prompts: graphs vs eager max |dlogprob| {d:.2e}")
        assert d <= 1e-4
    assert _run(spec, PROMPTS[:1])[0] == plain[:1] and _run(spec, PROMPTS[3:])[0] == plain[3:]
    assert graphs.num_verify_replays > 0
    print(f"[verify graphs] {graphs.num_verify_replays} verify replays of {graphs.num_replays}")
