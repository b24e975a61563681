"""Ground floor: multimodal checkpoints served as their language model alone, text in, text out. Their config.json
names the wrapper (`Glm4vMoeForConditionalGeneration`, ...) and keeps the language model's config in `text_config`
(Qwen3-Omni: `thinker_config.text_config`); the engine builds that language model and skips the vision / audio
towers' tensors (models/language_model.py renames the rest). Imports no folder of the package.

Two kinds of wrapper:
- those with a class of their own in models/ (`TEXT_OF_MULTIMODAL` minus the mapped ones: Gemma 3, Qwen-VL, ...);
- those whose language model is another supported architecture, unchanged for text (`TEXT_ARCHITECTURES`, by the
  wrapper and its text_config's model_type): served as that architecture, its checkpoint's names mapped at load
  (`ModelConfig.text_of` names the wrapper; the loader wraps the model class in
  models/language_model.text_of_multimodal). Each was checked against transformers:
  the wrapper's text-only forward equals the text architecture's on the same weights (positions of every M-RoPE
  axis equal for text, so the multimodal rope is the plain one; tests/models/test_multimodal_text.py)."""

from __future__ import annotations

from typing import Any

# Wrappers whose language model is a plain text model behind a vision tower and a projector (LLaVA 1.5 / NeXT /
# OneVision / OneVision-1.5, InternVL's -hf files, Idefics3 / SmolVLM, Aya Vision, LightOnOCR, GOT-OCR 2, VideoLLaMA3,
# Ovis2 / Ovis2.5, DeepSeek-VL, HyperCLOVA X Vision v2, MiniCPM-V 4.6 / MiniCPM-OCR, Fuyu), by the text model_types
# each is checked with (tests/models/test_multimodal_text.py). Not Command A Vision: transformers' wrapper leaves out
# the text model's logit_scale, which vLLM applies (no reference to check the engine against).
_PLAIN_TEXT = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM", "cohere2": "Cohere2ForCausalLM", "hyperclovax": "HyperCLOVAXForCausalLM",
               "persimmon": "PersimmonForCausalLM",
               "qwen3_5_text": "Qwen3_5ForCausalLM"}
_PLAIN_WRAPPERS = {
    "LlavaForConditionalGeneration": ("llama", "mistral", "qwen2"),
    "LlavaNextForConditionalGeneration": ("llama", "mistral", "qwen2"),
    "LlavaOnevisionForConditionalGeneration": ("qwen2",),
    "InternVLForConditionalGeneration": ("qwen2", "qwen3", "llama"),
    "Idefics3ForConditionalGeneration": ("llama",),
    "SmolVLMForConditionalGeneration": ("llama",),
    "AyaVisionForConditionalGeneration": ("cohere2",),
    "LightOnOcrForConditionalGeneration": ("qwen3",),
    "GotOcr2ForConditionalGeneration": ("qwen2",),
    "VideoLlama3ForConditionalGeneration": ("qwen2",),
    "Ovis2ForConditionalGeneration": ("qwen2",),
    "Ovis2_5ForConditionalGeneration": ("qwen3",),
    "DeepseekVLForConditionalGeneration": ("llama",),
    "LlavaOnevision15ForConditionalGeneration": ("qwen3",),
    "HyperCLOVAXVisionV2ForConditionalGeneration": ("hyperclovax",),
    "MiniCPMV4_6ForConditionalGeneration": ("qwen3_5_text",),
    "MiniCPMOcrForConditionalGeneration": ("qwen3_5_text",),
    "FuyuForCausalLM": ("persimmon",),  # Fuyu-8B: image patches through one linear layer, Persimmon's text model
}
# (multimodal architecture, its text_config's model_type) -> the architecture that serves that language model
TEXT_ARCHITECTURES: dict[tuple[str, str], str] = {
    ("Mistral3ForConditionalGeneration", "mistral4"): "Mistral4ForCausalLM",
    ("Glm4vForConditionalGeneration", "glm4v_text"): "Glm4ForCausalLM",  # GLM-4.1V
    ("Glm46VForConditionalGeneration", "glm4v_text"): "Glm4ForCausalLM",  # GLM-4.6V-Flash
    ("Glm4vMoeForConditionalGeneration", "glm4v_moe_text"): "Glm4MoeForCausalLM",  # GLM-4.5V
    ("Glm46VForConditionalGeneration", "glm4v_moe_text"): "Glm4MoeForCausalLM",  # GLM-4.6V
    ("Kimi_K25ForConditionalGeneration", "deepseek_v3"): "DeepseekV3ForCausalLM",  # Kimi K2.5 / K2.6
    ("Kimi_K25ForConditionalGeneration", "kimi_k2"): "DeepseekV3ForCausalLM",
    ("Exaone4_5_ForConditionalGeneration", "exaone4"): "Exaone4ForCausalLM",  # EXAONE 4.5
    ("Lfm2VlForConditionalGeneration", "lfm2"): "Lfm2ForCausalLM",  # LFM2-VL
    ("Lfm3VlForConditionalGeneration", "lfm3"): "Lfm3ForCausalLM",  # LFM3-VL
    ("HunYuanVLForConditionalGeneration", "hunyuan_vl_text"): "HunYuanDenseV1ForCausalLM",  # HunyuanOCR
    ("HunYuanVLForConditionalGeneration", "hunyuan_vl"): "HunYuanDenseV1ForCausalLM",  # (transformers 5.17's name)
    ("Granite4VisionForConditionalGeneration", "granite4_vision_text"): "GraniteForCausalLM",  # Granite 4 Vision
    # ERNIE-4.5-VL: text tokens run the text experts only (the first half of the file's; models/ernie4_5_moe.py)
    ("Ernie4_5_VLMoeForConditionalGeneration", "ernie4_5_vl_moe_text"): "Ernie4_5_MoeForCausalLM",
    ("Qwen3OmniMoeForConditionalGeneration", "qwen3_omni_moe_text"): "Qwen3MoeForCausalLM",  # Qwen3-Omni's Thinker
    ("Qwen3OmniMoeThinkerForConditionalGeneration", "qwen3_omni_moe_text"): "Qwen3MoeForCausalLM",
    ("Qwen2_5OmniForConditionalGeneration", "qwen2_5_omni_text"): "Qwen2ForCausalLM",  # Qwen2.5-Omni's Thinker
    ("Qwen2_5OmniThinkerForConditionalGeneration", "qwen2_5_omni_text"): "Qwen2ForCausalLM",
    ("GlmOcrForConditionalGeneration", "glm_ocr_text"): "Glm4ForCausalLM",  # GLM-OCR
    ("PaddleOCRVLForConditionalGeneration", "paddleocr_vl_text"): "LlamaForCausalLM",  # PaddleOCR-VL (Llama's rotary)
    ("Dots3NoteForConditionalGeneration", "dots3_note_text"): "Dots3NoteForCausalLM",  # Dots 3 Note (text of)
    ("InklingForConditionalGeneration", "inkling_text"): "InklingForCausalLM",  # Inkling (text of)
    **{(wrapper, t): _PLAIN_TEXT[t] for wrapper, types in _PLAIN_WRAPPERS.items() for t in types},
}
# What a text config leaves to its modeling code or names otherwise, said where the served architecture reads it
# (GLM-OCR's language model: GLM-4's layers without q/k/v biases; PaddleOCR-VL's: Llama's, `use_bias` on every
# projection): model_type -> {attribute: value, or a function of the text config}
_TEXT_FACTS: dict[str, dict[str, Any]] = {
    "glm_ocr_text": {"attention_bias": False},
    "paddleocr_vl_text": {"attention_bias": lambda t: bool(t.use_bias), "mlp_bias": lambda t: bool(t.use_bias)},
}
MAPPED_WRAPPERS = frozenset(wrapper for wrapper, _ in TEXT_ARCHITECTURES) - {"Mistral3ForConditionalGeneration"}
# Multimodal checkpoints served as their language model alone
TEXT_OF_MULTIMODAL: tuple[str, ...] = ("Gemma3ForConditionalGeneration", "Mistral3ForConditionalGeneration",
                                        "Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
                                        "Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration",
                                        "Llama4ForConditionalGeneration", "Qwen3_5ForConditionalGeneration",
                                        "Qwen3_5MoeForConditionalGeneration", "Gemma4ForConditionalGeneration",
                                        "Apertus1p5ForConditionalGeneration", "Gemma3nForConditionalGeneration",
                                        "Qwen4ExpForConditionalGeneration",
                                        *sorted(MAPPED_WRAPPERS))


def _text_config(hf_config):
    """A multimodal config's `text_config` (Qwen3-Omni's under its thinker), with the checkpoint's dtype where the
    text part names none, the head untied where the wrapper's config says so, and the top level's EOS ids where it
    has them (what transformers' generation reads: Gemma 3's [1, 106], <eos> and <end_of_turn>, while its
    text_config keeps the class default 1)."""
    owner = getattr(hf_config, "thinker_config", None) or hf_config
    text = owner.text_config
    if getattr(owner, "tie_word_embeddings", None) is False:  # transformers ties the wrapper's head by the wrapper's
        text.tie_word_embeddings = False  # config (Qwen2.5-Omni's Thinker: False over a text config's True)
    for key, value in _TEXT_FACTS.get(getattr(text, "model_type", None), {}).items():
        setattr(text, key, value(text) if callable(value) else value)
    if getattr(text, "dtype", None) is None and getattr(text, "torch_dtype", None) is None:
        text.dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if getattr(hf_config, "eos_token_id", None) is not None:
        text.eos_token_id = hf_config.eos_token_id
    return text


def served_language_model(architecture: str, hf_config: Any) -> tuple[str, Any, str | None]:
    """(the architecture that serves it, its config, the wrapper's name where it is a mapped one) for config.json's
    architecture; a text model unchanged. ValueError for a mapped wrapper whose language model is of a model_type
    with no mapping."""
    if architecture not in TEXT_OF_MULTIMODAL:
        return architecture, hf_config, None
    text = _text_config(hf_config)
    model_type = getattr(text, "model_type", None)
    served = TEXT_ARCHITECTURES.get((architecture, model_type), architecture)
    if served == architecture and architecture in MAPPED_WRAPPERS:
        known = sorted(t for w, t in TEXT_ARCHITECTURES if w == architecture)
        raise ValueError(f"{architecture} with a language model of model_type {model_type!r} is not supported "
                         f"(supported: {', '.join(known)})")
    return served, text, architecture if architecture in MAPPED_WRAPPERS else None
