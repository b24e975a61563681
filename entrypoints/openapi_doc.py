"""The server's /openapi.json made to match what it answers: its 4xx/5xx codes, error shape and content types."""

from __future__ import annotations

from fastapi import FastAPI

from .concurrency_limit import EXEMPT_PATHS

ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}
ERROR_SCHEMA = {  # errors.APIError.body()
    "type": "object", "title": "ErrorResponse", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}},
    }},
}
WHY = {  # status -> when the server answers it
    400: "Invalid request: malformed JSON, a wrong or unknown field, a value out of range, a limit exceeded "
         "(FastAPI's 422 is answered as 400)",
    401: "Missing or wrong `Authorization: Bearer <key>` (--api-key)",
    404: "Unknown model",
    413: "Request body over --max-request-body-bytes",
    500: "A failure inside the engine",
    503: "Over --limit-concurrency requests in flight, or the engine is not running",
}
EMPTY_200 = {"/health", "/ping"}  # 200 with an empty body and no content type, as vLLM's /health
MODEL_PATHS = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/v1/models/")
ENGINE_PATHS = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")  # may 500
STREAMING_PATHS = ("/v1/completions", "/v1/chat/completions")  # "stream": true answers text/event-stream


def _error(status: int) -> dict:
    return {"description": WHY[status], "content": {"application/json": {"schema": ERROR_REF}}}


def _statuses(path: str, method: str, keyed: bool) -> list[int]:
    codes = []
    if method == "post":
        codes.append(400)
    if keyed:
        codes.append(401)
    if path.startswith(MODEL_PATHS):
        codes.append(404)
    if method == "post":
        codes.append(413)
    if path.startswith(ENGINE_PATHS):
        codes.append(500)
    if path not in EXEMPT_PATHS or path in EMPTY_200:
        codes.append(503)
    return codes


def document_responses(app: FastAPI, keyed_paths: tuple[str, ...] | None) -> None:
    """Replace app.openapi with one that rewrites FastAPI's schema: 422 -> 400, every error status the
    server can answer (401 on `keyed_paths` when a key is set, None: no key), /metrics as Prometheus text,
    /health and /ping as an empty 200, streaming routes as JSON or SSE."""
    generate = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = generate()
        schema.setdefault("components", {}).setdefault("schemas", {})["ErrorResponse"] = ERROR_SCHEMA
        for path, operations in schema["paths"].items():
            for method, op in operations.items():
                responses = op["responses"]
                responses.pop("422", None)
                keyed = keyed_paths is not None and path.startswith(keyed_paths)
                for status in _statuses(path, method, keyed):
                    responses[str(status)] = _error(status)
                ok = responses["200"]
                if path in EMPTY_200:
                    ok.pop("content", None)
                    ok["description"] = "The engine loop is running (empty body)"
                elif path == "/metrics":
                    ok["content"] = {"text/plain": {"schema": {"type": "string"}}}
                    ok["description"] = "Prometheus text exposition format"
                elif path in STREAMING_PATHS:
                    ok["content"]["text/event-stream"] = {"schema": {"type": "string"}}
        schema["components"]["schemas"].pop("HTTPValidationError", None)
        schema["components"]["schemas"].pop("ValidationError", None)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
