"""hf_config_json: config.json read without transformers gives, for every field the engine reads, what the installed
transformers' AutoConfig gives, on config.json files written by transformers itself and by hand (older layouts,
aliases, nulls, rope variants); unknown model types still go through AutoConfig."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch
import transformers

from replayllm import model_config
from replayllm.hf_config_json import ConfigJson, read_hf_config
from replayllm.model_config import ModelConfig
from replayllm.rope_settings import RopeSettings

# (attribute, the default the engine's getattr uses) for every hf_config field the engine reads
_READ = [("vocab_size", None), ("hidden_size", None), ("intermediate_size", None), ("num_hidden_layers", None),
         ("num_attention_heads", None), ("num_key_value_heads", None), ("head_dim", None), ("hidden_act", "silu"),
         ("max_position_embeddings", None), ("rms_norm_eps", None), ("tie_word_embeddings", False),
         ("attention_bias", False), ("mlp_bias", False), ("use_sliding_window", False), ("eos_token_id", None),
         ("num_experts", 0), ("num_experts_per_tok", 0), ("moe_intermediate_size", None),
         ("decoder_sparse_step", 1), ("mlp_only_layers", None), ("norm_topk_prob", False), ("architectures", None)]
# (Mistral's sliding_window is compared as ModelConfig.sliding_window, the one place the engine reads it)

_SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 320, "max_position_embeddings": 4096}


def _saved_by_transformers(tmp_path, cls_name: str, arch: str, **kwargs) -> str:
    cfg = getattr(transformers, cls_name)(**{**_SMALL, **kwargs})
    cfg.architectures = [arch]
    cfg.save_pretrained(tmp_path)
    return str(tmp_path)


def _hand_written(tmp_path, raw: dict) -> str:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return str(tmp_path)


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 1024}
SAVED = [
    ("Qwen3Config", "Qwen3ForCausalLM", {}),
    ("Qwen3Config", "Qwen3ForCausalLM", {"tie_word_embeddings": True, "head_dim": 32, "eos_token_id": [5, 6]}),
    ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    ("LlamaConfig", "LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True}),
    ("LlamaConfig", "LlamaForCausalLM", {"rope_parameters": {**LLAMA3, "rope_theta": 500000.0}}),
    ("Qwen3Config", "Qwen3ForCausalLM", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                                             "original_max_position_embeddings": 1024}}),
    ("MistralConfig", "MistralForCausalLM", {}),
    ("MistralConfig", "MistralForCausalLM", {"sliding_window": None, "head_dim": 32, "tie_word_embeddings": True}),
    ("Qwen2Config", "Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 32, "max_window_layers": 1}),
    ("Qwen3Config", "Qwen3ForCausalLM", {"use_sliding_window": True, "sliding_window": 32, "max_window_layers": 2}),
    ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2, "use_sliding_window": True,
                                              "sliding_window": 48}),
    ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                              "decoder_sparse_step": 2, "mlp_only_layers": [0],
                                              "norm_topk_prob": True}),
]
# Layouts older transformers wrote (rope_theta / rope_scaling at the top, torch_dtype, num_experts), and omissions
HAND = [
    {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], **_SMALL, "rope_theta": 1000000.0,
     "torch_dtype": "bfloat16", "eos_token_id": 151645, "rope_scaling": None},
    {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "num_attention_heads": 4},
    {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], **_SMALL, "num_key_value_heads": None,
     "rope_theta": 10000.0, "torch_dtype": "float16", "use_sliding_window": False, "sliding_window": 4096},
    {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
     "rope_theta": 500000.0, "rope_scaling": {**LLAMA3, "type": "llama3"}, "max_position_embeddings": 8192},
    {"model_type": "llama", "architectures": ["LlamaForCausalLM"], **_SMALL, "head_dim": None, "dtype": "float32"},
    # Qwen2.5's documented long-context form (the legacy `rope_scaling` with "type")
    {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], **_SMALL, "rope_theta": 1000000.0,
     "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 2048, "type": "yarn"}},
    {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
     "max_position_embeddings": 2048},
    {"model_type": "mistral", "architectures": ["MistralForCausalLM"], **_SMALL, "head_dim": None,
     "sliding_window": 512, "rope_theta": 1000000.0, "torch_dtype": "bfloat16"},
    {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], **_SMALL, "num_experts": 4,
     "num_experts_per_tok": 2, "mlp_only_layers": None, "head_dim": 16},
    # Qwen's sliding window without layer_types (older files): max_window_layers decides; absent: 28 layers
    {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], **_SMALL, "use_sliding_window": True,
     "sliding_window": 512, "max_window_layers": 1},
    {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], **_SMALL, "use_sliding_window": True,
     "sliding_window": 512},
    {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], **_SMALL, "num_local_experts": 6,
     "num_experts_per_tok": 2},
]


def _assert_same(path: str) -> None:
    light = read_hf_config(path)
    assert isinstance(light, ConfigJson)
    auto = transformers.AutoConfig.from_pretrained(path)
    for key, default in _READ:
        assert getattr(light, key, default) == getattr(auto, key, default), key
    assert RopeSettings.from_hf_config(light) == RopeSettings.from_hf_config(auto)
    # the ModelConfig built from each: every field but the config object itself
    via_light = ModelConfig.from_pretrained(path)
    original = model_config.read_hf_config
    try:
        model_config.read_hf_config = transformers.AutoConfig.from_pretrained
        via_auto = ModelConfig.from_pretrained(path)
    finally:
        model_config.read_hf_config = original
    for field in dataclasses.fields(ModelConfig):
        if field.name != "hf_config":
            assert getattr(via_light, field.name) == getattr(via_auto, field.name), field.name


@pytest.mark.parametrize("cls_name,arch,kwargs", SAVED, ids=[f"{c}-{i}" for i, (c, _, _) in enumerate(SAVED)])
def test_configs_saved_by_transformers_read_the_same(tmp_path, cls_name, arch, kwargs):
    _assert_same(_saved_by_transformers(tmp_path, cls_name, arch, **kwargs))


@pytest.mark.parametrize("raw", HAND, ids=[f"{r['model_type']}-{i}" for i, r in enumerate(HAND)])
def test_hand_written_configs_read_the_same(tmp_path, raw):
    _assert_same(_hand_written(tmp_path, raw))


def test_aliases_and_derived_values(tmp_path):
    cfg = read_hf_config(_hand_written(tmp_path, HAND[-1]))
    assert cfg.num_experts == 6 and cfg.num_key_value_heads == 2 and cfg.mlp_only_layers == []
    llama = read_hf_config(_hand_written(tmp_path, HAND[4]))
    assert llama.head_dim == 16 and llama.eos_token_id == 2 and llama.to_dict()["dtype"] == "float32"


def test_a_size_that_is_not_an_integer_is_refused(tmp_path):
    with pytest.raises(ValueError, match="hidden_size must be an integer"):
        read_hf_config(_hand_written(tmp_path, {"model_type": "qwen3", "hidden_size": "64"}))


def test_other_model_types_go_through_autoconfig(tmp_path):
    path = _hand_written(tmp_path / "rwkv", {"model_type": "rwkv", "architectures": ["RwkvForCausalLM"],
                                              **_SMALL})
    cfg = read_hf_config(path)
    assert isinstance(cfg, transformers.PretrainedConfig) and cfg.model_type == "rwkv"
    with pytest.raises(ValueError, match="unsupported model architecture"):
        ModelConfig.from_pretrained(path)
    # A supported architecture of a type without a light reader (here Llama's layers under another model_type)
    # runs on transformers' config.
    path = _hand_written(tmp_path / "other", {"model_type": "mixtral", "architectures": ["LlamaForCausalLM"],
                                              **_SMALL})
    mc = ModelConfig.from_pretrained(path)
    assert isinstance(mc.hf_config, transformers.PretrainedConfig) and mc.architecture == "LlamaForCausalLM"


def test_reading_a_supported_config_imports_no_transformers(tmp_path):
    """The point of the module: the engine core's config costs no transformers import (a fresh process)."""
    path = _saved_by_transformers(tmp_path, "Qwen3Config", "Qwen3ForCausalLM")
    code = ("import sys; from replayllm.model_config import ModelConfig; "
            f"mc = ModelConfig.from_pretrained({path!r}); "
            "print(mc.hidden_size, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["64", "False"]


def test_auto_dtype_says_where_it_differs_from_vllm():
    """dtype="auto" keeps an fp32 checkpoint (or one naming no dtype) in fp32 where vLLM serves it in bf16 on a
    GPU: the engine says so on CUDA (a warning naming the option that gives vLLM's), and says nothing where the
    two agree (a bf16 checkpoint, an explicit dtype, the CPU)."""
    from replayllm.model_config import auto_dtype_note

    note = auto_dtype_note("auto", "cuda", torch.float32)
    assert note is not None and "vLLM would serve it in bfloat16" in note and "dtype='bfloat16'" in note
    assert auto_dtype_note("auto", "cuda", torch.bfloat16) is None
    assert auto_dtype_note("float32", "cuda", torch.float32) is None
    assert auto_dtype_note("auto", "cpu", torch.float32) is None
