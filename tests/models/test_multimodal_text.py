"""Multimodal checkpoints served as another architecture's language model (multimodal_text.py): GLM-4.1V / GLM-4.6V
(GLM-4), GLM-4.5V / GLM-4.6V (GLM-4-MoE), Kimi K2.5 (DeepSeek-V3), EXAONE 4.5, LFM2-VL, LFM3-VL, HunyuanOCR (HunYuan
dense), Granite 4 Vision (Granite), Qwen3-Omni's Thinker (Qwen3-MoE), and the plain wrappers (LLaVA 1.5 / NeXT /
OneVision / OneVision-1.5, InternVL, Idefics3, SmolVLM, Aya Vision, LightOnOCR, GOT-OCR 2, VideoLLaMA3, Ovis2 / 2.5,
DeepSeek-VL, HyperCLOVA X Vision v2, MiniCPM-V 4.6 / MiniCPM-OCR), Qwen2.5-Omni's Thinker (Qwen2), GLM-OCR (GLM-4),
PaddleOCR-VL (Llama), Fuyu (Persimmon) and Dots 3 Note (its own text model), over Llama, Mistral, Qwen2, Qwen3,
Qwen3.5, Cohere 2 or HyperCLOVA X.
Each: transformers' wrapper with small towers, saved as the hub has it (its vision / audio / speech tensors beside
the language model's), served by the engine as the text architecture: trace-replay logprobs against the wrapper's
own text-only forward."""

from __future__ import annotations

import inspect
import json

import pytest
import torch
import transformers
from helpers.engine_archs import ENGINE
from helpers.hf_reference import teacher_forced, teacher_forced_stepwise
from helpers.recent_archs import _DOTS3, RECENT_ARCHS
from helpers.tolerances import LOGPROB_TOL
from safetensors.torch import load_file, save_file

from replayllm import LLM, SamplingParams
from replayllm.model_config import ModelConfig

_TEXT = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, initializer_range=0.5, rms_norm_eps=1e-6, pad_token_id=0, bos_token_id=1,
             eos_token_id=2)
_GLM_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "mrope_section": [1, 1, 2]}
_GLM_MOE = dict(_TEXT, num_hidden_layers=3, head_dim=16, moe_intermediate_size=32, n_routed_experts=8,
                num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=1.5,
                n_group=2, topk_group=1, rope_parameters=_GLM_ROPE)
_GLM_VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64)
_QWEN_VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64)
_OMNI_TEXT = dict(_TEXT, head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 2, 2],
                                   "interleaved": True})
_OMNI_TOWERS = dict(audio_config=dict(d_model=16, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32,
                                      output_dim=64, num_mel_bins=16, downsample_hidden_size=8),
                    vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64,
                                       deepstack_visual_indexes=[0]))
_KIMI_TEXT = dict(_TEXT, num_hidden_layers=3, num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=8,
                  num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24,
                  qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_group=1, topk_group=1,
                  routed_scaling_factor=2.827, tie_word_embeddings=False)

# name -> (transformers config class, model class, config kwargs, the architecture that serves it)
WRAPPERS = {
    # Inkling: its text model (recent_archs' inkling) beside a 4-layer vision encoder and a dMel audio embedding
    "inkling": ("InklingConfig", "InklingForConditionalGeneration", dict(
        text_config=dict(_TEXT, **dict(RECENT_ARCHS["inkling"][2], num_hidden_layers=3)), vision_config=dict(
            hidden_size=16, num_hidden_layers=4, patch_size=4, temporal_patch_size=2, num_attention_heads=2),
        audio_config=dict(n_mel_bins=4, mel_vocab_size=8)), "InklingForCausalLM"),
    # Dots 3 Note: its text model (recent_archs._DOTS3: indexed and sliding MLA layers of two geometries) beside a
    # one-block vision tower and a one-layer audio tower (the hub's vision_encoder / audio_encoder tensors skipped)
    "dots3_note": ("Dots3NoteConfig", "Dots3NoteForConditionalGeneration", dict(
        text_config=dict(_TEXT, **_DOTS3), vision_config=dict(
            hidden_size=16, intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
            mlp_layer_types=["dense"], adapter_in_dim=16, adapter_out_dim=64), audio_config=dict(
            hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, adapter_input_size=16,
            adapter_out_dim=64, downsample_hidden_size=8)), "Dots3NoteForCausalLM"),
    "glm4v": ("Glm4vConfig", "Glm4vForConditionalGeneration", dict(
        text_config=dict(_TEXT, rope_parameters=_GLM_ROPE), vision_config=_GLM_VISION), "Glm4ForCausalLM"),
    "glm46v": ("Glm46VConfig", "Glm46VForConditionalGeneration", dict(
        text_config=dict(_TEXT, model_type="glm4v_text", rope_parameters=_GLM_ROPE), vision_config=_GLM_VISION),
        "Glm4ForCausalLM"),
    "glm4v_moe": ("Glm4vMoeConfig", "Glm4vMoeForConditionalGeneration", dict(
        text_config=_GLM_MOE, vision_config=_GLM_VISION), "Glm4MoeForCausalLM"),
    "kimi_k25": ("Kimi_K25Config", "Kimi_K25ForConditionalGeneration", dict(
        text_config=dict(_KIMI_TEXT, model_type="kimi_k2"), tie_word_embeddings=False, projection_hidden_size=32,
        image_token_id=298,
        video_token_id=299, vision_config=dict(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                               intermediate_size=64)), "DeepseekV3ForCausalLM"),
    # the class default: the wrapper ties its head (transformers then saves none) while the text config says not:
    # the engine ties a head the checkpoint lacks (loader), as transformers does
    "kimi_k25-tied": ("Kimi_K25Config", "Kimi_K25ForConditionalGeneration", dict(
        text_config=dict(_KIMI_TEXT, model_type="kimi_k2"), projection_hidden_size=32, image_token_id=298,
        video_token_id=299, vision_config=dict(num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                                               intermediate_size=64)), "DeepseekV3ForCausalLM"),
    "exaone4_5": ("Exaone4_5_Config", "Exaone4_5_ForConditionalGeneration", dict(
        text_config=dict(_TEXT, model_type="exaone4", num_hidden_layers=4, head_dim=16, sliding_window=4,
                         sliding_window_pattern=4), vision_config=_QWEN_VISION), "Exaone4ForCausalLM"),
    "lfm2_vl": ("Lfm2VlConfig", "Lfm2VlForConditionalGeneration", dict(
        text_config=dict(_TEXT, model_type="lfm2", num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"],
                         norm_eps=1e-5), projector_hidden_size=32,
        vision_config=dict(model_type="siglip2_vision_model", hidden_size=16, intermediate_size=32,
                           num_hidden_layers=1, num_attention_heads=2)), "Lfm2ForCausalLM"),
    "lfm3_vl": ("Lfm3VlConfig", "Lfm3VlForConditionalGeneration", dict(
        text_config=dict(_TEXT, model_type="lfm3", num_hidden_layers=3, head_dim=16), projector_hidden_size=32,
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                           num_key_value_heads=2)), "Lfm3ForCausalLM"),
    "hunyuan_vl": ("HunYuanVLConfig", "HunYuanVLForConditionalGeneration", dict(
        text_config=dict(_TEXT, head_dim=16, rope_parameters=dict(rope_type="xdrope", rope_theta=10000.0, alpha=1000.0,
                                                                  factor=1.0, xdrope_section=[2, 2, 2, 2])),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           out_hidden_size=64)), "HunYuanDenseV1ForCausalLM"),
    "granite4_vision": ("Granite4VisionConfig", "Granite4VisionForConditionalGeneration", dict(
        text_config=dict(_TEXT, embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.0625,
                         logits_scaling=4.0),
        vision_config=dict(model_type="clip_vision_model", hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=2, image_size=28, patch_size=14),
        deepstack_layer_map=[[0, 0]], downsample_rate="1/2", spatial_target_layers=[0, 1, 0, 1]), "GraniteForCausalLM"),
    # ERNIE-4.5-VL: a dense layer, then text (width 32) and vision (16) experts, two routers and corrections. Its
    # weights drawn at 0.3, not 0.5: at 0.5 one logprob (-25.8) moved by up to 2.1e-3 when the input embeddings moved
    # by one fp32 ulp (a chaotic model, no reference: the CUDA engine scored it 1.3e-3 off, session 46); at 0.3 every
    # logprob moves by <= 7e-5 (session 47)
    "ernie4_5_vl_moe": ("Ernie4_5_VLMoeConfig", "Ernie4_5_VLMoeForConditionalGeneration", dict(
        text_config=dict(_TEXT, initializer_range=0.3, num_hidden_layers=3, moe_intermediate_size=[32, 16],
                         moe_num_experts=4, moe_k=2, moe_num_shared_experts=1,
                         rope_parameters=dict(rope_type="default", rope_theta=500000.0, mrope_section=[3, 3, 2])),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2)), "Ernie4_5_MoeForCausalLM"),
    "qwen3_omni_thinker": ("Qwen3OmniMoeThinkerConfig", "Qwen3OmniMoeThinkerForConditionalGeneration", dict(
        text_config=_OMNI_TEXT, **_OMNI_TOWERS), "Qwen3MoeForCausalLM"),
}
# Wrappers of a plain text model behind a vision tower and a projector (multimodal_text._PLAIN_WRAPPERS)
_CLIP = dict(model_type="clip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
             num_attention_heads=2, image_size=28, patch_size=14)
_SIGLIP = dict(_CLIP, model_type="siglip_vision_model")
_V = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
_SMALL_VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                     patch_size=14)
_COHERE2 = dict(_TEXT, model_type="cohere2", head_dim=16, sliding_window=4, layer_types=["sliding_attention",
                                                                                          "full_attention"])
_PLAIN = {
    "llava": ("LlavaConfig", "LlavaForConditionalGeneration", dict(text_config=dict(_TEXT, model_type="llama"),
                                                                   vision_config=_CLIP), "LlamaForCausalLM"),
    "llava-mistral": ("LlavaConfig", "LlavaForConditionalGeneration", dict(
        text_config=dict(_TEXT, model_type="mistral", sliding_window=None), vision_config=_CLIP), "MistralForCausalLM"),
    "llava_next-qwen2": ("LlavaNextConfig", "LlavaNextForConditionalGeneration", dict(
        text_config=dict(_TEXT, model_type="qwen2"), vision_config=_CLIP), "Qwen2ForCausalLM"),
    "llava_onevision": ("LlavaOnevisionConfig", "LlavaOnevisionForConditionalGeneration", dict(
        text_config=dict(_TEXT, model_type="qwen2"), vision_config=_SIGLIP), "Qwen2ForCausalLM"),
    "internvl-qwen3": ("InternVLConfig", "InternVLForConditionalGeneration", dict(
        text_config=dict(_TEXT, model_type="qwen3", head_dim=16),
        vision_config=dict(_SMALL_VISION, image_size=[28, 28], patch_size=[14, 14])), "Qwen3ForCausalLM"),
    "idefics3": ("Idefics3Config", "Idefics3ForConditionalGeneration", dict(
        text_config=dict(_TEXT, model_type="llama"), vision_config=_SMALL_VISION, scale_factor=2), "LlamaForCausalLM"),
    "smolvlm": ("SmolVLMConfig", "SmolVLMForConditionalGeneration", dict(
        text_config=dict(_TEXT, model_type="llama"), vision_config=_SMALL_VISION, scale_factor=2), "LlamaForCausalLM"),
    "aya_vision": ("AyaVisionConfig", "AyaVisionForConditionalGeneration", dict(
        text_config=_COHERE2, vision_config=_SIGLIP, downsample_factor=2), "Cohere2ForCausalLM"),
    "lighton_ocr": ("LightOnOcrConfig", "LightOnOcrForConditionalGeneration", dict(
        text_config=dict(_TEXT, model_type="qwen3", head_dim=16),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14, head_dim=8)), "Qwen3ForCausalLM"),
    "got_ocr2": ("GotOcr2Config", "GotOcr2ForConditionalGeneration", dict(
        text_config=dict(_TEXT, model_type="qwen2"),
        vision_config=dict(hidden_size=16, output_channels=8, num_hidden_layers=1, num_attention_heads=2,
                           image_size=64, patch_size=16, mlp_dim=32, global_attn_indexes=[0])), "Qwen2ForCausalLM"),
    "videollama3": ("VideoLlama3Config", "VideoLlama3ForConditionalGeneration", dict(
        text_config=dict(_TEXT, model_type="qwen2"), vision_config=_V), "Qwen2ForCausalLM"),
    "ovis2": ("Ovis2Config", "Ovis2ForConditionalGeneration", dict(
        text_config=dict(_TEXT, model_type="qwen2"), vision_config=_V), "Qwen2ForCausalLM"),
    "ovis2_5": ("Ovis2_5Config", "Ovis2_5ForConditionalGeneration", dict(
        text_config=dict(_TEXT, model_type="qwen3", head_dim=16), vision_config=_V), "Qwen3ForCausalLM"),
    "deepseek_vl": ("DeepseekVLConfig", "DeepseekVLForConditionalGeneration", dict(
        text_config=dict(_TEXT, model_type="llama"), vision_config=_SIGLIP), "LlamaForCausalLM"),
    "llava_onevision15": ("LlavaOnevision15Config", "LlavaOnevision15ForConditionalGeneration", dict(
        text_config=dict(_TEXT, model_type="qwen3", head_dim=16), vision_config=dict(_V, out_hidden_size=64)),
        "Qwen3ForCausalLM"),
    "hyperclovax_vision_v2": ("HyperCLOVAXVisionV2Config", "HyperCLOVAXVisionV2ForConditionalGeneration", dict(
        text_config=dict(_TEXT, model_type="hyperclovax"), vision_config=_V), "HyperCLOVAXForCausalLM"),
    "minicpmv4_6": ("MiniCPMV4_6Config", "MiniCPMV4_6ForConditionalGeneration", dict(
        text_config=dict(_TEXT, model_type="qwen3_5_text", head_dim=16,
                         layer_types=["linear_attention", "full_attention"]), vision_config=_V), "Qwen3_5ForCausalLM"),
}
_PLAIN["fuyu"] = ("FuyuConfig", "FuyuForCausalLM", dict(  # Persimmon has no num_key_value_heads (MHA)
    text_config={**{k: v for k, v in _TEXT.items() if k != "num_key_value_heads"}, "model_type": "persimmon"},
    hidden_size=64, vocab_size=300), "PersimmonForCausalLM")
_PLAIN["minicpm_ocr"] = ("MiniCPMOcrConfig", "MiniCPMOcrForConditionalGeneration", *_PLAIN["minicpmv4_6"][2:])
_OTHER_TEXT = {"llama": dict(_TEXT, model_type="llama"), "qwen2": dict(_TEXT, model_type="qwen2"),
               "mistral": dict(_TEXT, model_type="mistral", sliding_window=None)}
for _name, _base, _text in (("llava-qwen2", "llava", "qwen2"), ("llava_next-llama", "llava_next-qwen2", "llama"),
                            ("llava_next-mistral", "llava_next-qwen2", "mistral"),
                            ("internvl-qwen2", "internvl-qwen3", "qwen2"),
                            ("internvl-llama", "internvl-qwen3", "llama")):
    _config, _model, _kwargs, _ = _PLAIN[_base]  # the same wrapper over another text model
    _PLAIN[_name] = (_config, _model, dict(_kwargs, text_config=_OTHER_TEXT[_text]),
                     f"{_text.capitalize()}ForCausalLM")
WRAPPERS.update(_PLAIN)
WRAPPERS["qwen2_5_omni_thinker"] = ("Qwen2_5OmniThinkerConfig", "Qwen2_5OmniThinkerForConditionalGeneration", dict(
    text_config=dict(_TEXT, model_type="qwen2_5_omni_text", rope_parameters={
        "rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}),
    audio_config=dict(d_model=16, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32, output_dim=64,
                      num_mel_bins=16), vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                                                           out_hidden_size=64)), "Qwen2ForCausalLM")
WRAPPERS["glm_ocr"] = ("GlmOcrConfig", "GlmOcrForConditionalGeneration", dict(
    text_config=dict(_TEXT, head_dim=16, rope_parameters=_GLM_ROPE), vision_config=_GLM_VISION), "Glm4ForCausalLM")
WRAPPERS["paddleocr_vl"] = ("PaddleOCRVLConfig", "PaddleOCRVLForConditionalGeneration", dict(
    text_config=dict(_TEXT, head_dim=16, rope_parameters=dict(rope_type="default", rope_theta=500000.0,
                                                            mrope_section=[2, 3, 3])),
    vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)),
    "LlamaForCausalLM")
WRAPPERS["paddleocr_vl-bias"] = ("PaddleOCRVLConfig", "PaddleOCRVLForConditionalGeneration", dict(
    text_config=dict(_TEXT, head_dim=16, use_bias=True, rope_parameters=dict(rope_type="default", rope_theta=500000.0,
                                                            mrope_section=[2, 3, 3])),
    vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)),
    "LlamaForCausalLM")
_RECURRENT = ("lfm2_vl", "lfm3_vl")  # transformers one token per call (the engine's form of the convolution)


def _config_class(name: str):
    if name == "Qwen3OmniMoeThinkerConfig":
        from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeThinkerConfig

        return Qwen3OmniMoeThinkerConfig
    return getattr(transformers, name)


def _wrapper(name: str, seed: int = 0):
    config_cls, model_cls, kwargs, _ = WRAPPERS[name]
    if not hasattr(transformers, model_cls):  # the GPU machine's older transformers lacks the newer wrappers
        pytest.skip(f"transformers {transformers.__version__} has no {model_cls}")
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(_config_class(config_cls)(initializer_range=0.5, **kwargs))
    with torch.no_grad():  # norms off their init (1), routers' corrections off theirs (0)
        for param_name, param in model.named_parameters():
            if "norm" in param_name and param.dim() == 1:
                param.uniform_(0.5, 1.5)
            elif param_name.endswith("e_score_correction_bias"):
                param.uniform_(-0.3, 0.3)
            elif param_name.endswith("mlp.text_moe.gate.weight"):  # ERNIE's router: each expert its own odds
                param.normal_(0, 1.0)
        for buffer_name, buffer in model.named_buffers():
            if buffer_name.endswith("e_score_correction_bias"):
                buffer.uniform_(-0.3, 0.3)
    # transformers' loop over experts, the model's definition: 5.17's default grouped_mm scored other logprobs on the
    # GPU machine's CPU (ERNIE-4.5-VL: one 1.3e-3 off; engine_archs.EAGER_EXPERTS says the same of GPT-OSS)
    model.set_experts_implementation("eager")
    return model.float().eval()


def _save(model, name: str, path) -> str:
    model.save_pretrained(path)
    if name.startswith("kimi_k25"):  # transformers' save writes the text layers as `blocks` (its vision rename reversed
        tensors = load_file(f"{path}/model.safetensors")  # too); the released files name them `layers`
        save_file({k.replace("language_model.model.blocks.", "language_model.model.layers."): v
                   for k, v in tensors.items()}, f"{path}/model.safetensors", metadata={"format": "pt"})
    return str(path)


def _replay_logprobs(llm: LLM, prompts, traces) -> list[torch.Tensor]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(trace_decode_token_ids=t, logprobs=0) for t in traces], use_tqdm=False)
    return [torch.tensor([d[t].logprob for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
            for o in outs]


@pytest.mark.parametrize("name", list(WRAPPERS))
def test_the_wrapper_serves_its_language_model(tmp_path, name):
    """The checkpoint as saved (towers and all), served as the text architecture: the wrapper's text-only logprobs;
    then weights updated from another transformers wrapper module (its own names: `mlp.text_moe.*`, ...)."""
    hf = _wrapper(name)
    if name == "aya_vision" and "logit_scale" not in inspect.getsource(type(hf).forward):
        pytest.skip(f"transformers {transformers.__version__}'s Aya Vision leaves out Cohere 2's logit_scale (5.25 "
                    "applies it, as vLLM and the engine do): no reference")
    path = _save(hf, name, tmp_path)
    mc = ModelConfig.from_pretrained(path)
    assert (mc.architecture, mc.text_of) == (WRAPPERS[name][3], WRAPPERS[name][1])
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 290, (n,), generator=g).tolist() for n in (4, 17, 30)]
    traces = [torch.randint(3, 290, (8,), generator=g).tolist() for _ in prompts]
    llm = LLM(path, **ENGINE)
    reference = teacher_forced_stepwise if name in _RECURRENT else teacher_forced
    for model in (hf, _wrapper(name, seed=1)):  # then in-place weights from transformers' own module
        if model is not hf:
            assert llm.load_weights(model) > 0
        for prompt, trace, engine in zip(prompts, traces, _replay_logprobs(llm, prompts, traces)):
            lp, tokens = reference(model, prompt, trace)
            assert (engine - lp[torch.arange(len(tokens)), tokens]).abs().max().item() <= LOGPROB_TOL


@pytest.mark.parametrize("name, architecture, model_type, served", [
    ("qwen3_omni_thinker", "Qwen3OmniMoeForConditionalGeneration", "qwen3_omni_moe", "Qwen3MoeForCausalLM"),
    ("qwen2_5_omni_thinker", "Qwen2_5OmniForConditionalGeneration", "qwen2_5_omni", "Qwen2ForCausalLM")])
def test_omni_full_checkpoint(tmp_path, name, architecture, model_type, served):
    """Qwen3-Omni's / Qwen2.5-Omni's whole checkpoint (the Thinker under `thinker.*`, its config under
    thinker_config): the Thinker's language model; the speech decoders' tensors (`talker.*`, `code2wav.*`) skipped."""
    thinker = _wrapper(name)
    path = _save(thinker, name, tmp_path / "thinker")
    tensors = {f"thinker.{k}": v for k, v in load_file(f"{path}/model.safetensors").items()}
    tensors.update({"talker.model.layers.0.mlp.gate.weight": torch.randn(4, 8),
                    "code2wav.decoder.0.conv.weight": torch.randn(4, 4)})
    full = tmp_path / "full"
    full.mkdir()
    save_file(tensors, full / "model.safetensors", metadata={"format": "pt"})
    thinker_config = json.loads(open(f"{path}/config.json").read())
    (full / "config.json").write_text(json.dumps({
        "architectures": [architecture], "model_type": model_type,
        "thinker_config": thinker_config, "enable_audio_output": False, "dtype": "float32"}))
    assert ModelConfig.from_pretrained(str(full)).architecture == served
    prompts, traces = [[5, 9, 200, 31]], [[7, 8, 9, 10]]
    assert torch.equal(_replay_logprobs(LLM(str(full), **ENGINE), prompts, traces)[0],
                       _replay_logprobs(LLM(path, **ENGINE), prompts, traces)[0])


def test_a_wrapper_with_another_language_model_is_refused(tmp_path):
    """A mapped wrapper whose text_config is of a model_type with no mapping: a clear error naming the ones served."""
    config = transformers.Glm4vConfig(text_config=dict(_TEXT, rope_parameters=_GLM_ROPE), vision_config=_GLM_VISION)
    config.save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    data["text_config"]["model_type"], data["architectures"] = "llama", ["Glm4vForConditionalGeneration"]
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="Glm4vForConditionalGeneration with a language model of model_type 'llama'"):
        ModelConfig.from_pretrained(str(tmp_path))


@pytest.mark.parametrize("name", ["glm4v_moe", "qwen3_omni_thinker", "llava_next-qwen2", "idefics3"])
def test_replayllm_diff_loads_the_wrapper_as_its_hf_side(tmp_path, name):
    """`replayllm diff`'s `hf` side: transformers' causal-LM auto class does not take these wrappers; its
    image-text-to-text class does, fed text alone: the wrapper's own logprobs."""
    from replayllm.entrypoints.diff.sides import load_hf_model, teacher_forced_logprobs

    hf = _wrapper(name)
    path = _save(hf, name, tmp_path)
    loaded = load_hf_model(ModelConfig.from_pretrained(path), torch.device("cpu"))
    prompt, trace = [5, 9, 200, 31, 8], [7, 8, 9, 10]
    assert torch.equal(teacher_forced_logprobs(loaded, prompt, trace), teacher_forced_logprobs(hf, prompt, trace))
