"""The errors for a request that does not fit the model's context (max_model_len), worded as vLLM's server words
them: OpenAI and vLLM clients (and their tests) look for "maximum context length" in the message."""

from __future__ import annotations


class ContextLengthError(ValueError):
    """A ValueError whose message does not start with the option's name: `field` names it (the server's 400
    `param`: entrypoints/http/errors.from_value_error)."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


def prompt_too_long(prompt_len: int, max_model_len: int) -> ContextLengthError:
    """A prompt that leaves no room for one generated token (SamplingParams.verify_for_engine, the tokenizer)."""
    return ContextLengthError(
        f"This model's maximum context length is {max_model_len} tokens. However, your request has {prompt_len} "
        f"input tokens: the prompt ({prompt_len} tokens) is longer than max_model_len ({max_model_len}) allows (the "
        "prompt plus at least one generated token must fit)", "prompt")


def max_tokens_too_large(max_tokens: int, prompt_len: int, max_model_len: int) -> ContextLengthError:
    """The server's check of a `max_tokens` / `max_completion_tokens` the body set (vLLM's 400): the prompt plus
    that many tokens must fit max_model_len. The offline `LLM` instead stops at max_model_len (finish "length"),
    as vLLM's does."""
    return ContextLengthError(
        f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum context length is "
        f"{max_model_len} tokens and your request has {prompt_len} input tokens ({max_tokens} > {max_model_len} - "
        f"{prompt_len})", "max_tokens")
