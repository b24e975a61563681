"""OffloadedBodyRoute: a large JSON body is parsed and validated on the tokenizer pool, not on the event loop."""

from __future__ import annotations

import json
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.requests import Request

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
    try:
        data = json.loads(body)
    except json.JSONDecodeError as e:
        return RequestValidationError([{"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error",
                                        "input": {}, "ctx": {"error": e.msg}}], body=e.doc)
    except RecursionError:  # only without limits (a depth limit keeps json.loads far from the stack's end)
        raise bad_request("the request body nests arrays/objects too deep to parse", None, "limit_exceeded") from None
    value, errors = field.validate(data, {}, loc=("body",))
    return RequestValidationError(errors, body=data) if errors else value


class OffloadedBodyRoute(APIRoute):
    """An APIRoute whose JSON body, when at least the pool's small-input size in bytes, is parsed and validated
    on the tokenizer pool's large lane (a 100k-message chat body costs ~1 s of pydantic: on the event loop it
    would freeze every stream). The validated model is handed to FastAPI as the request's parsed JSON, which
    it accepts without validating again (pydantic does not revalidate model instances). Needs
    `app.state.tokenizer_pool`; smaller bodies take FastAPI's own path after the --max-json-depth check (every
    JSON body is checked before it is parsed: json.loads, pydantic and deepcopy recurse once per level)."""

    def get_route_handler(self):
        handler = super().get_route_handler()
        field = self.body_field
        if field is None:
            return handler

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
                request._json = parsed  # Starlette's cache of request.json(), which FastAPI reads
            elif limits is not None:  # a small body (< 64 KiB): its depth costs microseconds here
                try:
                    check(body, limits.max_json_depth)
                except NestedTooDeep as e:
                    raise too_deep(e) from None
            return await handler(request)

        return offloaded
