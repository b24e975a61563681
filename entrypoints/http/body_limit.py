"""BodySizeLimit: an ASGI middleware answering 413 to request bodies over --max-request-body-bytes (and asking
for a heap trim once a large body's request is answered: heap_trim.py)."""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse

from .errors import APIError
from .heap_trim import LARGE_BODY, TRIMMER

TOO_LARGE = 413


def too_large(limit: int, size: int | None = None) -> APIError:
    """The 413: `size` from Content-Length, or None for a body sent without one (refused once past `limit`)."""
    got = f"{size} bytes" if size is not None else f"more than {limit} bytes (sent without Content-Length)"
    return APIError(TOO_LARGE, f"the request body is too large: {got}; this server accepts at most {limit} bytes "
                               "(--max-request-body-bytes)", code="request_too_large")


class BodySizeLimit:
    """A declared Content-Length over the limit is refused before the body is read; a body without one
    (chunked) is counted as it arrives and refused as soon as it passes the limit, so at most `limit` bytes
    are ever buffered. The route's body reader sees an HTTPException(413), which the app's handler renders."""

    def __init__(self, app, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = None  # h11 already refuses a malformed Content-Length
                if declared is not None and declared > self.limit:
                    err = too_large(self.limit, declared)
                    await JSONResponse(err.body(), status_code=TOO_LARGE, headers={"Connection": "close"})(
                        scope, receive, send)
                    return
        seen = 0

        async def counting_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise HTTPException(TOO_LARGE, too_large(self.limit).message)
            return message

        try:
            await self.app(scope, counting_receive, send)
        finally:
            if seen >= LARGE_BODY:  # answered: what parsing and tokenizing it took is free, give it back
                TRIMMER.request()
