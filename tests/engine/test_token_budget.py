"""The default step token budget (config.default_token_budget: vLLM's rule, 16,384 on a large non-A100 GPU, else
8,192) and the GPU memory the KV cache leaves for a full budget's eager step (kv_cache.activation_reserve_bytes)."""

from __future__ import annotations

import types

import pytest
import torch

from replayllm.config import EngineConfig, default_token_budget
from replayllm.model_runner_v2.kv_cache import activation_reserve_bytes, layer_temporaries_per_token


@pytest.mark.parametrize("name, gib, budget", [
    ("NVIDIA H200", 141, 16384), ("NVIDIA H100 80GB HBM3", 80, 16384), ("AMD Instinct MI300X", 192, 16384),
    ("NVIDIA A100-SXM4-80GB", 80, 8192), ("NVIDIA L4", 22, 8192), ("NVIDIA A10G", 24, 8192),
    ("NVIDIA GeForce RTX 4090", 24, 8192), ("NVIDIA L40S", 45, 8192)])
def test_default_budget_follows_the_gpu(monkeypatch, name, gib, budget):
    props = types.SimpleNamespace(name=name, total_memory=gib << 30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    assert default_token_budget(torch.device("cuda")) == budget
    assert default_token_budget(torch.device("cuda:1")) == budget


def test_default_budget_on_cpu_and_given_budgets_win(tiny_models, monkeypatch):
    def no_cuda(device):
        raise AssertionError("a CPU engine must not ask CUDA for its budget")

    monkeypatch.setattr(torch.cuda, "get_device_properties", no_cuda)
    assert default_token_budget(torch.device("cpu")) == 8192
    assert EngineConfig(tiny_models["qwen3"]).max_num_batched_tokens == 8192
    assert EngineConfig(tiny_models["qwen3"], max_num_batched_tokens=100).max_num_batched_tokens == 100
    # Without chunked prefill a whole prompt must fit a step: at least max_model_len (512 for the tiny model).
    monkeypatch.setattr("replayllm.config.TOKEN_BUDGET", 300)
    assert EngineConfig(tiny_models["qwen3"]).max_num_batched_tokens == 300
    assert EngineConfig(tiny_models["qwen3"], enable_chunked_prefill=False).max_num_batched_tokens == 512


def _cfg(hidden: int, intermediate: int, heads: int, kv_heads: int, budget: int, replay: bool = False):
    mc = types.SimpleNamespace(vocab_size=151_936, dtype=torch.bfloat16, num_heads=heads, num_kv_heads=kv_heads,
                               head_dim=128, hf_config=types.SimpleNamespace(hidden_size=hidden,
                                                                             intermediate_size=intermediate))
    return types.SimpleNamespace(model_config=mc, max_num_seqs=256, max_num_batched_tokens=budget,
                                 enable_trace_replay=replay, speculative_config=None, enable_fp32_lm_head=False,
                                 use_piecewise_cuda_graphs=False)


def test_reserve_covers_one_layer_of_a_full_eager_step():
    """A step of the whole budget runs eagerly (above the piecewise graphs' sizes): the reserve holds one layer's
    temporaries for all its tokens once they outgrow 1 GiB, on top of the logits."""
    small = _cfg(1024, 3072, 16, 8, 16384)  # Qwen3-0.6B: 102,400 B a token
    assert layer_temporaries_per_token(small) == (8 * 1024 + 3 * 3072 + 2 * 32 * 128) * 4 == 102_400
    assert activation_reserve_bytes(small) == 2 << 30  # 78 MB of logits + 1.7 GB: under the 2 GiB floor
    replay = _cfg(1024, 3072, 16, 8, 16384, replay=True)
    assert activation_reserve_bytes(replay) == 16384 * 151_936 * 2 + 16384 * 102_400
    big = _cfg(4096, 14336, 32, 8, 16384)  # an 8B shape: 352,256 B a token, 5.8 GB a full step
    assert layer_temporaries_per_token(big) == 352_256
    assert activation_reserve_bytes(big) == 256 * 151_936 * 2 + 16384 * 352_256
    # At 8,192 tokens the small model's temporaries stay under the 1 GiB the reserve always had.
    assert activation_reserve_bytes(_cfg(1024, 3072, 16, 8, 8192, replay=True)) == 8192 * 151_936 * 2 + (1 << 30)
