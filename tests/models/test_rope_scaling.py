"""Linear and YaRN rope scaling (rope_settings.py) against transformers: the inverse frequencies and the cos/sin
factor of its own rope functions, and whole models' logits past the pretraining context; the position limit they
give the engine (vLLM's rule)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import transformers
from helpers.tolerances import LOGPROB_TOL, rounding_tol
from test_models import CPU, SMALL, _run
from transformers import LlamaConfig, Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from replayllm.config import EngineConfig, ModelConfig
from replayllm.model_runner_v2.loader import load_model
from replayllm.rope_settings import RopeSettings

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0}
LINEAR = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}


@pytest.mark.parametrize("params", [
    YARN,
    {**YARN, "beta_fast": 16, "beta_slow": 2, "truncate": False},
    {**YARN, "attention_factor": 1.3},
    {**YARN, "mscale": 0.9, "mscale_all_dim": 0.7, "factor": 8.0},
    {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 16, "rope_theta": 500000.0},
    LINEAR,
], ids=["yarn", "yarn-betas", "yarn-attention-factor", "yarn-mscale", "yarn-factor-from-lengths", "linear"])
def test_frequencies_and_scale_match_transformers(params):
    cfg = LlamaConfig(hidden_size=256, num_attention_heads=2, max_position_embeddings=64,
                      rope_parameters=dict(params))
    ours = RopeSettings.from_hf_config(cfg)
    hf_inv_freq, hf_scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg, "cpu")
    theta = params["rope_theta"]
    # theta ** e rounds e's rounding up by ln(theta) (relative), and the ramp's blend adds a few roundings
    assert torch.allclose(ours.inv_freq(128), hf_inv_freq, rtol=rounding_tol(math.log(theta), steps=4), atol=0)
    assert ours.attention_factor == pytest.approx(hf_scale, rel=1e-12)


def test_the_legacy_rope_scaling_form_reads_the_same():
    new = RopeSettings.from_hf_config(LlamaConfig(max_position_embeddings=64, rope_parameters=dict(YARN)))
    legacy = SimpleNamespace(rope_theta=10000.0, max_position_embeddings=64,
                             rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32})
    assert RopeSettings.from_hf_config(legacy) == new and new.rope_type == "yarn"


def test_position_limits_follow_vllm():
    yarn = RopeSettings.from_hf_config(LlamaConfig(max_position_embeddings=64, rope_parameters=dict(YARN)))
    assert yarn.max_positions(64) == 128  # the pretraining context (32) x factor (4)
    linear = RopeSettings.from_hf_config(LlamaConfig(max_position_embeddings=64, rope_parameters=dict(LINEAR)))
    assert linear.max_positions(64) == 128  # max_position_embeddings x factor
    assert RopeSettings(theta=1e4).max_positions(64) == 64
    with pytest.raises(ValueError, match="factor must be > 0"):
        RopeSettings.from_hf_config(SimpleNamespace(rope_theta=1e4, rope_scaling={"type": "linear", "factor": 0}))


@pytest.mark.parametrize("arch", ["qwen3-yarn", "llama-linear"])
def test_logits_match_transformers_past_the_pretraining_context(tmp_path, arch):
    """100 tokens where the config says 64 (YaRN: pretrained on 32, factor 4; linear: factor 2): prefill, then one
    decode step per token through the paged cache, against transformers' forward over the whole sequence."""
    small = {**SMALL, "max_position_embeddings": 64}
    if arch == "qwen3-yarn":
        config = Qwen3Config(**small, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                             rope_parameters=dict(YARN))
        hf_cls = transformers.Qwen3ForCausalLM
    else:
        config = LlamaConfig(**small, num_attention_heads=4, num_key_value_heads=2, rope_parameters=dict(LINEAR))
        hf_cls = transformers.LlamaForCausalLM
    torch.manual_seed(0)
    hf = hf_cls(config).to(torch.float32).eval()
    path = str(tmp_path / arch)
    hf.save_pretrained(path)
    mc = ModelConfig.from_pretrained(path)
    assert mc.max_position_embeddings == 128
    assert EngineConfig(model=path, device="cpu").max_model_len == 128
    with pytest.raises(ValueError, match="max_position_embeddings=128 .config.json's, stretched by its rope scaling"):
        EngineConfig(model=path, device="cpu", max_model_len=129)
    model = load_model(mc, CPU)
    ids = torch.randint(0, mc.vocab_size, (100,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    # 16 blocks of 4 in _run's cache hold 64 tokens: blocks of 8 hold the 100
    ours = _run(model, mc, ids, [60] + [1] * 40, block_size=8)
    assert (ours - ref).abs().max().item() <= LOGPROB_TOL
