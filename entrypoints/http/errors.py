"""APIError: an error in OpenAI's JSON shape `{"error": {"message", "type", "param", "code"}}` with its status."""

from __future__ import annotations

import re
from collections.abc import Iterable

# OpenAI's `type` values: client errors are "invalid_request_error", ours are "server_error".
INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"
MAX_MESSAGE_CHARS = 1024  # longer messages (one that quotes a huge input) are cut: error bodies stay small


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str | None = None, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        message = _printable(message)
        if len(message) > MAX_MESSAGE_CHARS:
            message = f"{message[:MAX_MESSAGE_CHARS - 40]}... ({len(message)} characters, cut)"
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or (SERVER_ERROR if status >= 500 else INVALID_REQUEST)
        param = None if param is None else _printable(param)
        self.param = param if param is None or len(param) <= 200 else param[:197] + "..."
        self.code = code
        self.headers = headers  # extra response headers (a 503's Retry-After)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _printable(text: str) -> str:
    """`text` with what UTF-8 cannot encode (a lone surrogate quoted from the input) as a \\udXXX escape."""
    return text if text.isascii() else text.encode("utf-8", "backslashreplace").decode("utf-8")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_value_error(e: Exception, fields: Iterable[str], aliases: dict[str, str] | None = None) -> APIError:
    """A ValueError/NotImplementedError from SamplingParams or the engine -> 400. Their messages start with
    the offending option's name ("temperature must be ...", "n must be 1 with ..."), which becomes `param`
    when it is one of the request's fields (or, through `aliases`, stands for one: "prompt" -> "messages")."""
    message = str(e) or type(e).__name__
    m = re.match(r"[A-Za-z_]+", message)
    word = getattr(e, "field", None) or (m.group(0) if m else "")  # context_limits.ContextLengthError names it
    word = (aliases or {}).get(word, word)
    param = word if word in set(fields) else None
    code = "not_implemented" if isinstance(e, NotImplementedError) else None
    return bad_request(message, param=param, code=code)
