"""schemathesis against the app in-process (ASGI, no socket): for a bounded, derandomized set of generated
requests per operation (valid and invalid), every status code, content type and response body the server
answers is one /openapi.json documents, none is a 5xx, every schema-violating body is refused and every
schema-valid body is accepted (positive_data_acceptance: 2xx, or 401 without the key, 404 for an unknown model).
The engine's own bounds (token ids < the vocabulary, logprobs <= max_logprobs, the request limits) are in the
schema; the rules no JSON Schema can state (best_of == n, prompts x n, min_tokens <= max_tokens, the trace
rules, ...) are repaired in each valid body first (openapi_case_repair.py, one comment per rule), and a body
whose prompt has max_model_len tokens or more (known only by tokenizing: /tokenize says) is not sent."""

from __future__ import annotations

import os

import pytest

schemathesis = pytest.importorskip("schemathesis")
from helpers.openapi_case_repair import repair  # noqa: E402
from hypothesis import HealthCheck, Phase, given, reject, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.core.failures import FailureGroup  # noqa: E402
from schemathesis.generation import GenerationMode  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    negative_data_rejection,
    positive_data_acceptance,
    response_schema_conformance,
    status_code_conformance,
)
from starlette.testclient import TestClient  # noqa: E402

from replayllm.config import EngineConfig  # noqa: E402
from replayllm.entrypoints.http.limits import RequestLimits  # noqa: E402
from replayllm.entrypoints.openai.api_server import build_app  # noqa: E402

KEY = "conformance-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
# Per operation and mode: ~45 s in all on 2 busy cores (generation on the tiny model); more for a deeper run.
EXAMPLES = int(os.environ.get("REPLAYLLM_SCHEMATHESIS_EXAMPLES", "20"))
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
# A short context and few sequences per request: generated requests may ask for the most the server allows.
MAX_MODEL_LEN = 48
LIMITS = RequestLimits(max_sequences_per_request=4, max_stop_strings=8, max_bad_words=8, max_chat_messages=16)
# Routes that refuse schema-valid requests by design here (a documented 400): sleep mode is off in this app (an
# engine put to sleep would refuse every other operation's requests), and no generated model_path holds a
# checkpoint. Every other check still runs on them; tests/server/test_server_sleep.py covers what they accept.
REFUSE_VALID = ("/sleep", "/update_weights_from_disk")


@pytest.fixture(scope="module")
def app():
    return build_app(EngineConfig(device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=8,
                                  seed=0, enable_trace_replay=True), api_key=KEY, limits=LIMITS)


@pytest.fixture(scope="module")
def api_schema(app):

    async def without_lifespan(scope, receive, send):
        if scope["type"] == "lifespan":  # refused at once: schemathesis' client then runs none
            raise RuntimeError("the engine loop is started by the test")
        await app(scope, receive, send)

    app.state.async_engine.start()
    # The first structured-outputs request builds xgrammar's tables for the tokenizer (~20 s on a busy CPU): done
    # once here, not inside whichever generated request comes first (schemathesis reads with a 10 s timeout).
    warm = TestClient(app).post("/v1/completions", json={"prompt": "hi", "max_tokens": 1,
                                                         "structured_outputs": {"json_object": True}}, headers=AUTH)
    assert warm.status_code == 200, warm.text
    try:
        yield schemathesis.openapi.from_asgi("/openapi.json", without_lifespan)
    finally:
        app.state.async_engine.stop()


def operations(schema) -> list:
    return [result.ok() for result in schema.get_all_operations()]


def prompt_fits(client: TestClient, path: str, body) -> bool:
    """Whether the body's prompts are shorter than max_model_len tokens (the engine's rule, SamplingParams.
    verify_for_engine), as /tokenize counts them: a text's token count is nothing a schema can bound. A body
    /tokenize refuses counts as fitting: the server must then accept it as it is. On completions and chat a
    max_tokens / max_completion_tokens past the room the longest prompt leaves is cut to that room (vLLM's 400
    otherwise: ServingBase.check_room)."""
    requests, counts = [], []
    if path == "/v1/chat/completions":
        keys = ("messages", "add_generation_prompt", "continue_final_message", "add_special_tokens",
                "chat_template_kwargs", "tools")
        requests.append({k: body[k] for k in keys if k in body})
    elif path == "/v1/responses":  # the chat request it becomes (responses_protocol.chat_request)
        given = body["input"] if isinstance(body["input"], list) else [{"role": "user", "content": body["input"]}]
        messages = [{"role": "system", "content": body["instructions"]}] if body.get("instructions") else []
        for m in given:
            content = m["content"]
            messages.append({"role": m["role"], "content": content if isinstance(content, str)
                             else [{"type": "text", "text": p["text"]} for p in content]})
        requests.append({"messages": messages})
    elif path == "/v1/completions":
        prompts = body["prompt"] if isinstance(body["prompt"], list) and body["prompt"] and not isinstance(
            body["prompt"][0], int) else [body["prompt"]]
        requests += [{"prompt": t, "add_special_tokens": body.get("add_special_tokens")} for t in prompts
                     if isinstance(t, str)]
        counts += [len(t) for t in prompts if isinstance(t, list)]
    for request in requests:
        r = client.post("/tokenize", json=request, headers=AUTH)
        if r.status_code == 200:
            counts.append(r.json()["count"])
    if counts and max(counts) >= MAX_MODEL_LEN:
        return False
    _fit_max_tokens(path, body, counts)
    return True


def _fit_max_tokens(path: str, body, counts: list[int]) -> None:
    if path not in ("/v1/completions", "/v1/chat/completions") or not counts or body.get("trace_decode_token_ids"):
        return
    keep = body.get("truncate_prompt_tokens")
    longest = max(counts) if keep is None else min(max(counts), MAX_MODEL_LEN - 1 if keep == -1 else keep)
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    asked = body.get(key, 16 if path == "/v1/completions" else None)
    if asked is not None and longest + asked > MAX_MODEL_LEN:
        body[key] = MAX_MODEL_LEN - longest
        if (body.get("min_tokens") or 0) > body[key]:
            body["min_tokens"] = body[key]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
def test_every_answer_is_documented(app, api_schema, mode):
    """Positive: valid requests, repaired for the cross-field rules, must be accepted (and the keyed routes
    answer 401 without a key); negative: schema-violating bodies must be documented 4xx."""
    failures: dict[str, str] = {}  # the first per operation
    client = TestClient(app)  # no lifespan: the engine loop is api_schema's
    rules = {"vocab_size": app.state.async_engine.engine.model_config.vocab_size,
             "max_sequences": LIMITS.max_sequences_per_request, "max_prompt_chars": app.state.limits.max_prompt_chars,
             "max_model_len": MAX_MODEL_LEN}
    positive = mode == GenerationMode.POSITIVE
    for op in operations(api_schema):
        if not positive and not len(op.body):
            continue  # nothing to make invalid

        @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy(generation_mode=mode))
        def run(case):
            if positive:
                repair(case.body, case.operation.path, **rules)
                if not prompt_fits(client, case.operation.path, case.body):
                    reject()
            for headers in (AUTH, {}):
                extra = ([positive_data_acceptance] * (case.operation.path not in REFUSE_VALID) if positive
                         else [negative_data_rejection] * bool(headers))
                checks = CHECKS + extra
                try:
                    case.call_and_validate(headers=headers, checks=checks)
                except (AssertionError, FailureGroup) as e:
                    failures.setdefault(case.operation.label, f"{str(e)[:600]}\nbody: {str(case.body)[:600]}")
                    return

        run()
    assert not failures, "\n\n".join(f"{op}: {failure}" for op, failure in failures.items())


def test_integers_with_a_zero_fraction(app, api_schema):
    """JSON Schema's `integer` (what the document says) holds 2.0: the server takes it as 2, as vLLM does;
    2.5 stays a 400. (Found by positive_data_acceptance.)"""
    client = TestClient(app)
    body = {"prompt": [15.0, 16], "max_tokens": 2.0, "n": 1.0, "temperature": 0, "logprobs": 0.0}
    r = client.post("/v1/completions", json=body, headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.json()["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}
    assert r.json() | {"id": 0, "created": 0} == client.post(
        "/v1/completions", json={**body, "prompt": [15, 16], "max_tokens": 2, "n": 1, "logprobs": 0},
        headers=AUTH).json() | {"id": 0, "created": 0}
    assert client.post("/detokenize", json={"tokens": [15.0]}, headers=AUTH).json() == \
        client.post("/detokenize", json={"tokens": [15]}, headers=AUTH).json()
    r = client.post("/v1/completions", json={**body, "max_tokens": 2.5}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_documented_error_statuses(api_schema):
    spec = api_schema.raw_schema["paths"]
    completions = spec["/v1/completions"]["post"]["responses"]
    assert "422" not in completions
    assert {"400", "401", "404", "413", "500", "503"} <= set(completions)
    assert set(completions["200"]["content"]) == {"application/json", "text/event-stream"}
    assert set(spec["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert "content" not in spec["/health"]["get"]["responses"]["200"]
    assert "401" not in spec["/health"]["get"]["responses"]  # no key on the probes
    for path, operations in spec.items():  # a wrong method (405) and a head too large (431) on every route
        for op in operations.values():
            assert {"405", "431"} <= set(op["responses"]), path
            assert op.get("security") == ([{"bearer": []}] if "401" in op["responses"] else None), path
    assert api_schema.raw_schema["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}


def test_engine_bounds_in_the_schema(app, api_schema):
    """The bounds that come from this engine and its limits are in the request schemas (EngineBounds)."""
    schemas = api_schema.raw_schema["components"]["schemas"]
    vocab = app.state.async_engine.engine.model_config.vocab_size

    def branch(model: str, field: str, kind: str) -> dict:
        prop = schemas[model]["properties"][field]
        return next(b for b in prop.get("anyOf", [prop]) if b.get("type") == kind)

    assert branch("CompletionRequest", "logprobs", "integer")["maximum"] == 20  # EngineConfig.max_logprobs
    assert branch("ChatCompletionRequest", "n", "integer")["maximum"] == LIMITS.max_sequences_per_request
    ids = next(b for b in schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]
               if b.get("items", {}).get("type") == "integer")
    assert (ids["items"]["maximum"], ids["maxItems"]) == (vocab - 1, MAX_MODEL_LEN - 1)
    assert branch("ChatCompletionRequest", "stop", "array")["maxItems"] == LIMITS.max_stop_strings
    assert schemas["DetokenizeRequest"]["properties"]["tokens"]["items"]["maximum"] == vocab - 1
    assert schemas["FunctionDefinition"]["properties"]["name"]["maxLength"] == 64  # OpenAI's limit
    stream = api_schema.raw_schema["paths"]["/v1/completions"]["post"]["responses"]["200"]["content"]
    assert stream["text/event-stream"]["schema"]["properties"]["data"] == {"type": "string"}


def test_405_names_the_allowed_methods(app):
    from starlette.testclient import TestClient

    r = TestClient(app).delete("/v1/completions", headers={"Authorization": f"Bearer {KEY}"})  # no lifespan run
    assert r.status_code == 405
    assert r.headers["allow"] == "POST"
    assert r.json()["error"]["code"] == "method_not_allowed"
