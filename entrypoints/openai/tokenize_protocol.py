"""Request bodies of vLLM's /tokenize (completion or chat style, told apart by their fields) and /detokenize; the
validation policy is openai_protocol.py's."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, Discriminator, Tag

from ..http.errors import bad_request
from .openai_protocol import _ChatPrompt
from .protocol_fields import Ids, _Body, _ranged


class TokenizeCompletionRequest(_Body):
    """vLLM's /tokenize, completion style: one text."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool | None = True
    return_token_strs: bool | None = False  # also the tokenizer's string for each id


class TokenizeChatRequest(_ChatPrompt):
    """vLLM's /tokenize, chat style: the messages rendered as /v1/chat/completions renders them."""

    model: str | None = None
    return_token_strs: bool | None = False


def _tokenize_style(body: Any) -> str:
    """Which /tokenize model a body is for. A body with both or neither of `prompt` and `messages` fits
    neither; it is refused here, with a message saying so, instead of with one model's errors."""
    if isinstance(body, BaseModel):
        return type(body).__name__
    if not isinstance(body, dict):
        return TokenizeCompletionRequest.__name__  # a non-object body: that model's error says "JSON object"
    if "prompt" in body and "messages" in body:
        raise bad_request("give either 'prompt' (completion style) or 'messages' (chat style), not both",
                          "messages")
    if "prompt" not in body and "messages" not in body:
        raise bad_request("'prompt' or 'messages' is a required property", "prompt")
    return (TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest).__name__


# The tags are the class names: validation errors drop capitalised location parts (api_server._clean_loc).
TokenizeRequest = Annotated[Annotated[TokenizeCompletionRequest, Tag("TokenizeCompletionRequest")]
                            | Annotated[TokenizeChatRequest, Tag("TokenizeChatRequest")],
                            Discriminator(_tokenize_style)]


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: Ids = _ranged(..., items_minimum=0)
