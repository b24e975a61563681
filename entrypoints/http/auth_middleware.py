"""The API key check and the per-route request counter: one pure ASGI middleware around the app."""

from __future__ import annotations

import hmac
import time

from fastapi.responses import JSONResponse

from ..openai.serving_admin import ADMIN_PATHS
from .errors import APIError
from .metrics import ServerMetrics

# Path prefixes that need the API key when one is set (the admin routes too: they can stop the engine serving).
KEYED_PATHS = ("/v1", "/tokenize", "/detokenize", "/inference", *ADMIN_PATHS)


def error_response(err: APIError) -> JSONResponse:
    """An APIError as its JSON body, status and extra headers."""
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def route_path(scope) -> str:
    """The path without --root-path's prefix (a request may come with it or, through a proxy, without)."""
    path, root = scope["path"], scope.get("root_path", "")
    return (path[len(root):] or "/") if root and path.startswith(root) else path


class AuthAndMetricsMiddleware:
    """Pure ASGI (streaming and disconnect detection pass through untouched): the bearer-key check for
    KEYED_PATHS when a key is set, the per-route/status request counter and the time to each response's start."""

    def __init__(self, app, api_key: str | None, metrics: ServerMetrics):
        self.app = app
        self.expected = api_key.encode() if api_key else None
        self.metrics = metrics

    def _authorized(self, scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":  # "Bearer KEY"; the scheme is case-insensitive (RFC 9110 11.1)
                scheme, _, key = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(key.strip(), self.expected)
        return False

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]  # an exception that escapes is answered 500 by the outer error middleware
        received = time.perf_counter()  # the request's head is in (uvicorn calls the app then)
        path = route_path(scope)

        async def send_and_record(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                self.metrics.on_http_response_start(path, time.perf_counter() - received)
            await send(message)

        try:
            if self.expected is not None and path.startswith(KEYED_PATHS) and not self._authorized(scope):
                err = APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                               code="invalid_api_key")
                await error_response(err)(scope, receive, send_and_record)
                return
            await self.app(scope, receive, send_and_record)
        finally:
            self.metrics.on_http_response(path, status[0])
