"""Tokenizer loading (HF AutoTokenizer from the model or tokenizer directory) and bad-words tokenization."""

from __future__ import annotations

from ..config import EngineConfig
from ..model_source import resolve_model_path


def load_tokenizer(config: EngineConfig):
    from transformers import AutoTokenizer

    path = resolve_model_path(config.tokenizer) if config.tokenizer else config.model_config.path
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"could not load a tokenizer from {path!r} ({e}); pass tokenizer=... or "
                         "skip_tokenizer_init=True for token-id prompts") from e


def tokenize_bad_words(tokenizer, words: list[str]) -> list[list[int]]:
    """Each bad word is banned as it would appear mid-text (" word") and at the start ("word")."""
    if tokenizer is None:
        raise ValueError("bad_words needs a tokenizer; this engine was built with skip_tokenizer_init=True")
    out: list[list[int]] = []
    for word in words:
        for variant in (word, " " + word.lstrip()):
            ids = tokenizer.encode(variant, add_special_tokens=False)
            if ids and ids not in out:
                out.append(ids)
    return out
