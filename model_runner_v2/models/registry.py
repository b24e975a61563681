"""Architecture name (config.json `architectures`) -> model class."""

from __future__ import annotations

from torch import nn

from .llama import LlamaForCausalLM
from .qwen2 import Qwen2ForCausalLM
from .qwen3 import Qwen3ForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_MODELS)


def get_model_class(architectures: list[str]) -> type[nn.Module]:
    """First supported entry of `architectures`; the class's __name__ is the architecture name."""
    for arch in architectures or []:
        if arch in _MODELS:
            return _MODELS[arch]
    raise ValueError(
        f"unsupported model architecture(s) {list(architectures or [])}; "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )
