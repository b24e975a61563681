"""vLLM's `--generation-config auto|vllm|FOLDER`: default sampling parameters from a generation_config.json."""

from __future__ import annotations

import json
import logging
import os

from ..param_checks import json_object

logger = logging.getLogger("replayllm.generation_config")
FILE = "generation_config.json"
# generation_config.json key -> SamplingParams field, with transformers' own default: a value equal to it is
# no setting (vLLM reads the file's difference from transformers' GenerationConfig, so the same keys drop out).
FIELDS = {"temperature": ("temperature", 1.0), "top_p": ("top_p", 1.0), "top_k": ("top_k", 50),
          "min_p": ("min_p", None), "repetition_penalty": ("repetition_penalty", 1.0),
          "max_new_tokens": ("max_tokens", None)}


def parse_overrides(text: str) -> dict:
    """vLLM's --override-generation-config: a JSON object of generation_config.json keys (FIELDS) -> their
    SamplingParams fields; ValueError for anything else (an unknown key is not ignored)."""
    return override_fields(json_object(text))


def override_fields(raw: dict) -> dict:
    """vLLM's override_generation_config dict (generation_config.json keys) -> SamplingParams fields; ValueError
    for a key this engine does not read."""
    if not isinstance(raw, dict):
        raise ValueError(f"override_generation_config must be a dict of generation_config.json keys, got {raw!r}")
    unknown = sorted(set(raw) - set(FIELDS))
    if unknown:
        raise ValueError(f"unknown generation config keys {unknown} (this server reads {sorted(FIELDS)})")
    return {FIELDS[key][0]: value for key, value in raw.items()}


def default_sampling_params(generation_config: str, model_path: str, overrides: dict | None = None) -> dict:
    """The sampling defaults `generation_config` selects: `auto` reads the model's file (none when it has no
    file), `vllm` none, any other value is a folder that must hold the file; then `overrides`
    (parse_overrides: --override-generation-config) win, as vLLM merges them. ValueError for a bad value."""
    return {**_from_file(generation_config, model_path), **(overrides or {})}


def _from_file(generation_config: str, model_path: str) -> dict:
    if generation_config == "vllm":
        return {}
    folder = model_path if generation_config == "auto" else generation_config
    path = os.path.join(folder, FILE)
    if not os.path.isfile(path):
        if generation_config == "auto":
            return {}
        raise ValueError(f"--generation-config {generation_config!r}: no {FILE} there (give 'auto', 'vllm' or a "
                         f"folder that holds {FILE})")
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return {field: raw[key] for key, (field, hf_default) in FIELDS.items()
            if raw.get(key) is not None and raw[key] != hf_default}


def log_defaults(defaults: dict, generation_config: str) -> None:
    """One INFO line at start-up, as vLLM logs the defaults it took from the model."""
    if defaults:
        logger.info("default sampling parameters from %s (--generation-config %s; a request that sets a field "
                    "overrides it): %s", FILE, generation_config, defaults)
