"""ModelConfig: the model facts the engine needs, read once from a HF checkpoint directory."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from ..model_runner_v2.models.registry import get_model_class
from .model_source import resolve_model_path

# vLLM's --dtype choices; "auto" takes the checkpoint's dtype (fp32 when the config names none).
_DTYPES: dict[str, torch.dtype] = {
    "half": torch.float16,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float": torch.float32,
    "float32": torch.float32,
}
DTYPE_CHOICES: tuple[str, ...] = ("auto", *_DTYPES)


def _resolve_dtype(dtype: str, hf_config) -> torch.dtype:
    if dtype == "auto":
        found = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if found is None:
            return torch.float32
        if isinstance(found, torch.dtype):
            return found
        name = str(found).removeprefix("torch.")
        if name not in _DTYPES:
            raise ValueError(
                f"config.json dtype {found!r} is not supported; pass dtype= one of {DTYPE_CHOICES}"
            )
        return _DTYPES[name]
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; choose one of {DTYPE_CHOICES}")
    return _DTYPES[dtype]


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _eos_token_ids(path: str, hf_config) -> tuple[int, ...]:
    """config.json eos ids, then generation_config.json ones, in order, deduplicated."""
    ids = _as_ids(getattr(hf_config, "eos_token_id", None))
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path, encoding="utf-8") as f:
            ids += _as_ids(json.load(f).get("eos_token_id"))
    return tuple(dict.fromkeys(ids))


@dataclass(frozen=True)
class ModelConfig:
    path: str  # local checkpoint directory (hub ids and embedded ids are resolved first)
    hf_config: Any  # transformers PretrainedConfig
    architecture: str
    dtype: torch.dtype
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_pretrained(cls, path: str, dtype: str = "auto") -> ModelConfig:
        """`path` may be a local dir, the embedded id or a hub id (see model_source.resolve_model_path)."""
        from transformers import AutoConfig  # heavy import, kept off `import replayllm.engine`

        path = resolve_model_path(path)
        hf_config = AutoConfig.from_pretrained(path)
        architecture = get_model_class(getattr(hf_config, "architectures", None) or []).__name__
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        return cls(
            path=path,
            hf_config=hf_config,
            architecture=architecture,
            dtype=_resolve_dtype(dtype, hf_config),
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=int(head_dim),
            max_position_embeddings=hf_config.max_position_embeddings,
            eos_token_ids=_eos_token_ids(path, hf_config),
        )
