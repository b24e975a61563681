"""Turn a model name (embedded id, local directory or HF hub id) into a local checkpoint directory."""

from __future__ import annotations

import os

from .embedded_model import is_embedded, materialize

# Files an inference checkpoint needs; PyTorch .bin weights only for a repo without safetensors ones (as vLLM).
_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]
_PT_PATTERNS = ["pytorch_model*.bin", "pytorch_model.bin.index.json"]


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def resolve_model_path(model: str) -> str:
    if is_embedded(model):
        return materialize(model)
    if os.path.isdir(model):
        return model
    try:
        from huggingface_hub import snapshot_download

        path = snapshot_download(model, local_files_only=_hub_offline(), allow_patterns=_ALLOW_PATTERNS)
    except Exception as e:  # bad repo id, no network, not cached, gated, ...
        raise _not_found(model, e) from e
    if any(name.endswith(".safetensors") for name in os.listdir(path)):
        return path
    try:  # no safetensors weights (or none at all: a tokenizer's repo): the PyTorch ones, where there are any
        return snapshot_download(model, local_files_only=_hub_offline(), allow_patterns=_ALLOW_PATTERNS + _PT_PATTERNS)
    except Exception:  # not cached offline, no network now: what was found first
        return path


def _not_found(model: str, e: Exception) -> ValueError:
    offline = os.environ.get("HF_HUB_OFFLINE", "")
    cause = (str(e).strip().splitlines() or [""])[0]  # the hub client's first line (it adds a paragraph of advice)
    return ValueError(
        f"model {model!r} was not found: it is not a local directory, and it could not be fetched "
        f"from nor found in the Hugging Face cache (HF_HUB_OFFLINE={offline!r}; with HF_HUB_OFFLINE=1 "
        f"only already-cached models are used). Cause: {type(e).__name__}: {cause}"
    )
