"""Ground floor: the config.json architecture names this build runs (those with a model class; multimodal wrappers
served as another's language model: multimodal_text.py), and other architectures' checkpoints under another name.
Kept apart from the models so reading a config never imports them. Imports no folder of the package."""

from __future__ import annotations

from .multimodal_text import MAPPED_WRAPPERS

# config.json `architectures` names this build runs; model_runner_v2/models/registry.py maps each to its class
# (tests/models/test_models.py checks that the two agree). Kept here so reading a config never imports the models.
SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("Qwen3ForCausalLM", "LlamaForCausalLM", "Qwen2ForCausalLM",
                                             "Qwen3MoeForCausalLM", "MistralForCausalLM", "Phi3ForCausalLM",
                                             "MixtralForCausalLM", "Olmo2ForCausalLM", "GraniteForCausalLM",
                                             "OlmoeForCausalLM", "Qwen2MoeForCausalLM", "SmolLM3ForCausalLM",
                                             "GlmForCausalLM", "Glm4ForCausalLM", "StableLmForCausalLM",
                                             "GPTNeoXForCausalLM", "GemmaForCausalLM", "Gemma2ForCausalLM",
                                             "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration",
                                             "Starcoder2ForCausalLM", "Olmo3ForCausalLM", "SeedOssForCausalLM",
                                             "PhiForCausalLM", "CohereForCausalLM", "Cohere2ForCausalLM",
                                             "GptOssForCausalLM", "Glm4MoeForCausalLM", "DeepseekV2ForCausalLM",
                                             "DeepseekV3ForCausalLM", "Ministral3ForCausalLM",
                                             "Mistral3ForConditionalGeneration", "Ernie4_5ForCausalLM",
                                             "Exaone4ForCausalLM", "GraniteMoeForCausalLM",
                                             "GraniteMoeSharedForCausalLM", "GraniteMoeHybridForCausalLM",
                                             "Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
                                             "Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration",
                                             "GPT2LMHeadModel", "OPTForCausalLM", "GPTBigCodeForCausalLM",
                                             "GPTJForCausalLM", "FalconForCausalLM", "OlmoForCausalLM",
                                             "NemotronForCausalLM", "ArceeForCausalLM", "HeliumForCausalLM",
                                             "BloomForCausalLM", "MptForCausalLM", "MPTForCausalLM",
                                             "MiniMaxM2ForCausalLM", "Glm4MoeLiteForCausalLM", "ApertusForCausalLM",
                                             "Dots1ForCausalLM", "MinistralForCausalLM",
                                             "Mistral4ForCausalLM", "Llama4ForCausalLM",
                                             "Llama4ForConditionalGeneration", "HunYuanDenseV1ForCausalLM",
                                             "HunYuanMoEV1ForCausalLM", "ExaoneForCausalLM",
                                             "PhimoeForCausalLM", "InternLM3ForCausalLM",
                                             "SolarOpenForCausalLM", "FlexOlmoForCausalLM", "Jais2ForCausalLM",
                                             "HyperCLOVAXForCausalLM", "ExaoneMoeForCausalLM", "HYV3ForCausalLM",
                                             "HYV4ForCausalLM",
                                             "Ernie4_5_MoeForCausalLM", "CwmForCausalLM", "VaultGemmaForCausalLM",
                                             "NanoChatForCausalLM", "GPTNeoForCausalLM",
                                             "GraniteSWAForCausalLM", "GraniteMoeSWAForCausalLM",
                                             "Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM",
                                             "Qwen3_5ForConditionalGeneration",
                                             "Qwen3_5MoeForConditionalGeneration", "NemotronHForCausalLM",
                                             "Qwen4ExpForCausalLM", "Qwen4ExpForConditionalGeneration",
                                             "Lfm2ForCausalLM", "Lfm2MoeForCausalLM", "BambaForCausalLM",
                                             "Zamba2ForCausalLM",
                                             "Gemma4ForCausalLM", "Gemma4ForConditionalGeneration",
                                             "FalconH1ForCausalLM", "OlmoHybridForCausalLM", "JambaForCausalLM",
                                             "MambaForCausalLM", "FalconMambaForCausalLM", "Mamba2ForCausalLM",
                                             "YoutuForCausalLM", "MellumForCausalLM",
                                             "CodeGenForCausalLM", "MiniCPM3ForCausalLM",
                                             "Cohere2MoeForCausalLM", "DeepseekV32ForCausalLM",
                                             "GlmMoeDsaForCausalLM", "AfmoeForCausalLM",
                                             "MiniCPM5MoeForCausalLM", "Lfm3ForCausalLM", "DbrxForCausalLM",
                                             "PersimmonForCausalLM", "AXK1ForCausalLM", "AXK2ForCausalLM",
                                             "Dots3NoteForCausalLM",
                                             "FlintForCausalLM", "Kolibri1ForCausalLM",
                                             "XGLMForCausalLM", "Apertus1p5TextForCausalLM",
                                             "Apertus1p5ForConditionalGeneration", "Gemma3nForCausalLM",
                                             "Gemma3nForConditionalGeneration", "MiMoV2FlashForCausalLM",
                                             "LongcatFlashForCausalLM", "LagunaForCausalLM",
                                             "JetMoeForCausalLM", "KimiLinearForCausalLM",
                                             "OpenAIGPTLMHeadModel", "OpenAIGPTDoubleHeadsModel", "BeamForCausalLM",
                                             "HrmTextForCausalLM", "LaraMiniForCausalLM", "MiniMaxForCausalLM",
                                             "BailingHybridForCausalLM", "InklingForCausalLM")
# (config.json's architecture, its model_type) -> the architecture whose tensor names the checkpoint has: transformers
# saves EXAONE 3.x (run by its Llama class) as "LlamaForCausalLM" with the hub's EXAONE names
RENAMED_ARCHITECTURES = {("LlamaForCausalLM", "exaone"): "ExaoneForCausalLM"}
# config.json's model_type -> the architecture transformers runs it as (its auto classes map the type to that class),
# whatever `architectures` names: the hubs' remote-code class names (SarvamMoEForCausalLM, ...)
MODEL_TYPE_ARCHITECTURES = {"iquestcoder": "LlamaForCausalLM", "sarvam_mla": "DeepseekV3ForCausalLM",
                            "sarvam_moe": "Glm4MoeForCausalLM", "param2moe": "Glm4MoeForCausalLM",
                            "bailing_hybrid": "BailingHybridForCausalLM"}


def resolve_architecture(architectures: list[str], model_type: str | None = None) -> str:
    """First supported entry of `architectures` (config.json's list): one with a model class, or a multimodal wrapper
    served as another architecture's language model (multimodal_text.py); else the architecture of `model_type`
    (MODEL_TYPE_ARCHITECTURES); ValueError listing the supported ones."""
    for arch in architectures or []:
        if arch in SUPPORTED_ARCHITECTURES or arch in MAPPED_WRAPPERS:
            return arch
    if model_type in MODEL_TYPE_ARCHITECTURES:
        return MODEL_TYPE_ARCHITECTURES[model_type]
    raise ValueError(
        f"unsupported model architecture(s) {list(architectures or [])}; "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES + tuple(sorted(MAPPED_WRAPPERS)))}"
    )
