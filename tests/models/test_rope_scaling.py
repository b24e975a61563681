"""Linear, YaRN and longrope scaling and partial rotary (rope_settings.py) against transformers: the inverse
frequencies and the cos/sin factor of its own rope functions, and whole models' logits past the pretraining context;
the position limit they give the engine and longrope's short or long factors (vLLM's rules)."""

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
from replayllm.model_runner_v2.models.layers import RotaryEmbedding
from replayllm.rope_settings import RopeSettings

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0}
LINEAR = {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
# Phi-4-mini's form: 3/4 of each 16-wide head rotates (6 pairs), per-pair factors, the pretraining context 32 of 128
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": 32, "short_factor": [1.0, 1.1, 1.3, 1.7, 2.5, 4.0],
            "long_factor": [1.0, 1.5, 3.0, 6.0, 12.0, 20.0]}


@pytest.mark.parametrize("params", [
    YARN,
    {**YARN, "beta_fast": 16, "beta_slow": 2, "truncate": False},
    {**YARN, "attention_factor": 1.3},
    {**YARN, "mscale": 0.9, "mscale_all_dim": 0.7, "factor": 8.0},
    {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 16, "rope_theta": 500000.0},
    LINEAR,
    {**YARN, "partial_rotary_factor": 0.5},
], ids=["yarn", "yarn-betas", "yarn-attention-factor", "yarn-mscale", "yarn-factor-from-lengths", "linear",
        "yarn-partial"])
def test_frequencies_and_scale_match_transformers(params):
    cfg = LlamaConfig(hidden_size=256, num_attention_heads=2, max_position_embeddings=64,
                      rope_parameters=dict(params))
    ours = RopeSettings.from_hf_config(cfg)
    hf_inv_freq, hf_scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg, "cpu")
    assert ours.rotary_dim(128) == 2 * hf_inv_freq.numel()
    theta = params["rope_theta"]
    # theta ** e rounds e's rounding up by ln(theta) (relative), and the ramp's blend adds a few roundings
    assert torch.allclose(ours.inv_freq(ours.rotary_dim(128)), hf_inv_freq,
                          rtol=rounding_tol(math.log(theta), steps=4), atol=0)
    assert ours.attention_factor == pytest.approx(hf_scale, rel=1e-12)


@pytest.mark.parametrize("seq_len", [None, 32, 33], ids=["short", "at-the-context", "past-it"])
def test_longrope_frequencies_match_transformers(seq_len):
    """transformers takes the short factors up to the pretraining context and the long ones past it; ours take
    them by the engine's max_model_len (for_context). Phi-3 keeps that context at the config's top level."""
    params = {k: v for k, v in LONGROPE.items() if k != "original_max_position_embeddings"}
    cfg = transformers.Phi3Config(hidden_size=64, num_attention_heads=4, max_position_embeddings=128,
                                  original_max_position_embeddings=32, rope_parameters=params)
    ours = RopeSettings.from_hf_config(cfg).for_context(seq_len or 1)
    assert ours.use_long_factor == (seq_len == 33) and ours.rotary_dim(16) == 12
    hf_inv_freq, hf_scale = ROPE_INIT_FUNCTIONS["longrope"](cfg, "cpu", seq_len=seq_len)
    assert torch.allclose(ours.inv_freq(12), hf_inv_freq, rtol=rounding_tol(math.log(1e4), steps=3), atol=0)
    assert ours.attention_factor == pytest.approx(hf_scale, rel=1e-12) and hf_scale > 1.1  # sqrt(1 + ln 4 / ln 32)
    assert ours.max_positions(128) == 128


def test_bad_partial_factors_and_factor_lists_are_refused():
    with pytest.raises(ValueError, match="partial_rotary_factor must be in"):
        RopeSettings.from_hf_config(SimpleNamespace(model_type="phi3", rope_theta=1e4, partial_rotary_factor=1.5))
    with pytest.raises(ValueError, match="rotary_dim=3; it must be even"):
        RopeSettings.from_hf_config(SimpleNamespace(model_type="phi3", rope_theta=1e4,
                                                    partial_rotary_factor=0.25)).rotary_dim(12)
    cfg = transformers.Phi3Config(hidden_size=64, num_attention_heads=4, max_position_embeddings=128,
                                  rope_parameters=dict(LONGROPE))
    with pytest.raises(ValueError, match="short_factor has 6 entries; the rotary width 16 needs 8"):
        RopeSettings.from_hf_config(cfg).inv_freq(16)


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


@pytest.mark.parametrize("arch", ["qwen3-yarn", "llama-linear", "phi3-longrope"])
def test_logits_match_transformers_past_the_pretraining_context(tmp_path, arch):
    """100 tokens where the config says 64 (YaRN: pretrained on 32, factor 4; linear: factor 2; Phi-4-mini's
    partial longrope: 128 of them, pretrained on 32, so the long factors): prefill, then one decode step per token
    through the paged cache, against transformers' forward over the whole sequence."""
    small = {**SMALL, "max_position_embeddings": 64}
    if arch == "phi3-longrope":
        _assert_phi3_longrope_logits(tmp_path, small, 100, max_model_len=128)
        return
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


def test_longrope_within_the_pretraining_context_takes_the_short_factors(tmp_path):
    """max_model_len 32 (the pretraining context): the short factors, transformers' choice for every sequence
    that fits; the engine's default max_model_len (128) takes the long ones, vLLM's rule."""
    small = {**SMALL, "max_position_embeddings": 64}
    path = _assert_phi3_longrope_logits(tmp_path, small, 30, max_model_len=32)
    assert EngineConfig(model=path, device="cpu").max_model_len == 128
    mc = ModelConfig.from_pretrained(path)
    rotary = load_model(mc, CPU, load_format="dummy", max_model_len=128).model.layers[0].self_attn.rotary
    assert rotary.settings.use_long_factor and rotary.rotary_dim == 12


def _assert_phi3_longrope_logits(tmp_path, small: dict, length: int, max_model_len: int) -> str:
    # Phi3Config puts its own original_max_position_embeddings (default 4096) into the rope parameters
    config = transformers.Phi3Config(**{**small, "max_position_embeddings": 128}, pad_token_id=0,
                                     original_max_position_embeddings=32, num_attention_heads=4,
                                     num_key_value_heads=2, rope_parameters=dict(LONGROPE))
    torch.manual_seed(0)
    hf = transformers.Phi3ForCausalLM(config).to(torch.float32).eval()
    path = str(tmp_path / "phi3-longrope")
    hf.save_pretrained(path)
    mc = ModelConfig.from_pretrained(path)
    model = load_model(mc, CPU, max_model_len=max_model_len)
    ids = torch.randint(0, mc.vocab_size, (length,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    ours = _run(model, mc, ids, [length // 2] + [1] * (length - length // 2), block_size=8)
    assert (ours - ref).abs().max().item() <= LOGPROB_TOL
    # the rule matters: the other factor list gives other logits (the rotary told the other served context, its
    # tables kept for every position: an engine of that max_model_len would not run `length` tokens)
    other = load_model(mc, CPU)
    for rotary in (m for m in other.modules() if isinstance(m, RotaryEmbedding)):
        rotary.fit_context(160 - max_model_len)
    assert (_run(other, mc, ids, [length], block_size=8) - ref).abs().max().item() > 10 * LOGPROB_TOL
    return path


@pytest.mark.parametrize("factor", [6.0, 1.1, 2.5])
def test_dynamic_ntk_frequencies_are_transformers_within_the_context(tmp_path, factor):
    """"dynamic" (InternLM3's): transformers' frequencies at max_position_embeddings, bit for bit (its base formula
    there, (factor * P / P - (factor - 1)) ** (d / (d - 2)), which is 1 up to rounding); the engine's limit is P, where
    transformers would start stretching the base."""
    config = LlamaConfig(**SMALL, num_attention_heads=4, num_key_value_heads=2,
                         rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": factor})
    settings = RopeSettings.from_hf_config(config)
    theirs, scale = ROPE_INIT_FUNCTIONS["dynamic"](config, "cpu")
    assert scale == 1.0 and torch.equal(settings.inv_freq(16), theirs)
    assert settings.max_positions(config.max_position_embeddings) == config.max_position_embeddings
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    limit = config.max_position_embeddings
    assert EngineConfig(model=str(tmp_path), device="cpu").max_model_len == limit
    with pytest.raises(ValueError, match=f"exceeds the model's max_position_embeddings={limit}"):
        EngineConfig(model=str(tmp_path), device="cpu", max_model_len=limit + 1)


@pytest.mark.parametrize(("hf_cls", "cfg_cls", "reads"), [
    (transformers.LlamaForCausalLM, LlamaConfig, False), (transformers.Qwen3ForCausalLM, Qwen3Config, False),
    (transformers.StableLmForCausalLM, transformers.StableLmConfig, True),
], ids=["llama", "qwen3", "stablelm"])
def test_a_default_rope_ignores_partial_rotary_factor_where_transformers_does(tmp_path, hf_cls, cfg_cls, reads):
    """transformers' Llama / Qwen / Mistral / Gemma rotaries rotate the whole head whatever partial_rotary_factor
    says (a config carrying one, e.g. copied from another model); StableLM's reads it: the engine follows each."""
    config = cfg_cls(**{k: v for k, v in SMALL.items() if k != "rms_norm_eps"}, num_attention_heads=4,
                     num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                             "partial_rotary_factor": 0.5})
    settings = RopeSettings.from_hf_config(config)
    assert settings.partial_rotary_factor == (0.5 if reads else 1.0)
    torch.manual_seed(0)
    hf = hf_cls(config).to(torch.float32).eval()
    hf.save_pretrained(str(tmp_path))
    mc = ModelConfig.from_pretrained(str(tmp_path))
    model = load_model(mc, CPU)
    ids = torch.randint(0, mc.vocab_size, (24,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (_run(model, mc, ids, [12] + [1] * 12, block_size=8) - ref).abs().max().item() <= LOGPROB_TOL
