"""The server's /openapi.json made to match what it answers: 4xx/5xx codes, error shape, content types, bounds."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import FastAPI

from ...routing_replay import RouteShape
from ..http.concurrency_limit import EXEMPT_PATHS
from ..http.limits import RequestLimits
from .serving_admin import ADMIN_PATHS, EMPTY_200_PATHS

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
         "(FastAPI's 422 is answered as 400); on the sleep-mode and weight routes, what the engine refuses (sleep "
         "mode off, requests in flight, weights that do not fit)",
    401: "Missing or wrong `Authorization: Bearer <key>` (--api-key)",
    404: "Unknown model; on the Responses API also an unknown (or not stored) response id",
    405: "A method this path does not take; the `Allow` header names the ones it does",
    413: "Request body over --max-request-body-bytes",
    431: "Request line and headers over --h11-max-incomplete-event-size bytes, or more than --h11-max-header-count "
         "header fields (answered by the connection layer, which then closes the connection)",
    500: "A failure inside the engine",
    503: "Over --limit-concurrency requests in flight, the engine is not running, or it is asleep (POST /sleep)",
}
BEARER = "bearer"  # the security scheme's name: HTTP bearer authentication, the key --api-key sets
# One server-sent event of a stream, as OpenAPI 3.1 tools read `text/event-stream` (each event an object): its
# `data` is a chunk's JSON, an error's JSON, or the final "[DONE]" (streaming.py).
SSE_EVENT = {"type": "object", "required": ["data"], "properties": {
    "data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"}}}
# 200 with an empty body and no content type, as vLLM's: path -> what it means.
EMPTY_200 = {"/health": "The engine loop is running (empty body)", "/ping": "The engine loop is running (empty body)",
             **{path: "Done (empty body)" for path in EMPTY_200_PATHS}}
GENERATING_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/inference/v1/generate")
MODEL_PATHS = (*GENERATING_PATHS, "/tokenize", "/detokenize", "/v1/models/")
ENGINE_PATHS = (*GENERATING_PATHS, "/tokenize", "/detokenize", *ADMIN_PATHS)  # may 500
STREAMING_PATHS = GENERATING_PATHS  # "stream": true answers text/event-stream
SAMPLING_SCHEMAS = ("CompletionRequest", "ChatCompletionRequest", "ResponsesRequest", "GenerateSamplingParams")
# The request bodies whose unknown fields are ignored (request_fields.py) unless --strict-request-fields.
TOLERANT_BODIES = ("CompletionRequest", "ChatCompletionRequest", "TokenizeCompletionRequest",
                   "TokenizeChatRequest", "DetokenizeRequest")


@dataclass(frozen=True)
class EngineBounds:
    """The per-field maxima that come from the engine and the server's limits, written into the request
    schemas so that a schema-valid value is one this server accepts (the server checks each one itself)."""

    vocab_size: int  # token ids < this (SamplingParams.verify_for_engine, check_prompt_token_ids)
    max_logprobs: int  # logprobs / top_logprobs / prompt_logprobs <= this (verify_for_engine)
    limits: RequestLimits  # resolved: its max_model_len is the engine's
    route_shape: RouteShape | None = None  # a MoE model's routes (trace_routed_experts); None: a dense model

    def apply(self, schemas: dict) -> None:
        lim, top_id = self.limits, self.vocab_size - 1
        seqs = min(128, lim.max_sequences_per_request)  # 128: the protocol's own bound on n
        text = {"strings": lim.max_prompt_chars}
        ids = {"ids": top_id, "id_lists": lim.max_model_len}  # /detokenize (limits.py)
        fields = {  # (schema, property) -> bounds for _bound
            "CompletionRequest.prompt": {**text, "ids": top_id, "id_lists": lim.max_model_len - 1, "lists": seqs},
            "TokenizeCompletionRequest.prompt": text,
            "ChatMessage.content": text, "TextPart.text": text,
            "ChatCompletionRequest.messages": {"lists": lim.max_chat_messages},
            "TokenizeChatRequest.messages": {"lists": lim.max_chat_messages},
            "DetokenizeRequest.tokens": ids,
            "ResponsesRequest.input": {**text, "lists": lim.max_chat_messages},
            "InputMessage.content": text, "InputText.text": text, "ResponsesRequest.instructions": text,
            "GenerateRequest.token_ids": {"ids": top_id, "id_lists": lim.max_model_len - 1},
        }
        for request in SAMPLING_SCHEMAS:
            fields.update({f"{request}.stop": {**text, "lists": lim.max_stop_strings},
                           f"{request}.bad_words": {**text, "lists": lim.max_bad_words},
                           f"{request}.trace_decode_token_ids": {"ids": top_id, "id_lists": lim.max_trace_ids},
                           f"{request}.stop_token_ids": {"ids": top_id},
                           f"{request}.allowed_token_ids": {"ids": top_id}})
        for request in ("CompletionRequest", "ChatCompletionRequest", "GenerateSamplingParams"):
            fields.update({f"{request}.n": {"maximum": seqs},
                           f"{request}.prompt_logprobs": {"maximum": self.max_logprobs},
                           f"{request}.truncate_prompt_tokens": {"maximum": lim.max_model_len - 1}})
        fields.update({"CompletionRequest.best_of": {"maximum": seqs},
                       "CompletionRequest.logprobs": {"maximum": self.max_logprobs},
                       "ChatCompletionRequest.top_logprobs": {"maximum": self.max_logprobs},
                       "ResponsesRequest.top_logprobs": {"maximum": self.max_logprobs},
                       "GenerateSamplingParams.logprobs": {"maximum": self.max_logprobs}})
        for name, bounds in fields.items():
            model, prop = name.split(".")
            _bound(schemas[model]["properties"][prop], **bounds)
        for request in SAMPLING_SCHEMAS:
            self._bound_routes(schemas[request]["properties"]["trace_routed_experts"])

    def _bound_routes(self, s: dict) -> None:
        """trace_routed_experts: [P <= max_model_len - 1][num_layers][top_k] ids < num_experts on a MoE model; only
        null on a dense one (any routes are a 400 there). Not stated: P within the request's own positions, dense
        layers' rows -1, distinct ids in a row (SamplingParams checks them)."""
        shape = self.route_shape
        if shape is None:
            s.pop("anyOf", None)
            s["type"] = "null"
            return
        for branch in s.get("anyOf", [s]):
            if branch.get("type") != "array":
                continue
            branch["maxItems"] = self.limits.max_model_len - 1
            layers = branch["items"]
            layers["minItems"] = layers["maxItems"] = shape.num_layers
            row = layers["items"]
            row["minItems"] = row["maxItems"] = shape.top_k
            row["items"]["maximum"] = shape.num_experts - 1


def _bound(s: dict, *, strings: int | None = None, ids: int | None = None, id_lists: int | None = None,
           lists: int | None = None, maximum: int | None = None, in_list: bool = False) -> None:
    """Set maxLength on the field's strings, maximum on its token ids (integers inside a list) or on the field
    itself (`maximum`), maxItems on its lists of token ids (`id_lists`) and of anything else (`lists`)."""
    for branch in s.get("anyOf", [s]):
        kind = branch.get("type")
        if kind == "string" and strings is not None:
            branch["maxLength"] = strings
        elif kind == "integer" and (ids if in_list else maximum) is not None:
            branch["maximum"] = ids if in_list else maximum
        elif kind == "array":
            cap = id_lists if branch["items"].get("type") == "integer" else lists
            if cap is not None:
                branch["maxItems"] = cap
            _bound(branch["items"], strings=strings, ids=ids, id_lists=id_lists, lists=lists, in_list=True)


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
    codes.append(405)
    if method == "post":
        codes.append(413)
    codes.append(431)
    if path.startswith(ENGINE_PATHS):
        codes.append(500)
    if path not in EXEMPT_PATHS or path in EMPTY_200:
        codes.append(503)
    return codes


def document_responses(app: FastAPI, keyed_paths: tuple[str, ...] | None, bounds: EngineBounds,
                       strict_fields: bool = False) -> None:
    """Replace app.openapi with one that rewrites FastAPI's schema: 422 -> 400, every error status the
    server can answer (401 and the bearer security scheme on `keyed_paths` when a key is set, None: no key;
    405 and 431 everywhere), /metrics as Prometheus text,
    /health and /ping as an empty 200, streaming routes as JSON or SSE; the request fields' engine `bounds`;
    the request bodies' unknown fields: accepted (additionalProperties true), or refused with `strict_fields`."""
    generate = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = generate()
        schema.setdefault("components", {}).setdefault("schemas", {})["ErrorResponse"] = ERROR_SCHEMA
        if keyed_paths is not None:  # --api-key: `Authorization: Bearer <key>` on the keyed routes
            schema["components"]["securitySchemes"] = {BEARER: {"type": "http", "scheme": "bearer"}}
        for path, operations in schema["paths"].items():
            for method, op in operations.items():
                responses = op["responses"]
                responses.pop("422", None)
                keyed = keyed_paths is not None and path.startswith(keyed_paths)
                for status in _statuses(path, method, keyed):
                    responses[str(status)] = _error(status)
                if keyed:
                    op["security"] = [{BEARER: []}]
                ok = responses["200"]
                if path in EMPTY_200:
                    ok.pop("content", None)
                    ok["description"] = EMPTY_200[path]
                elif path == "/metrics":
                    ok["content"] = {"text/plain": {"schema": {"type": "string"}}}
                    ok["description"] = "Prometheus text exposition format"
                elif path in STREAMING_PATHS:
                    ok["content"]["text/event-stream"] = {"schema": SSE_EVENT}
        schema["components"]["schemas"].pop("HTTPValidationError", None)
        schema["components"]["schemas"].pop("ValidationError", None)
        bounds.apply(schema["components"]["schemas"])
        if strict_fields:  # --strict-request-fields: what request_fields.py refuses
            for name in TOLERANT_BODIES:
                schema["components"]["schemas"][name]["additionalProperties"] = False
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
