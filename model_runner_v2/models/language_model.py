"""A multimodal checkpoint's language model (Gemma 3, Mistral 3, Qwen2-VL / Qwen2.5-VL / Qwen3-VL, and the wrappers
multimodal_text.py serves as another architecture: GLM-4.5V, Kimi K2.5, Qwen3-Omni's Thinker, ...): its tensors
renamed to the text-only class's names, the vision / audio towers', projectors' and speech decoders' skipped. Text
in, text out."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

# the language model's names: transformers >= 4.52's module names and the hub's older ones (save_pretrained writes them)
# (Qwen3-Omni's Thinker: `thinker.model.*` on the hub, `thinker.model.language_model.*` in transformers' modules)
_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                  ("language_model.lm_head.", "lm_head."), ("thinker.model.language_model.", "model."),
                  ("thinker.model.", "model."), ("thinker.lm_head.", "lm_head."), ("model.text_model.", "model."),
                  ("llm.model.", "model."), ("llm.lm_head.", "lm_head."), ("model.model.", "model."))
# (Qwen-VL's vision tower and merger: `visual`; Llama 4's: `vision_model`; Gemma 4's audio tower and the embedders;
# Kimi K2.5's `mm_projector`; HunyuanOCR's `vit`; Granite 4 Vision's projectors; LLaVA-NeXT's `image_newline`;
# Idefics3 / SmolVLM's `connector` (their language model: `model.text_model`); LightOnOCR's encoder and projection;
# Qwen3-Omni's Thinker's towers, its Talker and Code2Wav (speech out); ERNIE-4.5-VL's resampler; EXAONE 4.5's
# multi-token-prediction layer `mtp`, which transformers drops too; Dots 3 Note's hub towers and audio adapter)
_VISION_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector.",
                    "model.visual.", "visual.", "vision_model.", "model.vision_model.", "model.audio_tower.",
                    "model.embed_vision.", "model.embed_audio.", "mm_projector.", "model.mm_projector.", "vit.",
                    "model.vit.", "model.image_newline", "model.layerwise_projectors.", "model.spatial_projectors.",
                    "thinker.visual.", "thinker.audio_tower.", "thinker.model.visual.", "thinker.model.audio_tower.",
                    "audio_tower.", "talker.", "code2wav.", "mtp.", "model.resampler_model.", "resampler_model.",
                    "image_newline", "model.connector.", "model.vision_encoder.", "model.vision_projection.",
                    "model.projector.", "model.visual_embeddings_table", "model.aligner.", "model.vision_embed_tokens.",
                    "model.merger.", "model.vision_projector.", "visual_tokenizer.", "vte.",
                    "mlp_AR.", "vision_embed_tokens.", "vision_encoder.", "audio_encoder.", "audio_adapter.")


def language_model_parts(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """One checkpoint tensor as the text-only model's (nothing for a vision tower's or projector's tensor)."""
    if name.startswith(_VISION_PREFIXES):
        return
    for old, new in _TEXT_PREFIXES:
        if name.startswith(old):
            name = new + name[len(old):]
            break
    yield name, tensor


def text_of_multimodal(cls: type[nn.Module], wrapper: str) -> type[nn.Module]:
    """`cls` (a text architecture's model) reading a multimodal wrapper's checkpoint (multimodal_text.py): each
    tensor renamed by language_model_parts before the class's own checkpoint_parts. Named as `cls` (the model's
    facts are looked up by its class name: models/moe.py, layer windows); `text_of` names the wrapper."""

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        for text_name, text_tensor in language_model_parts(name, tensor):
            yield from cls.checkpoint_parts(self, text_name, text_tensor)

    return type(cls.__name__, (cls,), {"checkpoint_parts": checkpoint_parts, "__module__": cls.__module__,
                                       "text_of": wrapper})
