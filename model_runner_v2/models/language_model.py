"""A multimodal checkpoint's language model (Gemma 3, Mistral 3, Qwen2-VL / Qwen2.5-VL / Qwen3-VL): its tensors renamed
to the text-only class's names, the vision tower's and the projector's skipped. Text in, text out."""

from __future__ import annotations

from collections.abc import Iterator

import torch

# the language model's names: transformers >= 4.52's module names and the hub's older ones (save_pretrained writes them)
_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
# (Qwen-VL's vision tower and merger: `visual`; Llama 4's: `vision_model`; Gemma 4's audio tower and the embedders)
_VISION_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector.",
                    "model.visual.", "visual.", "vision_model.", "model.vision_model.", "model.audio_tower.",
                    "model.embed_vision.", "model.embed_audio.")


def language_model_parts(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """One checkpoint tensor as the text-only model's (nothing for a vision tower's or projector's tensor)."""
    if name.startswith(_VISION_PREFIXES):
        return
    for old, new in _TEXT_PREFIXES:
        if name.startswith(old):
            name = new + name[len(old):]
            break
    yield name, tensor
