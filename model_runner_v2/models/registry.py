"""Architecture name (config.json `architectures`) -> model class."""

from __future__ import annotations

from torch import nn

from ...config import SUPPORTED_ARCHITECTURES, resolve_architecture
from .afmoe import AfmoeForCausalLM
from .apertus import Apertus1p5ForConditionalGeneration, Apertus1p5TextForCausalLM, ApertusForCausalLM
from .bailing_hybrid import BailingHybridForCausalLM
from .bamba import BambaForCausalLM
from .beam import BeamForCausalLM
from .bloom import BloomForCausalLM
from .cohere import Cohere2ForCausalLM, CohereForCausalLM
from .cohere2_moe import Cohere2MoeForCausalLM
from .dbrx import DbrxForCausalLM
from .deepseek import (
    AXK1ForCausalLM,
    AXK2ForCausalLM,
    DeepseekV2ForCausalLM,
    DeepseekV3ForCausalLM,
    DeepseekV32ForCausalLM,
    Glm4MoeLiteForCausalLM,
    GlmMoeDsaForCausalLM,
    YoutuForCausalLM,
)
from .dots1 import Dots1ForCausalLM
from .dots3_note import Dots3NoteForCausalLM
from .ernie4_5 import Ernie4_5ForCausalLM
from .ernie4_5_moe import Ernie4_5_MoeForCausalLM
from .exaone4 import Exaone4ForCausalLM
from .exaone_moe import ExaoneMoeForCausalLM, HYV3ForCausalLM
from .falcon import FalconForCausalLM
from .falcon_h1 import FalconH1ForCausalLM
from .flint import FlintForCausalLM
from .gemma import GemmaForCausalLM
from .gemma2 import Gemma2ForCausalLM, VaultGemmaForCausalLM
from .gemma3 import Gemma3ForCausalLM, Gemma3ForConditionalGeneration
from .gemma3n import Gemma3nForCausalLM, Gemma3nForConditionalGeneration
from .gemma4 import Gemma4ForCausalLM, Gemma4ForConditionalGeneration
from .glm4 import Glm4ForCausalLM, GlmForCausalLM
from .glm4_moe import Glm4MoeForCausalLM
from .gpt2 import GPT2LMHeadModel
from .gpt_bigcode import GPTBigCodeForCausalLM
from .gpt_neo import GPTNeoForCausalLM
from .gpt_neox import GPTNeoXForCausalLM
from .gpt_oss import GptOssForCausalLM
from .gptj import CodeGenForCausalLM, GPTJForCausalLM
from .granite import GraniteForCausalLM, HyperCLOVAXForCausalLM
from .granite_swa import GraniteMoeSWAForCausalLM, GraniteSWAForCausalLM
from .granitemoe import GraniteMoeForCausalLM
from .granitemoehybrid import GraniteMoeHybridForCausalLM, GraniteMoeSharedForCausalLM
from .helium import HeliumForCausalLM
from .hrm_text import HrmTextForCausalLM
from .hunyuan import HunYuanDenseV1ForCausalLM, HunYuanMoEV1ForCausalLM
from .hy_v4 import HYV4ForCausalLM
from .inkling import InklingForCausalLM
from .jamba import JambaForCausalLM
from .jetmoe import JetMoeForCausalLM
from .kimi_linear import KimiLinearForCausalLM
from .kolibri1 import Kolibri1ForCausalLM
from .laguna import LagunaForCausalLM
from .lara_mini import LaraMiniForCausalLM
from .lfm2 import Lfm2ForCausalLM, Lfm2MoeForCausalLM
from .lfm3 import Lfm3ForCausalLM
from .llama import (
    ArceeForCausalLM,
    CwmForCausalLM,
    ExaoneForCausalLM,
    InternLM3ForCausalLM,
    Jais2ForCausalLM,
    LlamaForCausalLM,
    MinistralForCausalLM,
    MistralForCausalLM,
    SeedOssForCausalLM,
)
from .llama4 import Llama4ForCausalLM, Llama4ForConditionalGeneration
from .longcat_flash import LongcatFlashForCausalLM
from .mamba import FalconMambaForCausalLM, Mamba2ForCausalLM, MambaForCausalLM
from .mimo_v2_flash import MiMoV2FlashForCausalLM
from .minicpm3 import MiniCPM3ForCausalLM
from .minicpm5_moe import MiniCPM5MoeForCausalLM
from .minimax import MiniMaxForCausalLM
from .minimax_m2 import MiniMaxM2ForCausalLM
from .mistral3 import Ministral3ForCausalLM, Mistral3ForConditionalGeneration
from .mistral4 import Mistral4ForCausalLM
from .mixtral import MixtralForCausalLM
from .mpt import MPTForCausalLM, MptForCausalLM
from .nanochat import NanoChatForCausalLM
from .nemotron import NemotronForCausalLM
from .nemotron_h import NemotronHForCausalLM
from .olmo import OlmoForCausalLM
from .olmo2 import Olmo2ForCausalLM, Olmo3ForCausalLM
from .olmo_hybrid import OlmoHybridForCausalLM
from .olmoe import FlexOlmoForCausalLM, OlmoeForCausalLM
from .openai_gpt import OpenAIGPTDoubleHeadsModel, OpenAIGPTLMHeadModel
from .opt import OPTForCausalLM
from .persimmon import PersimmonForCausalLM
from .phi import PhiForCausalLM
from .phi3 import Phi3ForCausalLM
from .phimoe import PhimoeForCausalLM
from .qwen2 import Qwen2ForCausalLM
from .qwen2_moe import Qwen2MoeForCausalLM
from .qwen3 import Qwen3ForCausalLM
from .qwen3_moe import MellumForCausalLM, Qwen3MoeForCausalLM
from .qwen3_next import (
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3NextForCausalLM,
)
from .qwen4_exp import Qwen4ExpForCausalLM, Qwen4ExpForConditionalGeneration
from .qwen_vl import (
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLForConditionalGeneration,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMoeForConditionalGeneration,
)
from .smollm3 import SmolLM3ForCausalLM
from .solar_open import SolarOpenForCausalLM
from .stablelm import StableLmForCausalLM
from .starcoder2 import Starcoder2ForCausalLM
from .xglm import XGLMForCausalLM
from .zamba2 import Zamba2ForCausalLM

# One entry per name in config.SUPPORTED_ARCHITECTURES (the ground floor's list; tests/models/test_models.py checks).
_MODELS: dict[str, type[nn.Module]] = {
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "SmolLM3ForCausalLM": SmolLM3ForCausalLM,
    "GlmForCausalLM": GlmForCausalLM,
    "Glm4ForCausalLM": Glm4ForCausalLM,
    "StableLmForCausalLM": StableLmForCausalLM,
    "GPTNeoXForCausalLM": GPTNeoXForCausalLM,
    "GemmaForCausalLM": GemmaForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
    "Starcoder2ForCausalLM": Starcoder2ForCausalLM,
    "Olmo3ForCausalLM": Olmo3ForCausalLM,
    "SeedOssForCausalLM": SeedOssForCausalLM,
    "PhiForCausalLM": PhiForCausalLM,
    "CohereForCausalLM": CohereForCausalLM,
    "Cohere2ForCausalLM": Cohere2ForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    "Glm4MoeForCausalLM": Glm4MoeForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "YoutuForCausalLM": YoutuForCausalLM,
    "MellumForCausalLM": MellumForCausalLM,
    "CodeGenForCausalLM": CodeGenForCausalLM,
    "MiniCPM3ForCausalLM": MiniCPM3ForCausalLM,
    "Cohere2MoeForCausalLM": Cohere2MoeForCausalLM,
    "DeepseekV32ForCausalLM": DeepseekV32ForCausalLM,
    "GlmMoeDsaForCausalLM": GlmMoeDsaForCausalLM,
    "AfmoeForCausalLM": AfmoeForCausalLM,
    "MiniCPM5MoeForCausalLM": MiniCPM5MoeForCausalLM,
    "Lfm3ForCausalLM": Lfm3ForCausalLM,
    "DbrxForCausalLM": DbrxForCausalLM,
    "PersimmonForCausalLM": PersimmonForCausalLM,
    "AXK1ForCausalLM": AXK1ForCausalLM,
    "AXK2ForCausalLM": AXK2ForCausalLM,
    "Dots3NoteForCausalLM": Dots3NoteForCausalLM,
    "FlintForCausalLM": FlintForCausalLM,
    "Kolibri1ForCausalLM": Kolibri1ForCausalLM,
    "XGLMForCausalLM": XGLMForCausalLM,
    "Apertus1p5TextForCausalLM": Apertus1p5TextForCausalLM,
    "Apertus1p5ForConditionalGeneration": Apertus1p5ForConditionalGeneration,
    "Ministral3ForCausalLM": Ministral3ForCausalLM,
    "Mistral3ForConditionalGeneration": Mistral3ForConditionalGeneration,
    "Ernie4_5ForCausalLM": Ernie4_5ForCausalLM,
    "Exaone4ForCausalLM": Exaone4ForCausalLM,
    "GraniteMoeForCausalLM": GraniteMoeForCausalLM,
    "GraniteMoeSharedForCausalLM": GraniteMoeSharedForCausalLM,
    "GraniteMoeHybridForCausalLM": GraniteMoeHybridForCausalLM,
    "HunYuanDenseV1ForCausalLM": HunYuanDenseV1ForCausalLM,
    "ExaoneForCausalLM": ExaoneForCausalLM,
    "InternLM3ForCausalLM": InternLM3ForCausalLM,
    "PhimoeForCausalLM": PhimoeForCausalLM,
    "SolarOpenForCausalLM": SolarOpenForCausalLM,
    "FlexOlmoForCausalLM": FlexOlmoForCausalLM,
    "Jais2ForCausalLM": Jais2ForCausalLM,
    "HyperCLOVAXForCausalLM": HyperCLOVAXForCausalLM,
    "ExaoneMoeForCausalLM": ExaoneMoeForCausalLM,
    "HYV3ForCausalLM": HYV3ForCausalLM,
    "HYV4ForCausalLM": HYV4ForCausalLM,
    "InklingForCausalLM": InklingForCausalLM,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    "NemotronHForCausalLM": NemotronHForCausalLM,
    "Lfm2ForCausalLM": Lfm2ForCausalLM,
    "Lfm2MoeForCausalLM": Lfm2MoeForCausalLM,
    "BambaForCausalLM": BambaForCausalLM,
    "FalconH1ForCausalLM": FalconH1ForCausalLM,
    "Zamba2ForCausalLM": Zamba2ForCausalLM,
    "OlmoHybridForCausalLM": OlmoHybridForCausalLM,
    "JambaForCausalLM": JambaForCausalLM,
    "MambaForCausalLM": MambaForCausalLM,
    "FalconMambaForCausalLM": FalconMambaForCausalLM,
    "Mamba2ForCausalLM": Mamba2ForCausalLM,
    "Gemma4ForCausalLM": Gemma4ForCausalLM,
    "Gemma4ForConditionalGeneration": Gemma4ForConditionalGeneration,
    "Gemma3nForCausalLM": Gemma3nForCausalLM,
    "Gemma3nForConditionalGeneration": Gemma3nForConditionalGeneration,
    "MiMoV2FlashForCausalLM": MiMoV2FlashForCausalLM,
    "LongcatFlashForCausalLM": LongcatFlashForCausalLM,
    "LagunaForCausalLM": LagunaForCausalLM,
    "BeamForCausalLM": BeamForCausalLM,
    "HrmTextForCausalLM": HrmTextForCausalLM,
    "JetMoeForCausalLM": JetMoeForCausalLM,
    "KimiLinearForCausalLM": KimiLinearForCausalLM,
    "BailingHybridForCausalLM": BailingHybridForCausalLM,
    "LaraMiniForCausalLM": LaraMiniForCausalLM,
    "OpenAIGPTLMHeadModel": OpenAIGPTLMHeadModel,
    "OpenAIGPTDoubleHeadsModel": OpenAIGPTDoubleHeadsModel,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,
    "Qwen3_5ForConditionalGeneration": Qwen3_5ForConditionalGeneration,
    "Qwen3_5MoeForConditionalGeneration": Qwen3_5MoeForConditionalGeneration,
    "Qwen4ExpForCausalLM": Qwen4ExpForCausalLM,
    "Qwen4ExpForConditionalGeneration": Qwen4ExpForConditionalGeneration,
    "Ernie4_5_MoeForCausalLM": Ernie4_5_MoeForCausalLM,
    "CwmForCausalLM": CwmForCausalLM,
    "VaultGemmaForCausalLM": VaultGemmaForCausalLM,
    "NanoChatForCausalLM": NanoChatForCausalLM,
    "GPTNeoForCausalLM": GPTNeoForCausalLM,
    "GraniteSWAForCausalLM": GraniteSWAForCausalLM,
    "GraniteMoeSWAForCausalLM": GraniteMoeSWAForCausalLM,
    "HunYuanMoEV1ForCausalLM": HunYuanMoEV1ForCausalLM,
    "Qwen2VLForConditionalGeneration": Qwen2VLForConditionalGeneration,
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,
    "Qwen3VLForConditionalGeneration": Qwen3VLForConditionalGeneration,
    "Qwen3VLMoeForConditionalGeneration": Qwen3VLMoeForConditionalGeneration,
    "GPT2LMHeadModel": GPT2LMHeadModel,
    "OPTForCausalLM": OPTForCausalLM,
    "GPTBigCodeForCausalLM": GPTBigCodeForCausalLM,
    "GPTJForCausalLM": GPTJForCausalLM,
    "FalconForCausalLM": FalconForCausalLM,
    "OlmoForCausalLM": OlmoForCausalLM,
    "NemotronForCausalLM": NemotronForCausalLM,
    "ArceeForCausalLM": ArceeForCausalLM,
    "HeliumForCausalLM": HeliumForCausalLM,
    "BloomForCausalLM": BloomForCausalLM,
    "MptForCausalLM": MptForCausalLM,
    "MPTForCausalLM": MPTForCausalLM,  # the hub checkpoints' (remote-code) name for the same model
    "MiniMaxM2ForCausalLM": MiniMaxM2ForCausalLM,
    "MiniMaxForCausalLM": MiniMaxForCausalLM,
    "Glm4MoeLiteForCausalLM": Glm4MoeLiteForCausalLM,
    "ApertusForCausalLM": ApertusForCausalLM,
    "Dots1ForCausalLM": Dots1ForCausalLM,
    "MinistralForCausalLM": MinistralForCausalLM,
    "Mistral4ForCausalLM": Mistral4ForCausalLM,
    "Llama4ForCausalLM": Llama4ForCausalLM,
    "Llama4ForConditionalGeneration": Llama4ForConditionalGeneration,
}

__all__ = ["SUPPORTED_ARCHITECTURES", "get_model_class"]


def get_model_class(architectures: list[str]) -> type[nn.Module]:
    """First supported entry of `architectures`; the class's __name__ is the architecture name."""
    return _MODELS[resolve_architecture(architectures)]
