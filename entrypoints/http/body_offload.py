"""OffloadedBodyRoute: a large JSON body is parsed and validated on the tokenizer pool, not on the event loop."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi.datastructures import DefaultPlaceholder
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import HTTPException, RequestValidationError
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ...engine.tokenizer_pool import TokenizerPool
from ...json_depth import NestedTooDeep, check
from .body_counts import BodyCounter
from .errors import APIError, bad_request
from .limits import RequestLimits, check_raw_counts

_COUNTER = BodyCounter()


def _is_json(request: Request) -> bool:
    """The content types FastAPI parses as JSON (it also does with none; a large body without one stays its)."""
    kind = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


def too_deep(e: NestedTooDeep) -> APIError:
    """--max-json-depth's 400, naming the top-level field that nests too deep."""
    return bad_request(str(e), e.key, "limit_exceeded")


def _parse(field, body: bytes, limits: RequestLimits | None) -> Any:
    """What FastAPI does with a JSON body (json.loads, then the body field's validation), as one pool job:
    the validated model, or the RequestValidationError FastAPI would raise (same error entries). First the
    nesting depth and the list caps (an APIError), checked in a helper process: a body too deep or with a list
    far over its cap is never parsed here."""
    if limits is not None:
        try:
            check_raw_counts(_COUNTER.skeleton(body, limits.max_json_depth), limits)
        except NestedTooDeep as e:
            raise too_deep(e) from None
    data = _loads(body)
    if isinstance(data, RequestValidationError):
        return data
    return _validated(field, data)


def _loads(body: bytes) -> Any:
    """json.loads(body), or FastAPI's RequestValidationError for a body that is not JSON (its HTTPException for
    bytes that are not UTF-8)."""
    try:
        return json.loads(body)
    except json.JSONDecodeError as e:
        return RequestValidationError([{"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error",
                                        "input": {}, "ctx": {"error": e.msg}}], body=e.doc)
    except RecursionError:  # only without limits (a depth limit keeps json.loads far from the stack's end)
        raise bad_request("the request body nests arrays/objects too deep to parse", None, "limit_exceeded") from None
    except UnicodeDecodeError:  # bytes that are not UTF-8: FastAPI's own answer to them
        raise HTTPException(status_code=400, detail="There was an error parsing the body") from None


def _validated(field, data: Any) -> Any:
    """The body field's validation of parsed JSON, as FastAPI runs it for one non-embedded body (loc "body")."""
    value, errors = field.validate(data, {}, loc=("body",))
    return RequestValidationError(errors, body=data) if errors else value


_PARAM_LISTS = ("query_params", "path_params", "header_params", "cookie_params", "dependencies")
_SPECIAL_PARAMS = ("websocket_param_name", "http_connection_param_name", "response_param_name",
                   "background_tasks_param_name", "security_scopes_param_name")


def direct_call(route: APIRoute) -> tuple[str, str | None] | None:
    """(the body parameter's name, the Request parameter's or None) when `route`'s endpoint is an async
    function of one JSON body (and optionally the Request) with FastAPI's default response class and no response
    model or status code: all FastAPI's per-request machinery (dependency solving, endpoint-context and serializer
    closures, telemetry hooks) does for it is the body's validation, which OffloadedBodyRoute then does itself
    (~50-70 µs of a ~1 ms /v1/completions intake on the CPU box, session 26). None for any other route."""
    dep = route.dependant
    if (len(dep.body_params) != 1 or route.response_model is not None or route.status_code is not None
            or not isinstance(route.response_class, DefaultPlaceholder)
            or not asyncio.iscoroutinefunction(route.endpoint)
            or any(getattr(dep, name, None) for name in (*_PARAM_LISTS, *_SPECIAL_PARAMS))):
        return None
    return dep.body_params[0].name, dep.request_param_name


class OffloadedBodyRoute(APIRoute):
    """An APIRoute whose JSON body, when at least the pool's small-input size in bytes, is parsed and validated
    on the tokenizer pool's large lane (a 100k-message chat body costs ~1 s of pydantic: on the event loop it
    would freeze every stream). Needs `app.state.tokenizer_pool`; smaller bodies are parsed here after the
    --max-json-depth check (every JSON body is checked before it is parsed: json.loads, pydantic and deepcopy
    recurse once per level). A route of one body (`direct_call`: the generation and tokenize routes) then gets
    its endpoint called here with the validated model, as FastAPI would call it, without FastAPI's per-request
    machinery around that call (a JSON object body only: anything else, e.g. `null`, takes FastAPI's path and its
    error entries). Other routes get the validated model as the request's parsed JSON, which FastAPI accepts
    without validating again (pydantic does not revalidate model instances)."""

    def get_route_handler(self):
        handler = super().get_route_handler()
        field = self.body_field
        if field is None:
            return handler
        direct = direct_call(self)
        endpoint = self.endpoint

        async def call(value: Any, request: Request) -> Response:
            body_name, request_name = direct
            result = await endpoint(**({body_name: value, request_name: request} if request_name
                                       else {body_name: value}))
            return result if isinstance(result, Response) else JSONResponse(jsonable_encoder(result))

        async def offloaded(request: Request):
            if not _is_json(request):
                return await handler(request)
            pool: TokenizerPool | None = getattr(request.app.state, "tokenizer_pool", None)
            limits: RequestLimits | None = getattr(request.app.state, "limits", None)
            body = await request.body()
            if pool is not None and not pool.is_small(len(body)):
                parsed = await pool.run(_parse, field, body, limits, size=len(body))
                if isinstance(parsed, RequestValidationError):
                    raise parsed
                if direct is not None:
                    return await call(parsed, request)
                request._json = parsed  # Starlette's cache of request.json(), which FastAPI reads
                return await handler(request)
            if limits is not None:  # a small body (< 64 KiB): its depth costs microseconds here
                try:
                    check(body, limits.max_json_depth)
                except NestedTooDeep as e:
                    raise too_deep(e) from None
            if direct is not None and body:
                data = _loads(body)
                if isinstance(data, RequestValidationError):
                    raise data
                if isinstance(data, dict):
                    value = _validated(field, data)
                    if isinstance(value, RequestValidationError):
                        raise value
                    return await call(value, request)
                request._json = data  # FastAPI's own path for the rest (its error entries), not parsed twice
            return await handler(request)

        return offloaded
