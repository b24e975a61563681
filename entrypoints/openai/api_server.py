"""The OpenAI-compatible HTTP app: `build_app(...)` (FastAPI); `replayllm serve` runs it (server_main.py)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ... import __version__
from ...config import EngineConfig
from ...engine.async_engine import AsyncLLMEngine
from ...engine.core_client import EngineCoreClient
from ...engine.llm_engine import LLMEngine
from ...engine.protocol import EngineClient
from ...engine.request_stream import ClientDisconnected
from ...engine.tokenizer_pool import PoolClosedError, ServerBusyError, TokenizerPoolConfig
from ...routing_replay import RouteShape
from ..http.auth_middleware import KEYED_PATHS, AuthAndMetricsMiddleware, error_response, route_path
from ..http.body_limit import BodySizeLimit
from ..http.body_offload import OffloadedBodyRoute
from ..http.concurrency_limit import ConcurrencyLimit
from ..http.connection_limits import ConnectionLimits
from ..http.errors import APIError, bad_request
from ..http.intake_gate import gate_from_env
from ..http.limits import RequestLimits
from ..http.metrics import ServerMetrics
from ..http.request_log import enable_request_log
from ..http.stats_logger import StatsLogger
from .generate_protocol import GenerateRequest
from .input_check import unicode_key_error
from .openai_protocol import FIELD_HINTS, ChatCompletionRequest, CompletionRequest
from .openai_responses import ModelCard, ModelList
from .openapi_doc import EngineBounds, document_responses
from .request_fields import ignored_header
from .responses_protocol import ResponsesRequest
from .responses_store import DEFAULT_MAX_STORED_RESPONSES, ResponseStore
from .serving_admin import admin_router
from .serving_chat import ChatServer
from .serving_completions import CompletionServer
from .serving_generate import GenerateServer
from .serving_responses import ResponsesServer
from .serving_tokenize import TokenizeServer
from .sse_response import ReplayFastAPI, SSEResponse
from .streaming import SSEBody, engine_error
from .tokenize_protocol import DetokenizeRequest, TokenizeRequest
from .tool_calling import ToolServing

logger = logging.getLogger("replayllm.server")
API_KEY_ENV = "REPLAYLLM_API_KEY"
CLIENT_CLOSED = 499  # nginx's "client closed request": what a disconnected non-streaming call is counted as


def validation_error(errors: list[dict]) -> APIError:
    """FastAPI/pydantic errors (bad JSON, wrong types, unknown fields) -> one OpenAI-style 400."""
    if not errors:
        return bad_request("invalid request body")
    first = errors[0]
    kind = first.get("type", "")
    loc = _clean_loc(first.get("loc", ()))
    if kind == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", first.get("msg", ""))
        return bad_request(f"the request body is not valid JSON: {detail}", code="invalid_json")
    if kind == "string_unicode" and (err := unicode_key_error(first.get("input"), loc)) is not None:
        return err  # a lone surrogate in a field name
    if not loc:
        if kind == "missing":
            return bad_request("a JSON request body is required")
        if isinstance(first.get("input"), (str, bytes)):  # a form post (curl -d without a JSON content type)
            return bad_request("the request body must be a JSON object, sent with 'Content-Type: application/json' "
                               "(this one was read as text: a form post, or a JSON string)")
        return bad_request(f"the request body must be a JSON object ({first.get('msg', '')})")
    param = ".".join(loc)
    if kind == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param, "unknown_parameter")
    if kind == "missing":
        return bad_request(f"'{param}' is a required property", param)
    if len(errors) > 1:  # a union type failed in several ways: say what the field accepts
        for i in range(len(loc) - 1, -1, -1):
            if loc[i] in FIELD_HINTS:
                param = ".".join(loc[: i + 1])
                value = _value_at(first.get("input"), errors, loc[: i + 1])
                return bad_request(f"'{param}' must be {FIELD_HINTS[loc[i]]}, got {value}", param)
    return bad_request(f"'{param}': {first.get('msg', 'invalid value')} (got {_short(first.get('input'))})",
                       param)


def _clean_loc(loc) -> list[str]:
    """Drop where the value came from ("body", "query": /sleep?level=) and pydantic's union-member tags ("str",
    "list[int]", "TextPart") from an error location."""
    return [str(p) for p in loc if p not in ("body", "query")
            and not (isinstance(p, str) and ("[" in p or p in _TYPE_TAGS or p[:1].isupper()))]


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict"}


def _value_at(default, errors: list[dict], loc: list[str]) -> str:
    """The offending value of the union field at `loc` (the error whose location ends there, if any)."""
    for e in errors:
        if _clean_loc(e.get("loc", ())) == loc:
            return _short(e.get("input"))
    return _short(default)


def _short(value, limit: int = 80) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def build_app(config: EngineConfig | None = None, api_key: str | None = None, *,
              engine: LLMEngine | None = None, engine_client: EngineCoreClient | None = None,
              served_model_names: list[str] | None = None,
              enable_log_requests: bool = False, chat_template: str | None = None,
              default_sampling: dict | None = None, root_path: str = "", cors: dict | None = None,
              limits: RequestLimits | None = None, connections: ConnectionLimits | None = None,
              log_stats_interval: float | None = None,
              tokenizer_pool: TokenizerPoolConfig | None = None,
              max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES,
              strict_request_fields: bool = False, reasoning_parser: str | None = None,
              tools: ToolServing | None = None) -> FastAPI:
    """The FastAPI app around one engine. engine_client: an engine core process (what `replayllm serve` uses);
    else an in-process engine loop thread around `engine` (built from `config` unless given; tests that reach
    into the engine use this). The engine (loop or process) starts and stops with the app's lifespan.
    served_model_names: the names requests may use (default: the config's
    served_model_name); the first is the one responses report. enable_log_requests: one INFO line per request
    (id and sizes, never text). chat_template: Jinja source used instead of the tokenizer's. default_sampling:
    SamplingParams fields for requests that do not set them (--generation-config). root_path: a proxy's path
    prefix. cors: CORSMiddleware's keyword arguments (None: no CORS headers). limits: the per-request caps
    (default: RequestLimits()). log_stats_interval: seconds between stats lines (None: none; `replayllm serve`
    logs every 10 s unless --disable-log-stats). tokenizer_pool: the in-process engine's tokenizer pool (an
    EngineCoreClient brings its own). max_stored_responses: the Responses API's stored responses kept (the least
    recently used dropped past it). strict_request_fields: unknown body fields are 400s instead of ignored and
    named in the x-replayllm-ignored-fields header (request_fields.py). reasoning_parser: "qwen3" or
    "deepseek_r1": chat responses split <think> text into reasoning_content (reasoning_parser.py; None: the
    engine config's, which also holds structured outputs back until the reasoning ends). tools: the
    tool-calling flags (--enable-auto-tool-choice, --tool-call-parser, ...; tool_calling.py)."""
    # Under --api-server-count the first process counts the engine's steps (/metrics sums the processes).
    metrics = ServerMetrics(count_steps=engine_client is None or engine_client.client_index == 0)
    client, config = _engine_client(config, engine, engine_client, metrics, tokenizer_pool)
    names = tuple(served_model_names or (config.served_model_name,))
    enable_request_log(enable_log_requests)
    metrics.attach_engine(lambda: client.snapshot)
    limits = (limits or RequestLimits()).resolved(config.max_model_len)
    chat = ChatServer(client, names, limits, default_sampling, chat_template, strict_request_fields,
                      reasoning_parser or config.reasoning_parser, tools)
    servers = _Servers(
        completions=CompletionServer(client, names, limits, default_sampling, strict_request_fields), chat=chat,
        responses=ResponsesServer(chat, ResponseStore(max_stored_responses)),
        generate=GenerateServer(client, names, limits, default_sampling, strict_request_fields),
        tokenization=TokenizeServer(client, names, config.max_model_len, limits, chat_template,
                                    strict_request_fields))
    stats_logger = (StatsLogger(metrics, lambda: client.snapshot, log_stats_interval)
                    if log_stats_interval is not None else None)
    app = ReplayFastAPI(title="replayllm", version=__version__, lifespan=_lifespan(client, stats_logger),
                        root_path=root_path or "")
    app.router.route_class = OffloadedBodyRoute  # large JSON bodies parsed on the tokenizer pool
    _set_state(app, client, metrics, limits, stats_logger)
    _add_middlewares(app, limits, connections, api_key, metrics, cors)
    _add_error_handlers(app)
    _add_generation_routes(app, servers)
    _add_tokenize_routes(app, servers.tokenization)
    _add_model_routes(app, config, names)
    _add_health_routes(app, client, metrics)
    app.include_router(admin_router(client))  # /sleep, /wake_up, /is_sleeping, /update_weights_from_disk
    bounds = EngineBounds(config.model_config.vocab_size, config.max_logprobs, limits,
                          RouteShape.of(config.model_config))
    document_responses(app, KEYED_PATHS if api_key else None, bounds, strict_request_fields)
    return app


@dataclass(frozen=True)
class _Servers:
    """The app's serving objects, one per endpoint family (each holds the engine client)."""

    completions: CompletionServer
    chat: ChatServer
    responses: ResponsesServer
    generate: GenerateServer
    tokenization: TokenizeServer


def _engine_client(config: EngineConfig | None, engine: LLMEngine | None, engine_client: EngineCoreClient | None,
                   metrics: ServerMetrics, tokenizer_pool: TokenizerPoolConfig | None
                   ) -> tuple[EngineClient, EngineConfig]:
    """The engine the app serves and its config: the core process's client as given (counting into `metrics`),
    else an engine loop thread around `engine` (built from `config` unless given)."""
    if engine_client is not None:
        engine_client.stats = metrics
        return engine_client, engine_client.config
    if engine is None:
        if config is None:
            raise ValueError("build_app needs an EngineConfig, an LLMEngine or an EngineCoreClient")
        engine = LLMEngine(config)
    return AsyncLLMEngine(engine, stats=metrics, tokenizer_pool=tokenizer_pool), engine.config


def _set_state(app: FastAPI, client: EngineClient, metrics: ServerMetrics, limits: RequestLimits,
               stats_logger: StatsLogger | None) -> None:
    """What app.state carries: the large-body route reads the tokenizer pool; tests reach the engine."""
    app.state.async_engine = client
    app.state.tokenizer_pool = pool = client.tokenizer_pool
    app.state.intake_gate = gate_from_env(pool.config.small_input_chars) if pool is not None else None
    app.state.metrics = metrics
    app.state.limits = limits
    app.state.stats_logger = stats_logger


def _lifespan(client: EngineClient, stats_logger: StatsLogger | None):
    """The app's lifespan: the engine (and the stats line's task) run while the app does."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        client.start()
        stats_task = asyncio.create_task(stats_logger.run()) if stats_logger is not None else None
        try:
            yield
        finally:
            if stats_task is not None:
                stats_task.cancel()
            await client.shutdown()

    return lifespan


def _add_middlewares(app: FastAPI, limits: RequestLimits, connections: ConnectionLimits | None,
                     api_key: str | None, metrics: ServerMetrics, cors: dict | None) -> None:
    """Each added one wraps the ones before it: the key check and the counter outside the body and concurrency
    limits (a 401 comes first; 413s and 503s are counted), CORS outermost when on."""
    app.add_middleware(BodySizeLimit, limit=limits.max_request_body_bytes)  # inside: 401 first, 413s counted
    app.add_middleware(ConcurrencyLimit, limit=(connections or ConnectionLimits()).limit_concurrency,
                       route_path=route_path)  # 503s counted, 401 first
    app.add_middleware(AuthAndMetricsMiddleware, api_key=api_key, metrics=metrics)
    if cors is not None:  # outermost: preflights are answered before the key check (browsers send no key there)
        app.add_middleware(CORSMiddleware, **cors)


def _add_error_handlers(app: FastAPI) -> None:
    """Every error as an OpenAI-style JSON body (errors.APIError's shape)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(ServerBusyError)
    @app.exception_handler(PoolClosedError)
    async def _pool_error(request: Request, exc: Exception):  # a large body's parsing (OffloadedBodyRoute)
        return error_response(engine_error(exc, ()))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return error_response(validation_error(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status_code)
        response = error_response(APIError(exc.status_code, str(exc.detail), code=code))
        response.headers.update(exc.headers or {})  # 405's Allow
        return response

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        logger.exception("unhandled error on %s", request.url.path)
        return error_response(APIError(500, f"internal server error: {type(exc).__name__}"))


async def _respond(result, body=None) -> Response:
    """The route's response; with `body`, the x-replayllm-ignored-fields header when something was ignored."""
    if isinstance(result, SSEBody):
        response = SSEResponse(result)
    elif isinstance(result, Response):  # rendered already (a /tokenize body, on the tokenizer pool)
        response = result
    else:
        response = JSONResponse(result.model_dump(mode="json"))
    response.headers.update(ignored_header(body))
    return response


async def _generation(call: Awaitable, body=None) -> Response:
    """A generation route's answer: `call` (a serving object's create) rendered by _respond, or an empty
    CLIENT_CLOSED when the client went away before a non-streamed result was ready."""
    try:
        return await _respond(await call, body)
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED)


def _with_request_id(body, request: Request):
    """vLLM's X-Request-Id header: the base of the response's id, over the body's request_id."""
    header = request.headers.get("x-request-id")
    if header:
        if len(header) > 256 or not header.isascii() or not header.isprintable() or " " in header:
            raise bad_request("X-Request-Id must be 1-256 printable ASCII characters without spaces",
                              "request_id")
        body.request_id = header
    return body


def _add_generation_routes(app: FastAPI, servers: _Servers) -> None:
    """The routes that queue engine requests (and the Responses API's stored-response lookup)."""

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request):
        return await _generation(servers.completions.create(_with_request_id(body, request), request.receive), body)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request):
        return await _generation(servers.chat.create(_with_request_id(body, request), request.receive), body)

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request):
        return await _generation(servers.responses.create(body, request.receive), body)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str):
        return await _respond(servers.responses.retrieve(response_id))

    @app.post("/inference/v1/generate")
    async def generate_tokens(body: GenerateRequest, request: Request):
        return await _generation(servers.generate.create(body, request.receive), body)


def _add_tokenize_routes(app: FastAPI, tokenization: TokenizeServer) -> None:
    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        return await _respond(await tokenization.tokenize(body), body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return await _respond(await tokenization.detokenize(body), body)


def _add_model_routes(app: FastAPI, config: EngineConfig, names: tuple[str, ...]) -> None:
    def model_card(name: str) -> ModelCard:
        return ModelCard(id=name, root=config.model, max_model_len=config.max_model_len)

    @app.get("/v1/models")
    async def list_models():  # every served name, as vLLM lists them
        return JSONResponse(ModelList(data=[model_card(n) for n in names]).model_dump(mode="json"))

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str):
        if model_id not in names:
            raise APIError(404, f"The model `{model_id}` does not exist", param="model", code="model_not_found")
        return JSONResponse(model_card(model_id).model_dump(mode="json"))


def _add_health_routes(app: FastAPI, client: EngineClient, metrics: ServerMetrics) -> None:
    """Liveness, version and the Prometheus counters (no API key: outside KEYED_PATHS)."""

    @app.get("/health")
    async def health():
        if not client.is_running:
            raise APIError(503, "the engine is not running", code="engine_unavailable")
        return Response(status_code=200)

    @app.get("/ping")
    async def ping():  # vLLM's (SageMaker's) liveness route: /health under another name
        return await health()

    @app.post("/ping")
    async def ping_post():  # its own function: FastAPI names an operation after it (ids must be unique)
        return await health()

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics")
    async def get_metrics():
        return Response(metrics.render(), media_type=metrics.content_type)
