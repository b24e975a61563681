"""async_scheduling=True: step N+1 is scheduled and launched before step N's results are processed. Outputs
must equal the synchronous engine's (tokens and text exactly, logprobs up to batch-composition rounding) across
stop strings, stop ids, EOS, traces, n > 1, logprobs, prompt logprobs, penalties (which fall back to waiting),
aborts with a step in flight; and the overlap must really happen. The randomised version (preemption,
chunked prefill, slot reuse) is tests/engine/test_engine_stress.py, run in both modes."""

from __future__ import annotations

import random

import pytest
from helpers.hf_reference import VOCAB
from helpers.trace_replay_common import BATCH_NOISE, DEVICE, DTYPE

from replayllm import LLM, SamplingParams
from replayllm.config import EngineConfig


def _opts(**kw):
    """CPU by default; bench/gpu_check.sh re-runs this file on CUDA (REPLAYLLM_TEST_DEVICE), with CUDA graphs."""
    return dict(device=DEVICE, dtype=DTYPE, enable_trace_replay=True, max_model_len=128, **kw)


def _requests(rng: random.Random, text: bool):
    prompts, params = [], []
    for i in range(14):
        prompts.append("Once upon a time" if text and i % 2 else
                       {"prompt_token_ids": [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 30))]})
        kind = i % 7
        if kind == 0:
            params.append(SamplingParams(trace_decode_token_ids=[rng.randrange(VOCAB) for _ in range(9)], logprobs=2))
        elif kind == 1:
            params.append(SamplingParams(temperature=0, max_tokens=12, logprobs=1, prompt_logprobs=2))
        elif kind == 2:
            params.append(SamplingParams(n=2, temperature=1.0, seed=i, max_tokens=8, logprobs=0))
        elif kind == 3:  # stops early, while the next step is already in flight
            params.append(SamplingParams(temperature=0.7, seed=i, max_tokens=20,
                                         stop_token_ids=rng.sample(range(VOCAB), VOCAB // 5)))
        elif kind == 4:
            params.append(SamplingParams(temperature=0, max_tokens=3, repetition_penalty=1.3))  # overlap waits
        elif kind == 5:
            params.append(SamplingParams(temperature=0.9, seed=i, max_tokens=10, min_tokens=4,
                                         stop_token_ids=rng.sample(range(VOCAB), VOCAB // 3)))
        else:
            params.append(SamplingParams(temperature=0, max_tokens=11, logprobs=3))
    return prompts, params


def _flatten(outs):
    rows = []
    for o in outs:
        for c in o.outputs:
            lps = [d[t].logprob for t, d in zip(c.token_ids, c.logprobs)] if c.logprobs is not None else None
            rows.append((list(c.token_ids), c.text, c.finish_reason, c.stop_reason, lps))
    return rows


def _compare(sync_outs, async_outs):
    a, b = _flatten(sync_outs), _flatten(async_outs)
    assert [r[:4] for r in a] == [r[:4] for r in b]
    for x, y in zip(a, b):
        if x[4] is not None:
            assert max((abs(p - q) for p, q in zip(x[4], y[4])), default=0.0) <= BATCH_NOISE
    for s, t in zip(sync_outs, async_outs):
        if s.prompt_logprobs is not None:
            assert [None if d is None else sorted(d) for d in s.prompt_logprobs] == \
                   [None if d is None else sorted(d) for d in t.prompt_logprobs]


def test_same_outputs_as_sync_tiny(tiny_models):
    rng = random.Random(7)
    prompts, params = _requests(rng, text=False)
    results = {}
    for mode in (False, True):
        llm = LLM(tiny_models["qwen3"], skip_tokenizer_init=True, max_num_seqs=8, async_scheduling=mode, **_opts())
        results[mode] = llm.generate(prompts, params, use_tqdm=False)
        engine = llm.llm_engine
        assert (engine.num_overlapped_steps > 0) == mode
        assert not engine.has_unfinished_requests() and engine._inflight is None
    _compare(results[False], results[True])
    for p, o in zip(params, results[True]):
        if p.trace_decode_token_ids is not None:
            assert o.outputs[0].token_ids == p.trace_decode_token_ids


def test_stop_strings_and_eos_with_a_step_in_flight():
    """Stop strings are found by the output processor, after the next step was launched: the text must still be
    cut exactly where the synchronous engine cuts it, and the extra in-flight token dropped."""
    sync = LLM(async_scheduling=False, **_opts())
    greedy = sync.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    text = greedy[0].outputs[0].text
    params = [SamplingParams(temperature=0, max_tokens=12, stop=[text[4:7]]),
              SamplingParams(temperature=0, max_tokens=12, stop=[text[6:9]], include_stop_str_in_output=True),
              SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[greedy[0].outputs[0].token_ids[3]]),
              SamplingParams(temperature=0, max_tokens=12)]
    asyn = LLM(async_scheduling=True, **_opts())
    prompts = ["Once upon a time"] * len(params)
    _compare(sync.generate(prompts, params, use_tqdm=False), asyn.generate(prompts, params, use_tqdm=False))
    assert asyn.llm_engine.num_overlapped_steps > 0


def test_penalties_wait_for_the_host_tokens(tiny_models):
    """A running request whose sampler reads its tokens on the host (penalties, min_tokens, bad words) turns the
    overlap off while it runs: every one of its steps sees the previous token."""
    llm = LLM(tiny_models["llama"], skip_tokenizer_init=True, async_scheduling=True, **_opts())
    engine = llm.llm_engine
    p = SamplingParams(temperature=0, max_tokens=10, repetition_penalty=2.0, presence_penalty=1.0)
    engine.add_request("pen", {"prompt_token_ids": [5, 6, 7]}, p)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.num_overlapped_steps == 0
    ref = LLM(tiny_models["llama"], skip_tokenizer_init=True, **_opts())
    assert llm.generate([{"prompt_token_ids": [5, 6, 7]}], p, use_tqdm=False)[0].outputs[0].token_ids == \
        ref.generate([{"prompt_token_ids": [5, 6, 7]}], p, use_tqdm=False)[0].outputs[0].token_ids


def test_abort_with_a_step_in_flight(tiny_models):
    llm = LLM(tiny_models["qwen3"], skip_tokenizer_init=True, async_scheduling=True, **_opts())
    engine = llm.llm_engine
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": [3, 4, 5]}, greedy)
    engine.add_request("b", {"prompt_token_ids": [6, 7]}, greedy)
    for _ in range(4):
        engine.step()
    assert engine._inflight is not None
    assert engine.abort_request("a")
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            finals[out.request_id] = out
    assert set(finals) == {"b"}
    solo = llm.generate([{"prompt_token_ids": [6, 7]}], greedy, use_tqdm=False)[0]
    assert finals["b"].outputs[0].token_ids == solo.outputs[0].token_ids
    assert len(engine.runner.req_states.req_id_to_slot) == 0 or engine.step() == []


def test_config(tiny_models):
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(tiny_models["qwen3"], async_scheduling=1)
    with pytest.raises(ValueError, match="async_scheduling is not supported with tensor_parallel_size"):
        EngineConfig(tiny_models["qwen3"], async_scheduling=True, tensor_parallel_size=2)


def test_default_resolves_by_device_and_tp(tiny_models):
    # None (the default): on for CUDA with TP=1 (tests/model_runner/test_gpu.py checks that side), off on CPU and
    # under TP; an explicit value wins.
    path = tiny_models["qwen3"]
    assert EngineConfig(path, device="cpu").async_scheduling is False
    assert EngineConfig(path, device="cpu", tensor_parallel_size=2).async_scheduling is False
    assert EngineConfig(path, device="cpu", async_scheduling=True).async_scheduling is True
    from replayllm.entrypoints.cli.engine_args import engine_kwargs
    from replayllm.entrypoints.cli.main import build_parser

    for flags, want in (([], None), (["--async-scheduling"], True), (["--no-async-scheduling"], False)):
        args = build_parser().parse_args(["serve", path, *flags])
        assert engine_kwargs(args)["async_scheduling"] is want


def test_server_with_async_scheduling(tmp_path):
    """`replayllm serve --async-scheduling`: concurrent trace and greedy (stop-string) requests equal the
    synchronous offline engine; a client that disconnects mid-stream is aborted and every block comes back."""
    import httpx

    pytest.importorskip("fastapi", reason="the server needs fastapi (not installed on the GPU machine)")
    from helpers.server_utils import ENGINE_ARGS, RemoteServer

    srv = RemoteServer([*ENGINE_ARGS, "--enable-trace-replay", "--async-scheduling"], tmp_path)
    try:
        ref = LLM(enable_trace_replay=True, device="cpu", dtype="float32", max_model_len=512)
        tok = ref.get_tokenizer()
        greedy_text = ref.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=12),
                                   use_tqdm=False)[0].outputs[0].text
        bodies, params = [], []
        for i in range(12):
            prompt = f"Request {i}: once upon a time"
            if i % 2 == 0:
                trace = tok.encode(f" trace number {i} goes here", add_special_tokens=False)
                bodies.append({"prompt": prompt, "trace_decode_token_ids": trace, "logprobs": 1})
                params.append(SamplingParams(trace_decode_token_ids=trace, logprobs=1))
            else:
                bodies.append({"prompt": prompt, "max_tokens": 12, "temperature": 0, "stop": [greedy_text[3:6]],
                               "logprobs": 1})
                params.append(SamplingParams(temperature=0, max_tokens=12, stop=[greedy_text[3:6]], logprobs=1))
        expected = ref.generate([b["prompt"] for b in bodies], params, use_tqdm=False)
        for r, exp in zip(srv.post_all("/completions", bodies, timeout=120), expected):
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["text"] == exp.outputs[0].text
            assert choice["finish_reason"] == exp.outputs[0].finish_reason
            lps = [d[t].logprob for t, d in zip(exp.outputs[0].token_ids, exp.outputs[0].logprobs)]
            assert choice["logprobs"]["token_logprobs"] == pytest.approx(lps, abs=BATCH_NOISE)
        with httpx.Client(timeout=60) as c:
            body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
            with c.stream("POST", srv.base_url + "/completions", json=body) as r:
                lines = r.iter_lines()
                events = 0
                while events < 3:
                    events += next(lines).startswith("data: ")
        srv.wait_idle(timeout=60)
    finally:
        srv.stop()
