"""Ground floor: ConfigJson, a checkpoint's config.json read without transformers, for the model types this build
runs; `read_hf_config` falls back to transformers' AutoConfig for any other.

Why: `AutoConfig.from_pretrained` in a fresh process imports transformers' configuration machinery, and on the
H200 image (no .pyc files, PYTHONDONTWRITEBYTECODE=1; sklearn, sympy and torch.distributed pulled in) that took
8.8-11.7 s, the longest part of a served cold start's critical path (docs/benchmarks.md, session 21). The engine
reads ~25 plain fields of the config (sizes, eps, rope, biases, dtype, EOS, MoE layout, sliding window); for Qwen3,
Qwen2, Llama, Mistral and Qwen3-MoE this module gives the values transformers' config class gives: config.json's
keys over the class's defaults for the keys the engine reads, with the class's alias (Qwen3-MoE's
`num_local_experts` is `num_experts`) and its derived values (`num_key_value_heads` = `num_attention_heads` when
null (when absent: Qwen's default 32, Llama's null, Mistral's 8), Llama's and Mistral's `head_dim` = hidden_size //
num_attention_heads, Qwen3-MoE's `mlp_only_layers` null = []). Every other key of config.json is kept as an
attribute, as transformers keeps unknown keys. tests/models/test_hf_config_json.py compares the two field by field
on many config.json variants with whichever transformers is installed.

Imports no folder of the package, and nothing heavy (no transformers unless it falls back)."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace
from typing import Any

# transformers' class defaults (5.x) for the keys the engine reads, per config.json `model_type`.
_QWEN_SIZES = {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
               "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 32768}
_QWEN_WINDOW = {"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28}
_COMMON = {"hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False,
           "eos_token_id": None, "bos_token_id": None, "rope_scaling": None}
_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3": {**_COMMON, **_QWEN_SIZES, "head_dim": 128, **_QWEN_WINDOW},
    "qwen2": {**_COMMON, **_QWEN_SIZES, **_QWEN_WINDOW},
    "llama": {**_COMMON, "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
              "num_hidden_layers": 32, "num_attention_heads": 32, "max_position_embeddings": 2048,
              "mlp_bias": False, "bos_token_id": 1, "eos_token_id": 2},
    "mistral": {**_COMMON, "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                "max_position_embeddings": 131072, "bos_token_id": 1, "eos_token_id": 2, "sliding_window": 4096},
    "qwen3_moe": {**_COMMON, **_QWEN_SIZES, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24,
                  "num_key_value_heads": 4, "use_sliding_window": False, "sliding_window": 4096, "num_experts": 128,
                  "num_experts_per_tok": 8, "moe_intermediate_size": 768, "decoder_sparse_step": 1,
                  "mlp_only_layers": [], "norm_topk_prob": False},
}
_ALIASES: dict[str, dict[str, str]] = {"qwen3_moe": {"num_local_experts": "num_experts"}}  # config.json key -> ours
# Sizes that must be integers (transformers' strict config classes reject anything else the same way).
_INT_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "max_position_embeddings", "num_experts", "num_experts_per_tok",
             "moe_intermediate_size", "decoder_sparse_step")  # (sliding_window: checked by model_config)
LIGHT_MODEL_TYPES: tuple[str, ...] = tuple(_DEFAULTS)


class ConfigJson(SimpleNamespace):
    """config.json as attributes (over the model type's defaults); `getattr(cfg, key, default)` works as on a
    transformers config."""

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


def config_json(raw: dict[str, Any]) -> ConfigJson:
    """The ConfigJson of a parsed config.json whose model_type is one of LIGHT_MODEL_TYPES; ValueError on a size
    that is not an integer."""
    model_type = raw["model_type"]
    values = dict(_DEFAULTS[model_type])
    aliases = _ALIASES.get(model_type, {})
    for key, value in raw.items():
        values[aliases.get(key, key)] = value
    if values.get("num_key_value_heads") is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    if model_type in ("llama", "mistral") and values.get("head_dim") is None:
        values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]
    if model_type.startswith("qwen") and not values.get("use_sliding_window"):
        values["sliding_window"] = None  # transformers' Qwen configs drop the window unless it is used
    if model_type == "qwen3_moe" and values.get("mlp_only_layers") is None:
        values["mlp_only_layers"] = []
    for key in _INT_KEYS:
        value = values.get(key)
        if key in values and value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"config.json: {key} must be an integer, got {value!r}")
    return ConfigJson(**values)


# model types whose config class lives in the checkpoint's own code (remote code, which the engine never runs) and
# whose config is another type's, field for field: read with that type's transformers class (vLLM's rule)
SAME_CONFIG_AS = {"kimi_k2": "deepseek_v3"}  # Kimi K2 (moonshotai): DeepSeek-V3's architecture and fields


def read_hf_config(path: str) -> Any:
    """The checkpoint directory's config: a ConfigJson for LIGHT_MODEL_TYPES; SAME_CONFIG_AS's types through the
    class of the type they copy; else transformers' AutoConfig (unknown types, a missing or unreadable config.json:
    its errors, as before)."""
    file = os.path.join(path, "config.json")
    raw = None
    if os.path.isfile(file):
        try:
            with open(file, encoding="utf-8") as f:
                raw = json.load(f)
        except (OSError, ValueError):
            raw = None
    if isinstance(raw, dict) and raw.get("model_type") in _DEFAULTS:
        return config_json(raw)
    from transformers import AutoConfig  # heavy import: only for model types this build does not read itself

    if isinstance(raw, dict) and raw.get("model_type") in SAME_CONFIG_AS:
        fields = {k: v for k, v in raw.items() if k not in ("model_type", "auto_map")}
        return AutoConfig.for_model(SAME_CONFIG_AS[raw["model_type"]], **fields)
    config = AutoConfig.from_pretrained(path)
    if isinstance(raw, dict) and raw.get("model_type") == "dbrx":
        _dbrx_trained_rope(config, raw)
    if isinstance(raw, dict) and raw.get("model_type") == "longcat_flash":
        _longcat_sub_layers(config, raw)
    return config


def _longcat_sub_layers(config, raw: dict) -> None:
    """LongCat-Flash's file counts its blocks in `num_layers` (two attention sub-layers each), and transformers
    builds that many blocks; `num_hidden_layers` is derived from it (5.25: always 2 x num_layers) or, in a file
    transformers 5.17 saved, that release's own default (56 beside num_layers=2; its config never derived it). The
    sub-layer count (the engine's KV layers) is therefore 2 x the file's num_layers whenever the file has one."""
    if isinstance(raw.get("num_layers"), int):
        config.num_hidden_layers = 2 * raw["num_layers"]


def _dbrx_trained_rope(config, raw: dict) -> None:
    """DBRX's hub config.json keeps its rope theta in `attn_config.rope_theta` (500000), which transformers 5 ignores
    (its rotary reads the top-level rope_parameters, defaulting to 10000): where the file names no top-level rope,
    the trained theta is taken, as vLLM does (a file transformers 5 saved carries its own rope_parameters)."""
    theta = (raw.get("attn_config") or {}).get("rope_theta")
    if theta is not None and "rope_parameters" not in raw and "rope_theta" not in raw and "rope_scaling" not in raw:
        config.rope_parameters = {"rope_type": "default", "rope_theta": float(theta)}
