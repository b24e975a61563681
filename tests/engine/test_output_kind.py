"""SamplingParams.output_kind: CUMULATIVE snapshots, DELTA pieces that add up to them, FINAL_ONLY's single output."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import numpy as np
import pytest
from helpers.trace_replay_common import _opts

from replayllm import LLM, RequestOutputKind, SamplingParams
from replayllm.engine.async_engine import AsyncLLMEngine
from replayllm.engine.engine_stats import StatsSink
from replayllm.engine.request_stream import RequestAborted
from replayllm.outputs import RequestOutput

CUMULATIVE, DELTA, FINAL_ONLY = RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def llm():
    # No prefix caching: each kind reruns the same batch, and a cache hit would change the prefill's shapes
    # (so the last bits of the logprobs); with identical batches every run is bit-identical.
    return LLM(enable_trace_replay=True, enable_prefix_caching=False, seed=0, **_opts(max_model_len=256))


def _run(llm: LLM, requests: list[tuple[str, SamplingParams]], kind: RequestOutputKind) -> list[list[RequestOutput]]:
    """Run `requests` together as one batch with `kind`; every output of each request, in step order."""
    engine = llm.llm_engine
    rids = [f"{kind.name}-{i}" for i in range(len(requests))]
    for rid, (prompt, params) in zip(rids, requests):
        engine.add_request(rid, prompt, dataclasses.replace(params, output_kind=kind))
    outs: dict[str, list[RequestOutput]] = {rid: [] for rid in rids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id].append(out)
    return [outs[rid] for rid in rids]


def _fields(out: RequestOutput) -> dict:
    """Everything an output reports, in a form `==` compares exactly (full_logprobs arrays as bytes)."""
    comps = [(c.index, c.text, c.token_ids, c.cumulative_logprob, c.logprobs, c.finish_reason, c.stop_reason,
              None if c.full_logprobs is None else [a.tobytes() for a in c.full_logprobs]) for c in out.outputs]
    return dict(prompt=out.prompt, prompt_token_ids=out.prompt_token_ids, prompt_logprobs=out.prompt_logprobs,
                outputs=comps, finished=out.finished, num_cached_tokens=out.num_cached_tokens)


def _concat(deltas: list[RequestOutput]) -> RequestOutput:
    """The cumulative output that a run of DELTA outputs adds up to."""
    last = deltas[-1]
    comps = []
    for i, c in enumerate(last.outputs):
        parts = [d.outputs[i] for d in deltas]
        assert all(p.index == i for p in parts)
        joined = dataclasses.replace(c, text="".join(p.text for p in parts),
                                     token_ids=[t for p in parts for t in p.token_ids])
        if c.logprobs is not None:
            joined.logprobs = [lp for p in parts for lp in p.logprobs]
        if c.full_logprobs is not None:
            joined.full_logprobs = [a for p in parts for a in p.full_logprobs]
        comps.append(joined)
    with_prompt_lps = [d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None]
    assert len(with_prompt_lps) <= 1  # sent once, whole
    return dataclasses.replace(last, outputs=comps, prompt_logprobs=with_prompt_lps[0] if with_prompt_lps else None)


def _check_delta_matches(requests: list[tuple[str, SamplingParams]], cumulative: list[list[RequestOutput]],
                         delta: list[list[RequestOutput]]) -> None:
    """Step by step, the DELTA pieces so far add up to that step's CUMULATIVE snapshot (text may lag by the
    held-back tail, and is never more than the final text's prefix); at the end they are equal."""
    for (_, params), cum, del_ in zip(requests, cumulative, delta):
        assert len(del_) == len(cum) > 1
        assert [d.finished for d in del_] == [c.finished for c in cum] == [False] * (len(cum) - 1) + [True]
        final_texts = [c.text for c in cum[-1].outputs]
        for k in range(len(cum)):
            joined = _concat(del_[: k + 1])
            assert len(joined.outputs) == params.n
            for j, c in zip(joined.outputs, cum[k].outputs):
                assert j.token_ids == c.token_ids and j.logprobs == c.logprobs
                assert j.cumulative_logprob == c.cumulative_logprob  # cumulative in every DELTA output
                assert (j.finish_reason, j.stop_reason) == (c.finish_reason, c.stop_reason)
                assert c.text.startswith(j.text) and final_texts[c.index].startswith(j.text)
        assert _fields(_concat(del_)) == _fields(cum[-1])


def test_final_only_is_one_output_equal_to_the_cumulative_final(llm):
    requests = [
        (PROMPT, SamplingParams(temperature=0, max_tokens=3, logprobs=2)),
        ("Hello", SamplingParams(temperature=0, max_tokens=7, logprobs=0, prompt_logprobs=1)),
        ("The sky", SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=5, logprobs=1,
                                   return_full_logprobs=True)),
        ({"prompt_token_ids": [1, 2, 3]}, SamplingParams(trace_decode_token_ids=[11, 12, 13, 14], logprobs=3)),
    ]
    cumulative = _run(llm, requests, CUMULATIVE)
    final_only = _run(llm, requests, FINAL_ONLY)
    for cum, fin in zip(cumulative, final_only):
        assert len(cum) > 1 and len(fin) == 1  # requests finish at different steps; each is reported once
        assert fin[0].finished and all(c.finish_reason == "length" for c in fin[0].outputs)
        assert _fields(fin[0]) == _fields(cum[-1])
    assert final_only[1][0].prompt_logprobs is not None and final_only[2][0].outputs[1].full_logprobs


def test_delta_adds_up_to_cumulative(llm):
    requests = [
        (PROMPT, SamplingParams(temperature=0, max_tokens=6, logprobs=2, prompt_logprobs=2,
                                return_full_logprobs=True)),
        ("Hello", SamplingParams(n=2, temperature=0.9, seed=3, max_tokens=5, logprobs=1)),
        ({"prompt_token_ids": [5, 6, 7]}, SamplingParams(trace_decode_token_ids=[101, 202, 303, 404, 505],
                                                         logprobs=3, return_full_logprobs=True,
                                                         trace_replay_chunk_size=4)),
    ]
    cumulative = _run(llm, requests, CUMULATIVE)
    delta = _run(llm, requests, DELTA)
    _check_delta_matches(requests, cumulative, delta)
    # Each step hands out only the new token (and its logprobs), not everything so far.
    assert [len(d.outputs[0].token_ids) for d in delta[0]] == [1] * 6
    # The trace replays fast (trace_replay_chunk_size=4): the prefill's token, then one chunk of 4.
    assert [len(d.outputs[0].full_logprobs) for d in delta[2]] == [1, 4]
    assert _concat(delta[2]).outputs[0].token_ids == [101, 202, 303, 404, 505]
    assert delta[0][0].prompt_logprobs is not None and all(d.prompt_logprobs is None for d in delta[0][1:])


def test_delta_n2_lists_every_completion_even_with_nothing_new(llm):
    """Completion 0 ends early on a stop token; later outputs still list it, with empty lists."""
    base = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=8, logprobs=1, prompt_logprobs=0)
    (probe,) = _run(llm, [(PROMPT, base)], CUMULATIVE)
    first, second = (c.token_ids for c in probe[-1].outputs)
    stop_at = next(i for i in range(1, 5) if first[i] not in second and first[i] not in first[:i])
    requests = [(PROMPT, dataclasses.replace(base, stop_token_ids=[first[stop_at]]))]
    cumulative = _run(llm, requests, CUMULATIVE)
    delta = _run(llm, requests, DELTA)
    _check_delta_matches(requests, cumulative, delta)
    final = cumulative[0][-1].outputs
    assert len(final[0].token_ids) == stop_at + 1 and final[0].stop_reason == first[stop_at]
    assert len(final[1].token_ids) == 8
    after = delta[0][stop_at + 1:]
    assert after and all(d.outputs[0].token_ids == [] and d.outputs[0].logprobs == [] and d.outputs[0].text == ""
                         and d.outputs[0].finish_reason == "stop" for d in after)


@pytest.mark.parametrize("include_stop", [False, True])
def test_delta_holds_back_text_a_stop_string_may_cut(llm, include_stop):
    """The stop string starts inside one token's text and ends in the next: the first part, already in that
    step's cumulative text, must not be handed out as a delta (it is cut from the final text)."""
    base = SamplingParams(temperature=0, max_tokens=16, logprobs=0)
    (probe,) = _run(llm, [(PROMPT, base)], CUMULATIVE)
    lengths = [len(o.outputs[0].text) for o in probe]
    text = probe[-1].outputs[0].text
    k, stop = next((k, text[lengths[k] - 2: lengths[k] + 2]) for k in range(1, len(lengths) - 1)
                   if lengths[k] - 2 >= lengths[k - 1] and lengths[k + 1] >= lengths[k] + 2
                   and text.find(text[lengths[k] - 2: lengths[k] + 2]) == lengths[k] - 2)
    requests = [(PROMPT, dataclasses.replace(base, stop=[stop], include_stop_str_in_output=include_stop))]
    cumulative = _run(llm, requests, CUMULATIVE)
    delta = _run(llm, requests, DELTA)
    _check_delta_matches(requests, cumulative, delta)
    final = cumulative[0][-1].outputs[0]
    cut = lengths[k] - 2 + (len(stop) if include_stop else 0)
    assert (final.finish_reason, final.stop_reason, final.text) == ("stop", stop, text[:cut])
    assert len(cumulative[0]) == k + 2  # ended on the token after k
    # At step k the cumulative text already had the stop string's first part; the deltas held it back.
    assert cumulative[0][k].outputs[0].text.endswith(stop[:2])
    assert len(_concat(delta[0][: k + 1]).outputs[0].text) <= lengths[k] - 2


@pytest.mark.parametrize("value", ["DELTA", "delta", 3, -1, True, 1.0, None, CUMULATIVE.value + 0.5])
def test_invalid_output_kind_is_a_value_error(value):
    with pytest.raises(ValueError, match=r"output_kind must be a RequestOutputKind .*CUMULATIVE=0.*got"):
        SamplingParams(output_kind=value)


def test_output_kind_accepts_members_and_their_values():
    assert SamplingParams().output_kind is CUMULATIVE
    p = SamplingParams(output_kind=1)
    assert p.output_kind is DELTA and p == SamplingParams(output_kind=DELTA) != SamplingParams()
    assert p.clone().output_kind is DELTA and "output_kind=<RequestOutputKind.DELTA: 1>" in repr(p)
    assert SamplingParams(output_kind=np.int64(2)).output_kind is FINAL_ONLY
    assert [(m.name, m.value) for m in RequestOutputKind] == [("CUMULATIVE", 0), ("DELTA", 1), ("FINAL_ONLY", 2)]


def test_generate_leaves_the_callers_params_alone(llm):
    shared = SamplingParams(temperature=0, max_tokens=5, logprobs=1)
    mine = SamplingParams(temperature=0, max_tokens=4, output_kind=DELTA)  # generate returns finals regardless
    before = [dataclasses.asdict(shared), dataclasses.asdict(mine)]
    outs = llm.generate([PROMPT, "Hello"], shared, use_tqdm=False)
    (delta_out,) = llm.generate(["Hello"], [mine], use_tqdm=False)
    assert [dataclasses.asdict(shared), dataclasses.asdict(mine)] == before
    assert shared.output_kind is CUMULATIVE and mine.output_kind is DELTA
    expected = [o[-1] for o in _run(llm, [(PROMPT, shared), ("Hello", shared)], CUMULATIVE)]
    assert [_fields(o)["outputs"] for o in outs] == [_fields(o)["outputs"] for o in expected]
    assert len(delta_out.outputs[0].token_ids) == 4 and delta_out.outputs[0].text  # whole, not a delta


class _TokenCount(StatsSink):
    def __init__(self):
        self.tokens = 0

    def on_step(self, num_reqs, num_new_tokens):
        self.tokens += num_new_tokens


def test_async_engine_final_only_abort_and_token_counting(llm):
    """FINAL_ONLY through the async engine: one final output; an abort still reaches the reader, and the
    generated-token count includes tokens of requests that never reported progress. DELTA is refused."""
    stats = _TokenCount()
    ae = AsyncLLMEngine(llm.llm_engine, stats=stats)
    ae.start()
    params = SamplingParams(temperature=0, max_tokens=5, output_kind=FINAL_ONLY)

    async def main():
        stream = await ae.add_requests("fin", [PROMPT, "Hello"], [params, params])
        got = [(i, out.finished, len(out.outputs[0].token_ids)) async for i, out in stream.outputs()]
        victim = await ae.add_requests("victim", [PROMPT], [SamplingParams(max_tokens=200, ignore_eos=True,
                                                                           output_kind=FINAL_ONLY)])
        while await ae.run(lambda e: e.num_steps) < steps_before + 8:  # the victim makes progress
            await asyncio.sleep(0.005)
        ae.abort(victim.request_ids)
        with pytest.raises(RequestAborted):
            async for _ in victim.outputs():
                pass
        with pytest.raises(ValueError, match="DELTA"):
            await ae.add_requests("delta", [PROMPT], [SamplingParams(output_kind=DELTA)])
        return got

    steps_before = llm.llm_engine.num_steps
    try:
        got = asyncio.run(main())
    finally:
        ae.stop()
    assert sorted(got) == [(0, True, 5), (1, True, 5)]
    assert stats.tokens >= 10 + 3  # 2 x 5 finished, plus the aborted request's (it ran 3 steps or more)


def test_server_submits_non_streaming_calls_final_only(llm):
    """Non-streaming completions/chat go in as FINAL_ONLY, streaming ones stay CUMULATIVE; the answers and the
    generated-token metric are whole either way (in-process app, no lifespan: started by hand)."""
    import httpx

    from replayllm.entrypoints.openai.api_server import build_app

    app = build_app(engine=llm.llm_engine)
    ae = app.state.async_engine
    kinds = []
    real_add = ae.add_requests

    async def recording_add(request_id, prompts, params):
        kinds.extend(p.output_kind for p in params)
        return await real_add(request_id, prompts, params)

    ae.add_requests = recording_add
    ae.start()

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            common = {"max_tokens": 4, "ignore_eos": True, "temperature": 0}
            plain = await c.post("/v1/completions", json={"prompt": PROMPT, "n": 2, **common})
            chat = await c.post("/v1/chat/completions",
                                json={"messages": [{"role": "user", "content": "Hi"}], **common})
            async with c.stream("POST", "/v1/completions", json={"prompt": PROMPT, "stream": True, **common}) as r:
                chunks = [json.loads(line[6:]) for line in [x async for x in r.aiter_lines()]
                          if line.startswith("data: {")]
            metrics = (await c.get("/metrics")).text
        return plain, chat, chunks, metrics

    try:
        plain, chat, chunks, metrics = asyncio.run(main())
    finally:
        ae.stop()
    assert kinds == [FINAL_ONLY, FINAL_ONLY, CUMULATIVE]
    assert plain.status_code == chat.status_code == 200
    choices = plain.json()["choices"]
    assert len(choices) == 2 and all(c["finish_reason"] == "length" for c in choices)
    assert plain.json()["usage"]["completion_tokens"] == 8 and chat.json()["usage"]["completion_tokens"] == 4
    assert "".join(ch["choices"][0]["text"] for ch in chunks if ch["choices"]) == choices[0]["text"]
    assert "replayllm:generation_tokens_total 16.0" in metrics  # 8 + 4 + 4, counted per step by the engine
