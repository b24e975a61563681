"""vLLM's `vllm.inputs` import path: the prompt types `LLM.generate` takes (`from replayllm.inputs import
TokensPrompt`, as scripts written for vLLM import them)."""

from __future__ import annotations

from typing import TypedDict

from .outputs import TokensPrompt


class _TextPromptRequired(TypedDict):
    prompt: str


class TextPrompt(_TextPromptRequired, total=False):
    """A text prompt as a dict, as in vLLM: `{"prompt": "..."}` (`cache_salt`: vLLM's prefix-cache salt)."""

    cache_salt: str


PromptType = str | TextPrompt | TokensPrompt  # what one prompt of LLM.generate may be

__all__ = ["PromptType", "TextPrompt", "TokensPrompt"]
