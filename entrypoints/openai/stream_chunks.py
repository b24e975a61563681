"""ChunkFrame: one stream's SSE chunk bytes, built with msgspec from plain dicts (no pydantic per token)."""

from __future__ import annotations

import time

import msgspec

_ENCODE = msgspec.json.Encoder().encode


class ChunkFrame:
    """The `data: {...}\\n\\n` events of one streamed call. The fields every chunk repeats (id, object, created,
    model) are encoded once; each chunk encodes only its own fields, in the order the response models in
    openai_responses.py declare them (CompletionStreamResponse / ChatCompletionStreamResponse): the JSON is
    what `model_dump_json()` of those models gives, at a fraction of the cost (one small dict per chunk)."""

    def __init__(self, request_id: str, obj: str, model: str):
        self.created = int(time.time())  # one stamp for the whole stream, as vLLM's
        self._head = b"".join((b'data: {"id":', _ENCODE(request_id), b',"object":', _ENCODE(obj),
                               b',"created":', str(self.created).encode(), b',"model":', _ENCODE(model), b","))

    def event(self, rest: dict) -> bytes:
        """One event: the fixed fields, then `rest` (choices, usage, ...) in its order."""
        return self._head + _ENCODE(rest)[1:] + b"\n\n"


def usage_dict(prompt_tokens: int, completion_tokens: int) -> dict:
    """UsageInfo's JSON fields."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
