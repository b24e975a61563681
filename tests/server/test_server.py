"""The OpenAI-compatible server, end to end: a real `replayllm serve` subprocess driven by the openai client."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from helpers.server_utils import API_KEY
from helpers.tolerances import LOGPROB_TOL

from replayllm import SamplingParams

MODEL = "replayllm/tiny-qwen3"
PROMPT = "Once upon a time"
# The server and the offline `llm` run the same settings: a request sent alone (and no prefix-cache hit: PROMPT is
# shorter than a block) is the same computation on both, so its logprobs compare exactly. Another batch or another
# trace_replay_chunk_size is another computation: within tolerances.LOGPROB_TOL.


@pytest.fixture(scope="module")
def server(shared_trace_server):
    return shared_trace_server  # one process for this module and those importing its fixtures (conftest.py)


@pytest.fixture(autouse=True)
def server_idle_after_each_test(server):
    """Every test leaves the server with nothing running and every KV block free (checked via /metrics)."""
    yield
    server.wait_idle()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def llm(server_reference_llm):
    """The offline engine on the server's settings: the reference the HTTP results must equal."""
    return server_reference_llm


@pytest.fixture(scope="module")
def trace(llm):
    return llm.get_tokenizer().encode(" there lived a curious little robot.", add_special_tokens=False)


def post(server, path: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, headers=server.headers, timeout=timeout)


def post_root(server, path: str, body: dict) -> dict:
    """POST to a path outside /v1 (vLLM's /tokenize, /detokenize); the 200 body."""
    r = httpx.post(server.url + path, json=body, headers=server.headers, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_models_health_version(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].owned_by == "replayllm"
    assert client.models.retrieve(MODEL).id == MODEL
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]


def test_trace_completion_equals_offline_llm(client, llm, trace):
    resp = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=50, logprobs=5,
        extra_body={"trace_decode_token_ids": trace, "return_token_ids": True,
                    "return_tokens_as_token_ids": True})
    ref = llm.generate([PROMPT], SamplingParams(trace_decode_token_ids=trace, logprobs=5), use_tqdm=False)[0]
    comp = ref.outputs[0]
    choice = resp.choices[0]
    assert choice.token_ids == trace == comp.token_ids  # the trace is exactly what was emitted
    assert choice.prompt_token_ids == ref.prompt_token_ids
    assert choice.text == comp.text
    assert choice.finish_reason == "length"
    lp = choice.logprobs
    assert lp.tokens == [f"token_id:{t}" for t in trace]
    assert lp.token_ranks == [comp.logprobs[i][tok].rank for i, tok in enumerate(trace)]  # replayllm extra
    for i, tok in enumerate(trace):
        assert lp.token_logprobs[i] == comp.logprobs[i][tok].logprob
        expected = {f"token_id:{t}": x.logprob for t, x in comp.logprobs[i].items()}
        assert lp.top_logprobs[i] == expected
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert resp.usage.completion_tokens == len(trace)

    # Plain rendering: decoded token strings and offsets into the text.
    plain = client.completions.create(model=MODEL, prompt=PROMPT, logprobs=0,
                                      extra_body={"trace_decode_token_ids": trace}).choices[0]
    assert plain.logprobs.tokens == [comp.logprobs[i][t].decoded_token for i, t in enumerate(trace)]
    assert plain.logprobs.text_offset[0] == 0 and plain.logprobs.text_offset == sorted(plain.logprobs.text_offset)


def test_trace_replay_chunk_size_over_http(server, client, llm, trace):
    """Fast replay over HTTP: the server's default chunk (one token a step) and a per-request
    `trace_replay_chunk_size` report the offline engine's tokens and logprobs (bit for bit one token a step; within
    rounding in chunks of 3: other matmul shapes); the field without a trace is a 400 naming it; streaming delivers
    whole chunks and the same tokens."""
    ref = llm.generate([PROMPT], SamplingParams(trace_decode_token_ids=trace, logprobs=1,
                                                trace_replay_chunk_size=1), use_tqdm=False)[0].outputs[0]
    for chunk in (None, 1, 3):
        extra = {"trace_decode_token_ids": trace, "return_token_ids": True}
        if chunk is not None:
            extra["trace_replay_chunk_size"] = chunk
        choice = client.completions.create(model=MODEL, prompt=PROMPT, logprobs=1, extra_body=extra).choices[0]
        assert choice.token_ids == trace and choice.text == ref.text
        want = [ref.logprobs[i][tok].logprob for i, tok in enumerate(trace)]
        if chunk in (None, 1):  # the server's default is one token a step, like `ref`
            assert choice.logprobs.token_logprobs == want
        else:
            assert choice.logprobs.token_logprobs == pytest.approx(want, abs=LOGPROB_TOL, rel=0)
    stream = client.completions.create(model=MODEL, prompt=PROMPT, stream=True,
                                       extra_body={"trace_decode_token_ids": trace, "trace_replay_chunk_size": 4})
    texts = [c.choices[0].text for c in stream if c.choices]
    assert "".join(texts) == ref.text
    r = post(server, "/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 3,
                                      "trace_replay_chunk_size": 4})
    assert r.status_code == 400 and "trace_replay_chunk_size" in r.text


def test_greedy_completion_equals_offline_llm(client, llm):
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=1)
    ref = llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0, logprobs=1), use_tqdm=False)[0]
    comp = ref.outputs[0]
    assert resp.choices[0].text == comp.text
    assert resp.choices[0].logprobs.token_logprobs == [lp[t].logprob for lp, t in zip(comp.logprobs, comp.token_ids)]


def test_logit_bias_and_allowed_token_ids_over_http(client, llm):
    forced = 1052
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1,
                                     logit_bias={str(forced): 100}, extra_body={"return_token_ids": True})
    choice = resp.choices[0]
    assert choice.token_ids == [forced] * 4
    # The reported logprobs are the model's raw ones: those of the same tokens forced by a trace, unbiased.
    ref = llm.generate([PROMPT], SamplingParams(trace_decode_token_ids=[forced] * 4, logprobs=1),
                       use_tqdm=False)[0].outputs[0]
    assert choice.logprobs.token_logprobs == [ref.logprobs[i][forced].logprob for i in range(4)]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                          max_completion_tokens=6, seed=3, logit_bias={"15": -100},
                                          extra_body={"allowed_token_ids": [15, 284, 11], "return_token_ids": True})
    assert set(chat.choices[0].token_ids) <= {284, 11}  # 15 is allowed but banned by its bias


def test_chat_with_trace_equals_offline_chat(client, llm):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me a story."}]
    trace = llm.get_tokenizer().encode("Once upon a time.", add_special_tokens=False)
    resp = client.chat.completions.create(
        model=MODEL, messages=messages, logprobs=True, top_logprobs=3,
        extra_body={"trace_decode_token_ids": trace, "return_token_ids": True})
    ref = llm.chat(messages, SamplingParams(trace_decode_token_ids=trace, logprobs=3), use_tqdm=False)[0]
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == ref.outputs[0].text == "Once upon a time."
    assert choice.token_ids == trace
    assert resp.prompt_token_ids == ref.prompt_token_ids
    assert len(choice.logprobs.content) == len(trace)
    # These messages are sent nowhere else: no prefix-cache hit on either side, the same computation.
    for entry, tok, ref_lp in zip(choice.logprobs.content, trace, ref.outputs[0].logprobs):
        assert entry.logprob == ref_lp[tok].logprob
        assert entry.token == ref_lp[tok].decoded_token and entry.rank == ref_lp[tok].rank
        assert len(entry.top_logprobs) == 3
        best = sorted((x for x in ref_lp.values() if x.rank <= 3), key=lambda x: x.rank)
        assert [t.token for t in entry.top_logprobs] == [x.decoded_token for x in best]
        assert [t.logprob for t in entry.top_logprobs] == [x.logprob for x in best]
    assert resp.usage.completion_tokens == len(trace)

    greedy = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=8, temperature=0)
    ref = llm.chat(messages, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)[0]
    assert greedy.choices[0].message.content == ref.outputs[0].text


def test_streaming_completion_equals_non_streaming(client, trace):
    kwargs = dict(model=MODEL, prompt=PROMPT, logprobs=2, extra_body={"trace_decode_token_ids": trace})
    full = client.completions.create(**kwargs).choices[0]
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    choices = [c.choices[0] for c in chunks if c.choices]
    assert "".join(c.text for c in choices) == full.text
    assert [t for c in choices if c.logprobs for t in c.logprobs.tokens] == full.logprobs.tokens
    streamed_lps = [x for c in choices if c.logprobs for x in c.logprobs.token_logprobs]
    assert streamed_lps == full.logprobs.token_logprobs  # the same request on the same server: bit for bit
    assert [x for c in choices if c.logprobs for x in c.logprobs.text_offset] == full.logprobs.text_offset
    assert choices[-1].finish_reason == "length" and all(c.finish_reason is None for c in choices[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(trace)


def test_streaming_chat(client):
    messages = [{"role": "user", "content": "Say something."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_stop_string_streams_the_same_text(client):
    """Text that a stop string may still cut is held back while streaming, so the pieces add up."""
    base = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    stop = base[len(base) // 2: len(base) // 2 + 3]
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])
    full = client.completions.create(**kwargs).choices[0]
    assert full.finish_reason == "stop" and full.stop_reason == stop
    assert full.text == base[: base.index(stop)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)
    assert streamed == full.text


def test_token_prompts_echo_n_and_prompt_logprobs(server, llm):
    ids = [12522, 5193, 264, 882]  # "Once upon a time"
    r = post(server, "/completions", {"prompt": [ids, ids[:2]], "max_tokens": 3, "temperature": 0, "echo": True,
                                      "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["choices"][0]["text"].startswith(PROMPT)
    assert body["choices"][0]["prompt_token_ids"] == ids and len(body["choices"][1]["token_ids"]) == 3
    assert body["usage"]["prompt_tokens"] == 6 and body["usage"]["completion_tokens"] == 6

    # echo + logprobs: prompt tokens first (the first has no logprob), then the generated ones.
    r = post(server, "/completions", {"prompt": ids, "max_tokens": 2, "temperature": 0, "echo": True,
                                      "logprobs": 1, "prompt_logprobs": 1})
    choice = r.json()["choices"][0]
    ref = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1),
                       use_tqdm=False)[0]
    lps = choice["logprobs"]["token_logprobs"]
    assert len(lps) == len(ids) + 2 and lps[0] is None
    assert lps[1:4] == [ref.prompt_logprobs[i][ids[i]].logprob for i in range(1, 4)]
    assert choice["prompt_logprobs"][0] is None
    assert choice["prompt_logprobs"][1][str(ids[1])]["rank"] == ref.prompt_logprobs[1][ids[1]].rank

    # n=2 with a seed: two choices, reproducible.
    body = {"prompt": PROMPT, "max_tokens": 5, "n": 2, "seed": 7, "temperature": 1.0, "return_token_ids": True}
    first, second = post(server, "/completions", body).json(), post(server, "/completions", body).json()
    assert [c["index"] for c in first["choices"]] == [0, 1]
    assert [c["token_ids"] for c in first["choices"]] == [c["token_ids"] for c in second["choices"]]


def _histogram_multi(m: dict) -> float:
    """Engine steps that batched more than one request."""
    return m["replayllm:batch_size_count"] - m['replayllm:batch_size_bucket{le="1.0"}']


def test_concurrent_requests_batch_and_equal_one_by_one(server, llm):
    tok = llm.get_tokenizer()
    bodies = []
    for i in range(32):
        body = {"model": MODEL, "prompt": f"Request {i}: once upon a time", "logprobs": 1,
                "return_token_ids": True}
        if i % 2 == 0:
            body["trace_decode_token_ids"] = tok.encode(f" trace number {i} goes here", add_special_tokens=False)
        else:
            body.update(max_tokens=6, temperature=0)
        bodies.append(body)

    before = server.metrics()
    one_by_one = [post(server, "/completions", b).json()["choices"][0] for b in bodies]
    middle = server.metrics()
    assert _histogram_multi(middle) == _histogram_multi(before)  # sequential: never more than one per step

    together = [r.json()["choices"][0] for r in server.post_all("/completions", bodies, timeout=120)]
    after = server.metrics()
    assert _histogram_multi(after) > _histogram_multi(middle), "concurrent requests were never batched"
    assert after["replayllm:max_num_running_in_step"] > 1
    for body, a, b in zip(bodies, one_by_one, together):
        if "trace_decode_token_ids" in body:
            assert a["token_ids"] == b["token_ids"] == body["trace_decode_token_ids"]
        assert a["token_ids"] == b["token_ids"] and a["text"] == b["text"]
        # One by one vs batched: fp32 GEMMs on the CPU block differently for 1 and 32 rows (not batch
        # invariant): another summation order.
        assert a["logprobs"]["token_logprobs"] == pytest.approx(b["logprobs"]["token_logprobs"], abs=LOGPROB_TOL,
                                                                rel=0)


def _aborted(server) -> float:
    return server.metrics().get('replayllm:requests_finished_total{finished_reason="abort"}', 0.0)


def _wait_aborted(server, count: float, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while _aborted(server) < count:
        assert time.monotonic() < deadline, "the disconnected request was not aborted"
        time.sleep(0.1)


LONG = {"model": MODEL, "prompt": PROMPT, "max_tokens": 500, "ignore_eos": True, "temperature": 0}


def test_disconnect_mid_stream_aborts_and_frees_blocks(server):
    aborted = _aborted(server)
    with httpx.Client(headers=server.headers, timeout=60) as c:
        with c.stream("POST", server.base_url + "/completions", json={**LONG, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # (breaking out of a for loop over it would close the connection already)
            events = 0
            while events < 3:
                events += next(lines).startswith("data: ")
            m = server.metrics()
            assert m["replayllm:num_requests_running"] == 1 and m["replayllm:kv_cache_usage_perc"] > 0
    _wait_aborted(server, aborted + 1)
    server.wait_idle(timeout=60)  # the abort above freed them (generous bound: a loaded CI machine)


def test_disconnect_non_streaming_aborts(server):
    aborted = _aborted(server)
    with pytest.raises(httpx.ReadTimeout):
        post(server, "/completions", LONG, timeout=0.5)
    _wait_aborted(server, aborted + 1)
    server.wait_idle(timeout=60)
    assert server.metrics().get('replayllm:http_requests_total{route="/v1/completions",status="499"}') >= 1


def test_metrics_counters(server, trace):
    before = server.metrics()
    r = post(server, "/completions", {"prompt": [12522, 5193, 264, 882], "trace_decode_token_ids": trace,
                                      "trace_replay_chunk_size": 64})  # fast replay (the default is one a step)
    assert r.status_code == 200
    after = server.wait_idle()

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("replayllm:trace_replay_requests_total") == 1
    assert delta("replayllm:requests_added_total") == 1
    assert delta("replayllm:prompt_tokens_total") == 4
    assert delta("replayllm:generation_tokens_total") == len(trace)
    assert delta('replayllm:requests_finished_total{finished_reason="length"}') == 1
    assert delta('replayllm:http_requests_total{route="/v1/completions",status="200"}') == 1
    assert delta("replayllm:engine_steps_total") == 2  # prefill, then the rest of the trace in one chunk (fast replay)
    assert after["replayllm:engine_step_errors_total"] == 0
    assert not any('status="500"' in k for k in after)


def test_metrics_request_histograms(server, trace):
    """vLLM's per-request histograms move once per finished request; the time per output token only for
    requests with 2+ tokens; the timings are ordered (queue <= first token <= end) whatever the machine's speed."""
    before = server.metrics()
    bodies = [{"prompt": [12522, 5193, 264, 882], "trace_decode_token_ids": trace},
              {"prompt": [12522, 5193], "max_tokens": 1},
              {"prompt": [12522, 5193, 264], "max_tokens": 3, "n": 2, "ignore_eos": True, "temperature": 1.0,
               "seed": 1}]
    for body in bodies:
        assert post(server, "/completions", body).status_code == 200
    after = server.wait_idle()

    def delta(name: str) -> float:
        return after.get(f"replayllm:{name}", 0.0) - before.get(f"replayllm:{name}", 0.0)

    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prompt_tokens", "request_generation_tokens"):
        assert delta(name + "_count") == 3, name
    assert delta("request_time_per_output_token_seconds_count") == 2
    assert delta("request_prompt_tokens_sum") == 4 + 2 + 3
    assert delta("request_generation_tokens_sum") == len(trace) + 1 + 2 * 3
    assert 0 <= delta("request_queue_time_seconds_sum") <= delta("time_to_first_token_seconds_sum") \
        <= delta("e2e_request_latency_seconds_sum")
    assert 0 <= after["replayllm:prefix_cache_hit_rate"] <= 1
    # Each response's start, per route: 3 completions, each started within its own end-to-end time.
    assert delta('http_response_start_seconds_count{route="/v1/completions"}') == 3
    assert 0 < delta('http_response_start_seconds_sum{route="/v1/completions"}')
    # Each request's first token reached the API process once (n=2: one request), after its step ended.
    assert delta("first_token_delivery_seconds_count") == 3 and delta("first_token_delivery_seconds_sum") > 0
