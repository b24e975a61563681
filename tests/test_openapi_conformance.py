"""schemathesis against the app in-process (ASGI, no socket): for a bounded, derandomized set of generated
requests per operation (valid and invalid), every status code, content type and response body the server
answers is one /openapi.json documents, none is a 5xx, and every schema-violating body is refused.
Not run: positive_data_acceptance — a schema-valid request can still be a documented 400 by a cross-field rule
the schema cannot express (best_of == n, logprobs <= the engine's max_logprobs, ids < the vocabulary size, prompt
tokens + max_tokens <= max_model_len, trace combinations)."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.generation import GenerationMode  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from replayllm.config import EngineConfig  # noqa: E402
from replayllm.entrypoints.api_server import build_app  # noqa: E402
from replayllm.entrypoints.limits import RequestLimits  # noqa: E402

KEY = "conformance-key"
EXAMPLES = 20  # per operation and mode: ~45 s in all on 2 busy cores (generation on the tiny model)
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
# A short context and few sequences per request: generated requests may ask for the most the server allows.
LIMITS = RequestLimits(max_sequences_per_request=4, max_stop_strings=8, max_bad_words=8, max_chat_messages=16)


@pytest.fixture(scope="module")
def app():
    return build_app(EngineConfig(device="cpu", dtype="float32", max_model_len=48, max_num_seqs=8, seed=0,
                                  enable_trace_replay=True), api_key=KEY, limits=LIMITS)


@pytest.fixture(scope="module")
def api_schema(app):

    async def without_lifespan(scope, receive, send):
        if scope["type"] == "lifespan":  # refused at once: schemathesis' client then runs none
            raise RuntimeError("the engine loop is started by the test")
        await app(scope, receive, send)

    app.state.async_engine.start()
    try:
        yield schemathesis.openapi.from_asgi("/openapi.json", without_lifespan)
    finally:
        app.state.async_engine.stop()


def operations(schema) -> list:
    return [result.ok() for result in schema.get_all_operations()]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
def test_every_answer_is_documented(api_schema, mode):
    """Positive: valid requests (and the keyed routes' 401 without a key); negative: schema-violating bodies,
    which must be documented 4xx."""
    failures = []
    for op in operations(api_schema):
        if mode == GenerationMode.NEGATIVE and not len(op.body):
            continue  # nothing to make invalid

        @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy(generation_mode=mode))
        def run(case):
            for headers in ({"Authorization": f"Bearer {KEY}"}, {}):
                try:
                    checks = CHECKS + [negative_data_rejection] * (mode == GenerationMode.NEGATIVE and bool(headers))
                    case.call_and_validate(headers=headers, checks=checks)
                except AssertionError as e:  # schemathesis' FailureGroup: keep the first per operation
                    failures.append(f"{case.operation.label}: {str(e)[:600]}")
                    return

        run()
    assert not failures, "\n\n".join(dict.fromkeys(failures))


def test_documented_error_statuses(api_schema):
    spec = api_schema.raw_schema["paths"]
    completions = spec["/v1/completions"]["post"]["responses"]
    assert "422" not in completions
    assert {"400", "401", "404", "413", "500", "503"} <= set(completions)
    assert set(completions["200"]["content"]) == {"application/json", "text/event-stream"}
    assert set(spec["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert "content" not in spec["/health"]["get"]["responses"]["200"]
    assert "401" not in spec["/health"]["get"]["responses"]  # no key on the probes


def test_405_names_the_allowed_methods(app):
    from starlette.testclient import TestClient

    r = TestClient(app).delete("/v1/completions", headers={"Authorization": f"Bearer {KEY}"})  # no lifespan run
    assert r.status_code == 405
    assert r.headers["allow"] == "POST"
    assert r.json()["error"]["code"] == "method_not_allowed"
