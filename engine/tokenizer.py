"""Tokenizer loading (HF AutoTokenizer from the model or tokenizer directory) and bad-words tokenization."""

from __future__ import annotations

import json
import os

from ..config import EngineConfig
from ..context_limits import prompt_too_long
from ..model_source import resolve_model_path


def load_tokenizer(config: EngineConfig):
    from transformers import AutoTokenizer

    path = resolve_model_path(config.tokenizer) if config.tokenizer else config.model_config.path
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"could not load a tokenizer from {path!r} ({e}); pass tokenizer=... or "
                         "skip_tokenizer_init=True for token-id prompts") from e
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = processor_chat_template(path)
    return tokenizer


def processor_chat_template(path: str) -> str | None:
    """A multimodal checkpoint's chat template where its tokenizer has none: the processor's, in the folder's
    chat_template.json ({"chat_template": ...}; as vLLM falls back to the processor's). None without one."""
    file = os.path.join(path, "chat_template.json")
    try:
        with open(file, encoding="utf-8") as f:
            template = json.load(f).get("chat_template")
    except (OSError, ValueError, AttributeError):
        return None
    return template if isinstance(template, str) and template else None


def encode_texts(tokenizer, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    """`[tokenizer.encode(t, add_special_tokens=...) for t in texts]`, in one call of the Rust tokenizer for a
    fast (HF `tokenizers`) tokenizer: it releases the GIL for the whole batch, and skips transformers' per-call
    overhead (~0.1 ms, which 20k bad words make seconds) and its per-token mask lists (which hold the GIL for
    a 5 MB prompt). The ids are the same: transformers' fast `encode` is this call when nothing truncates or
    pads (tests/engine/test_tokenizer_pool.py compares them)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not texts:
        return [tokenizer.encode(t, add_special_tokens=add_special_tokens) for t in texts]
    return [e.ids for e in backend.encode_batch(texts, add_special_tokens=add_special_tokens)]


def encode_prompt(tokenizer, text: str, add_special_tokens: bool, max_model_len: int | None = None) -> list[int]:
    """One text's ids (as encode_texts). With max_model_len, a prompt that cannot fit (the engine's check) is
    refused from its length, before its ids become a Python list (1.3M ints for 5 MB, built holding the GIL)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
        if max_model_len is not None and len(ids) >= max_model_len:
            raise prompt_too_long(len(ids), max_model_len)
        return ids
    encoding = backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]
    if max_model_len is not None and len(encoding) >= max_model_len:
        raise prompt_too_long(len(encoding), max_model_len)
    return encoding.ids


def tokenize_bad_words(tokenizer, words: list[str]) -> list[list[int]]:
    """Each bad word is banned as it would appear mid-text (" word") and at the start ("word")."""
    if tokenizer is None:
        raise ValueError("bad_words needs a tokenizer; this engine was built with skip_tokenizer_init=True")
    variants = [v for word in words for v in (word, " " + word.lstrip())]
    out: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    for ids in encode_texts(tokenizer, variants, add_special_tokens=False):
        if ids and tuple(ids) not in seen:
            seen.add(tuple(ids))
            out.append(ids)
    return out
