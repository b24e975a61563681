"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL (dense) served as their language model: text in, text out (no image input).

Their language models are Qwen2's (q/k/v biases) and Qwen3's (per-head q/k norms) decoders with multimodal rope
(M-RoPE): each rotary pair takes its angle from one of three position components (time, height, width; the pairs
split by `mrope_section`, in blocks or interleaved). A text token's three components are all its position, so for
text M-RoPE is the ordinary rotary over the same frequencies, which is what the engine runs (transformers' configs
name the type "default" with an `mrope_section`). Qwen3-VL's deepstack features join the first layers only with
images: nothing for text. The checkpoints' language-model tensors are renamed to the text-only class's and the
vision tower's (`visual.*`) skipped (language_model.py); built from `text_config` (model_config.TEXT_OF_MULTIMODAL)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .language_model import language_model_parts
from .qwen2 import Qwen2ForCausalLM
from .qwen3 import Qwen3ForCausalLM


class Qwen2VLForConditionalGeneration(Qwen2ForCausalLM):
    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        return language_model_parts(name, tensor)


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    pass


class Qwen3VLForConditionalGeneration(Qwen3ForCausalLM):
    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        return language_model_parts(name, tensor)
