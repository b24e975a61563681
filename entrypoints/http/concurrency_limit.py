"""ConcurrencyLimit: an ASGI middleware answering 503 (OpenAI-style JSON) past --limit-concurrency requests."""

from __future__ import annotations

from starlette.responses import JSONResponse

from .errors import APIError

# Cheap routes that never reach the engine: an operator (or a liveness probe) still gets them when the server
# is saturated, which is when they matter most.
EXEMPT_PATHS = ("/health", "/ping", "/metrics", "/version")
RETRY_AFTER_S = "1"


def over_capacity(limit: int) -> APIError:
    return APIError(503, f"the server is at its limit of {limit} concurrent requests (--limit-concurrency); "
                         "retry later", code="service_unavailable")


class ConcurrencyLimit:
    """Counts the HTTP requests in flight (a streaming one until its last chunk is sent); one arriving when
    `limit` are in flight gets 503 with Retry-After and `Connection: close` (the client may be one of many
    idle connections the cap on connections is also reclaiming), before its body is read."""

    def __init__(self, app, limit: int, route_path):
        self.app = app
        self.limit = limit
        self.route_path = route_path  # scope -> the path without --root-path's prefix
        self.in_flight = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or self.route_path(scope) in EXEMPT_PATHS:
            return await self.app(scope, receive, send)
        if self.in_flight >= self.limit:
            err = over_capacity(self.limit)
            headers = {"Retry-After": RETRY_AFTER_S, "Connection": "close"}
            return await JSONResponse(err.body(), status_code=err.status, headers=headers)(scope, receive, send)
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
