"""n-gram speculative decoding end to end: outputs equal plain decoding (greedy and seeded sampling), stops inside
accepted runs, preemption, no leaked KV blocks, acceptance counters in /metrics and the stats line."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from helpers.tolerances import LOGPROB_TOL

from replayllm import LLM, SamplingParams
from replayllm.embedded_model import DEFAULT_MODEL
from replayllm.model_source import resolve_model_path

DEVICE = os.environ.get("REPLAYLLM_TEST_DEVICE", "cpu")  # bench/gpu_check.sh runs this file on cuda too
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def llms(tiny16) -> tuple[LLM, LLM]:
    """(plain, speculative): same model and options; prefix caching off so both compute every prompt alike."""
    opts = dict(device=DEVICE, dtype="float32", max_model_len=256, tokenizer=resolve_model_path(DEFAULT_MODEL),
                enable_prefix_caching=False, max_num_seqs=16)
    return LLM(tiny16, **opts), LLM(tiny16, speculative_config=SPEC, **opts)


def _prompts(n: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(3, 16, size=int(rng.integers(3, 30))).tolist()} for _ in range(n)]


def _same(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        xo, yo = x.outputs[0], y.outputs[0]
        assert (yo.token_ids, yo.text, yo.finish_reason, yo.stop_reason) == \
            (xo.token_ids, xo.text, xo.finish_reason, xo.stop_reason)


def _accepted(llm: LLM) -> int:
    return llm.llm_engine.scheduler.spec_stats.num_accepted_tokens


def test_greedy_output_is_plain_greedy(llms):
    plain, spec = llms
    repetitive = [{"prompt_token_ids": [5, 6, 7, 8, 9] * 6}]
    before = _accepted(spec)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    _same(plain.generate(repetitive + _prompts(5, 0), params), spec.generate(repetitive + _prompts(5, 0), params))
    stats = spec.llm_engine.scheduler.spec_stats
    assert _accepted(spec) - before > 20  # drafts were verified and many accepted (not a no-op)
    assert stats.num_accepted_tokens < stats.num_draft_tokens  # and some rejected
    assert stats.num_accepted_tokens_per_pos[0] >= stats.num_accepted_tokens_per_pos[-1] > 0
    bm = spec.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # rejected positions' blocks went back when the requests ended


def test_stops_inside_accepted_runs_match_plain(llms):
    """EOS, stop ids, stop strings and max_tokens taken from plain outputs, so each falls mid-output (often in
    a run of accepted drafts): speculative outputs stop at the same token, with the same text and reasons."""
    plain, spec = llms
    prompts = _prompts(3, 1)
    free = plain.generate(prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    params = []
    for i, out in enumerate(free):
        toks, text = out.outputs[0].token_ids, out.outputs[0].text
        params += [SamplingParams(temperature=0, max_tokens=13 + i),
                   SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[toks[12 + i]], ignore_eos=True),
                   SamplingParams(temperature=0, max_tokens=30, stop=[text[10 + i : 13 + i]], ignore_eos=True),
                   SamplingParams(temperature=0, max_tokens=30, stop=[text[10 + i : 13 + i]],
                                  include_stop_str_in_output=True, ignore_eos=True),
                   SamplingParams(temperature=0, max_tokens=30)]  # EOS (token 2) may end it
    many = [p for p in prompts for _ in range(5)]
    before = _accepted(spec)
    _same(plain.generate(many, params), spec.generate(many, params))
    assert _accepted(spec) > before


def test_seeded_sampling_is_plain_sampling_with_its_logprobs(llms):
    """The Gumbel draw at each position depends on (seed, position) only, and a draft is accepted exactly when
    it equals that draw: so a seeded request samples the very same tokens as without speculation, and reports
    the raw logprobs of those tokens (within fp32 rounding: other query shapes)."""
    plain, spec = llms
    prompts = _prompts(6, 2)
    params = [SamplingParams(temperature=0.8, top_k=8, top_p=0.9, min_p=0.02, max_tokens=30, seed=i, logprobs=2,
                             logit_bias={4: 1.0}, stop=["++"] if i % 2 else None) for i in range(6)]
    before = _accepted(spec)
    a, b = plain.generate(prompts, params), spec.generate(prompts, params)
    _same(a, b)
    assert _accepted(spec) > before
    for x, y in zip(a, b):
        for dx, dy, tok in zip(x.outputs[0].logprobs, y.outputs[0].logprobs, x.outputs[0].token_ids):
            assert dx.keys() == dy.keys() and dx[tok].rank == dy[tok].rank
            assert abs(dx[tok].logprob - dy[tok].logprob) <= LOGPROB_TOL


def test_requests_that_read_their_tokens_decode_without_drafts(llms):
    """Penalties, bad words and min_tokens (until reached) depend on the tokens before each position: those
    requests get no drafts (correct, one token a step); min_tokens ones speculate once past it."""
    plain, spec = llms
    prompts = _prompts(2, 3)
    stats = spec.llm_engine.scheduler.spec_stats
    for p in (SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.3, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=16, frequency_penalty=0.5, ignore_eos=True)):
        drafts = stats.num_drafts
        _same(plain.generate(prompts, p), spec.generate(prompts, p))
        assert stats.num_drafts == drafts
    p = SamplingParams(temperature=0, max_tokens=24, min_tokens=14, stop_token_ids=[9, 10, 13])
    _same(plain.generate(prompts, p), spec.generate(prompts, p))


def test_preemption_with_drafts_matches_plain(tiny16):
    """A KV cache too small for the batch: requests are preempted and recomputed while others draft."""
    opts = dict(device=DEVICE, dtype="float32", max_model_len=64, skip_tokenizer_init=True,
                enable_prefix_caching=False, num_gpu_blocks_override=10, block_size=8)
    plain, spec = LLM(tiny16, **opts), LLM(tiny16, speculative_config=SPEC, **opts)
    prompts = _prompts(6, 4)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    a, b = plain.generate(prompts, params), spec.generate(prompts, params)
    assert [x.outputs[0].token_ids for x in a] == [y.outputs[0].token_ids for y in b]
    assert spec.llm_engine.scheduler.num_preemptions > 0 and _accepted(spec) > 0


def test_trace_with_speculation_is_a_value_error(llms):
    _, spec = llms
    with pytest.raises(ValueError, match="trace_decode_token_ids cannot be used while speculative decoding"):
        spec.generate([{"prompt_token_ids": [3, 4, 5]}], SamplingParams(trace_decode_token_ids=[5, 6]))


def test_acceptance_counters_over_http(llms, caplog):
    """vLLM's spec_decode counters in /metrics (consistent with each other and with the engine's own) and the
    acceptance rate in the stats line; the engine core's wire form of the counters round-trips."""
    import logging
    import time

    TestClient = pytest.importorskip("fastapi.testclient").TestClient  # the H200 has no fastapi unless carried
    from prometheus_client.parser import text_string_to_metric_families

    from replayllm.engine.engine_stats import EngineSnapshot
    from replayllm.entrypoints.openai.api_server import build_app

    _, spec = llms
    engine = spec.llm_engine
    app = build_app(engine=engine, log_stats_interval=0.05)
    caplog.set_level(logging.INFO, logger="replayllm.stats")
    with TestClient(app) as c:
        r = c.post("/v1/completions", json={"model": engine.config.served_model_name,
                                            "prompt": [5, 6, 7, 8, 9] * 6, "max_tokens": 24, "temperature": 0,
                                            "ignore_eos": True})
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 60
        while not any("Spec decode acceptance rate" in rec.getMessage() for rec in caplog.records):
            assert time.monotonic() < deadline, "no stats line within 60 s"
            time.sleep(0.05)
        # The response can leave before the loop has run its last step (one scheduled ahead, whose drafts count
        # too): read /metrics once the engine is idle, then compare with the engine's own counters.
        while engine.has_unfinished_requests():
            assert time.monotonic() < deadline, "the engine did not go idle within 60 s"
            time.sleep(0.05)
        stats = engine.scheduler.spec_stats
        while True:
            text = c.get("/metrics").text
            m = {s.name + "".join(f"|{v}" for v in s.labels.values()): s.value
                 for f in text_string_to_metric_families(text) for s in f.samples}
            if m["replayllm:spec_decode_num_drafts_total"] == stats.num_drafts or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    drafted = m["replayllm:spec_decode_num_draft_tokens_total"]
    accepted = m["replayllm:spec_decode_num_accepted_tokens_total"]
    per_pos = [m[f"replayllm:spec_decode_num_accepted_tokens_per_pos_total|{i}"] for i in range(4)]
    assert (m["replayllm:spec_decode_num_drafts_total"], drafted, accepted, per_pos) == \
        (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens, stats.num_accepted_tokens_per_pos)
    assert 0 < accepted < drafted and sum(per_pos) == accepted
    assert r.json()["usage"]["completion_tokens"] == 24
    snap = EngineSnapshot.of(engine)
    assert EngineSnapshot.from_fields(snap.fields()) == snap and snap.spec_accepted_tokens_per_pos == tuple(per_pos)
    assert EngineSnapshot.from_fields(EngineSnapshot().fields()) == EngineSnapshot()


def test_speculative_config_flag_reaches_the_engine():
    from replayllm.entrypoints.cli.engine_args import engine_kwargs
    from replayllm.entrypoints.cli.main import build_parser

    args = build_parser().parse_args(["serve", "--speculative-config", json.dumps(SPEC)])
    assert engine_kwargs(args)["speculative_config"] == SPEC
