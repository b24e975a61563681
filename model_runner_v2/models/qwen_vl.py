"""Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE served as their language model: text in, text out (no image input).

Their language models are Qwen2's (q/k/v biases) and Qwen3's (per-head q/k norms) decoders with multimodal rope
(M-RoPE): each rotary pair takes its angle from one of three position components (time, height, width; the pairs
split by `mrope_section`, in blocks or interleaved). A text token's three components are all its position, so for
text M-RoPE is the ordinary rotary over the same frequencies, which is what the engine runs (transformers' configs
name the type "default" with an `mrope_section`). Qwen3-VL's deepstack features join the first layers only with
images: nothing for text. The checkpoints' language-model tensors are renamed to the text-only class's and the
vision tower's (`visual.*`) skipped (language_model.py); built from `text_config` (model_config.TEXT_OF_MULTIMODAL).

Qwen3-VL-MoE's language model is Qwen3-MoE's with a router that always renormalises its top-k (model_config.moe_facts);
its checkpoints store each layer's experts fused and transposed, `mlp.experts.gate_up_proj` [E, H, 2I] (gate columns
then up columns) and `down_proj` [E, I, H], which load as the module's [E, 2I, H] / [E, H, I] (a trainer module's
tensors already have those shapes)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .language_model import language_model_parts
from .qwen2 import Qwen2ForCausalLM
from .qwen3 import Qwen3ForCausalLM
from .qwen3_moe import Qwen3MoeForCausalLM

_FUSED_EXPERTS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


class Qwen2VLForConditionalGeneration(Qwen2ForCausalLM):
    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        return language_model_parts(name, tensor)


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    pass


class Qwen3VLForConditionalGeneration(Qwen3ForCausalLM):
    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        return language_model_parts(name, tensor)


class Qwen3VLMoeForConditionalGeneration(Qwen3MoeForCausalLM):
    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        for part, value in language_model_parts(name, tensor):
            if part.endswith(_FUSED_EXPERTS) and value.dim() == 3:
                value = self._module_layout(part, value)
            yield part, value

    def _module_layout(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A fused experts tensor as the module holds it: [E, 2I, H] / [E, H, I]; the checkpoints' [E, H, 2I] /
        [E, I, H] transposed. ValueError where the two cannot be told apart (H = 2I, or H = I)."""
        hidden, inter = self.config.hidden_size, int(self.config.moe_intermediate_size)
        rows = 2 * inter if name.endswith("gate_up_proj") else hidden
        cols = hidden if name.endswith("gate_up_proj") else inter
        if rows == cols:
            raise ValueError(f"tensor {name!r}: [E, {rows}, {cols}] is both layouts; the fused experts' orientation "
                             "is ambiguous for this config")
        return tensor.transpose(1, 2) if tuple(tensor.shape[1:]) == (cols, rows) else tensor
