"""ResponseStore: the stored Responses API responses (in memory, least recently used dropped past a cap)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..http.errors import APIError

if TYPE_CHECKING:  # the CLI reads DEFAULT_MAX_STORED_RESPONSES: no pydantic models or engine imports here
    from .chat_messages import ChatMessage
    from .responses_bodies import ResponseObject

DEFAULT_MAX_STORED_RESPONSES = 1024  # `replayllm serve --max-stored-responses`


@dataclass(frozen=True)
class StoredResponse:
    response: ResponseObject
    # The conversation a follow-up continues: the previous one's, this request's input, then the answer
    # (no instructions: OpenAI does not carry them over).
    messages: tuple[ChatMessage, ...]


class ResponseStore:
    """id -> StoredResponse, at most `capacity` of them; a lookup (GET, previous_response_id) makes an entry the
    most recently used. One event loop uses it: no lock."""

    def __init__(self, capacity: int = DEFAULT_MAX_STORED_RESPONSES):
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"max_stored_responses must be an integer >= 1, got {capacity!r}")
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: StoredResponse) -> None:
        self._entries[entry.response.id] = entry
        self._entries.move_to_end(entry.response.id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str, param: str) -> StoredResponse:
        """The entry, or a 404 naming `param` (as vLLM: "Response with id '...' not found.")."""
        entry = self._entries.get(response_id)
        if entry is None:
            raise APIError(404, f"Response with id '{response_id}' not found.", param=param, code="not_found")
        self._entries.move_to_end(response_id)
        return entry
