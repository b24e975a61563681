"""The KV cache's size on CUDA from gpu_memory_utilization (`kv_cache.determine_num_blocks`, `gpu_budget`) without
a GPU: the device is stood in for by patching torch.cuda.mem_get_info. As in vLLM, the fraction is this engine's
share of the device: what other engines or a trainer hold does not count against it."""

from __future__ import annotations

import logging

import pytest
import torch

from replayllm.config import EngineConfig
from replayllm.model_runner_v2.kv_cache import activation_reserve_bytes, determine_num_blocks, gpu_budget

GIB = 1 << 30
TOTAL = 80 * GIB


def _cuda_config(path: str, monkeypatch, free: int, **kw) -> EngineConfig:
    cfg = EngineConfig(path, max_model_len=256, **kw)
    cfg.torch_device = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, TOTAL))
    return cfg


def test_two_engines_at_045_share_one_gpu(tiny_models, monkeypatch):
    """Another engine holds 40 GiB; this one took 1 GiB for its weights since it began: its share is
    0.45 x 80 - 1 - the reserve, not 0.45 x 80 - everything in use (which is below zero)."""
    cfg = _cuda_config(tiny_models["qwen3"], monkeypatch, free=39 * GIB, gpu_memory_utilization=0.45)
    budget, _ = gpu_budget(cfg, free_at_start=40 * GIB)
    assert budget == int(TOTAL * 0.45) - GIB - activation_reserve_bytes(cfg)
    enough = cfg.max_num_seqs * cfg.max_blocks_per_seq + 1
    assert determine_num_blocks(cfg, free_at_start=40 * GIB) == enough
    with pytest.raises(ValueError, match="held by other processes or engines"):  # everything counted as its own
        determine_num_blocks(cfg)


def test_less_free_than_the_share_takes_the_fraction_of_what_was_free_and_warns(tiny_models, monkeypatch, caplog):
    """A trainer holds 70 GiB and the engine asks for 0.9 (72 GiB; vLLM would refuse to start): it takes 0.9 of the
    10 GiB free at its start, less its own 1 GiB and the reserve, leaving 1 GiB to the trainer (never the whole
    free memory), and a warning says so."""
    cfg = _cuda_config(tiny_models["qwen3"], monkeypatch, free=9 * GIB)
    with caplog.at_level(logging.WARNING, logger="replayllm.model_runner_v2.kv_cache"):
        budget, _ = gpu_budget(cfg, free_at_start=10 * GIB)
    assert budget == int(10 * GIB * 0.9) - GIB - activation_reserve_bytes(cfg)
    assert any("only 10.0 GiB" in r.getMessage() and "vLLM refuses" in r.getMessage() for r in caplog.records)
    caplog.clear()
    cfg = _cuda_config(tiny_models["qwen3"], monkeypatch, free=TOTAL - 2 * GIB)
    with caplog.at_level(logging.WARNING, logger="replayllm.model_runner_v2.kv_cache"):
        budget, _ = gpu_budget(cfg, free_at_start=TOTAL - GIB)  # a device of its own: the whole share, no warning
    assert budget == int(TOTAL * 0.9) - GIB - activation_reserve_bytes(cfg) and not caplog.records


def test_a_full_device_names_what_others_hold_and_no_negative_count(tiny_models, monkeypatch):
    """Other processes hold all but 1 GiB: the error says how many blocks fit (never a negative count), this
    engine's share, and what others hold."""
    cfg = _cuda_config(tiny_models["qwen3"], monkeypatch, free=GIB // 2)
    with pytest.raises(ValueError) as err:
        determine_num_blocks(cfg, free_at_start=GIB)
    msg = str(err.value)
    assert "holds 0 blocks" in msg and "is this engine's share" in msg
    assert "79.0 GiB held by other processes or engines" in msg  # 80 - 0.5 free - 0.5 its own


def test_a_cache_short_of_one_sequence_names_the_length_it_fits(tiny_models, monkeypatch):
    """A KV budget for fewer blocks than one max_model_len sequence: the error names the longest max_model_len
    those blocks serve (vLLM's "estimated maximum model length"), the number a user passes next (session 36:
    DeepSeek-V2-Lite's 163,840 tokens on an 80 GiB card)."""
    cfg = EngineConfig(tiny_models["qwen3"], max_model_len=256, num_gpu_blocks_override=5)  # 16 blocks needed
    with pytest.raises(ValueError, match=r"holds 5 blocks .*these blocks fit max_model_len=80 at most"):
        determine_num_blocks(cfg)
    with pytest.raises(ValueError) as err:  # none at all: no length to suggest
        determine_num_blocks(EngineConfig(tiny_models["qwen3"], max_model_len=256, kv_cache_memory_bytes=1))
    assert "holds 0 blocks" in str(err.value) and "fit max_model_len" not in str(err.value)


def test_configs_that_name_the_mlp_width_otherwise_size_the_cache_and_shard(tmp_path, monkeypatch):
    """GPT-2 / GPT-J / GPT-BigCode (`n_inner`, null: 4 x hidden), OPT (`ffn_dim`) and Falcon (`ffn_hidden_size`)
    configs have no `intermediate_size`: the activation reserve on CUDA and the tensor-parallel check read the width
    under its own name (both raised AttributeError on a real GPT-2 config before session 36: the tests' configs
    carried an extra intermediate_size). A multi-query model cannot split its one K/V head: a clear error."""
    import transformers

    from replayllm.model_config import mlp_width
    from replayllm.model_runner_v2.kv_cache import layer_temporaries_per_token

    made = {"gpt2": transformers.GPT2LMHeadModel(transformers.GPT2Config(
                vocab_size=300, n_embd=64, n_layer=2, n_head=4, n_positions=256)),
            "opt": transformers.OPTForCausalLM(transformers.OPTConfig(
                vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=96,
                word_embed_proj_dim=64, max_position_embeddings=256)),
            "bigcode": transformers.GPTBigCodeForCausalLM(transformers.GPTBigCodeConfig(
                vocab_size=300, n_embd=64, n_layer=2, n_head=4, n_positions=256, n_inner=96))}
    for name, model in made.items():
        model.save_pretrained(str(tmp_path / name))
    widths = {"gpt2": 256, "opt": 96, "bigcode": 96}
    for name, width in widths.items():
        cfg = _cuda_config(str(tmp_path / name), monkeypatch, free=TOTAL - GIB)
        assert not hasattr(cfg.model_config.hf_config, "intermediate_size") or name == "opt"
        assert mlp_width(cfg.model_config.hf_config) == width
        assert layer_temporaries_per_token(cfg) > 0 and activation_reserve_bytes(cfg) >= 2 << 30
        budget, _ = gpu_budget(cfg, free_at_start=TOTAL)
        assert budget == int(TOTAL * 0.9) - GIB - activation_reserve_bytes(cfg)
    assert EngineConfig(str(tmp_path / "gpt2"), device="cpu", tensor_parallel_size=2).tensor_parallel_size == 2
    with pytest.raises(ValueError, match="must divide the model's num_key_value_heads=1"):
        EngineConfig(str(tmp_path / "bigcode"), device="cpu", tensor_parallel_size=2)
