"""bench/arch_shapes.py's configs (the public models' shapes the W1-<name> benchmark rows run with dummy weights):
each is read by the engine and builds (on the meta device: no memory) a model of the published parameter count,
so a benchmark row measures the model it names."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import replayllm
from replayllm.config import ModelConfig
from replayllm.model_runner_v2.models.registry import get_model_class

_spec = importlib.util.spec_from_file_location("arch_shapes", Path(replayllm.__file__).parent / "bench" /
                                               "arch_shapes.py")
arch_shapes = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(arch_shapes)

# The model cards' parameter counts (billions), to 1%
PUBLISHED = {"phi-4-mini": 3.84, "glm-4-9b": 9.40, "stablelm-2-1.6b": 1.64, "pythia-1.4b": 1.41, "olmo-2-1b": 1.48,
             "granite-3.3-2b": 2.53, "smollm3-3b": 3.08, "gemma-2b": 2.51, "gemma-2-2b": 2.61, "gemma-3-1b": 1.00,
             "phi-2": 2.78, "aya-expanse-8b": 8.03, "starcoder2-3b": 3.03, "mistral-7b-v0.1": 7.24, "olmoe-1b-7b": 6.92,
             "gpt-oss-20b": 20.91,  # the model card's 20.91B (3.6B active)
             "deepseek-v2-lite": 15.7,  # the model card's 15.7B (2.4B active)
             "starcoderbase-1b": 1.14,  # its 4.55 GB fp32 safetensors: 1.137B
             "gpt-j-6b": 6.05,  # the model card's 6,053,381,344
             "falcon-7b": 6.92,  # its safetensors' 6,921,720,704
             "olmo-1b": 1.18,  # OLMo-1B-hf's 1,176,764,416
             "nemotron-4-15b": 15.7,  # its paper's 12.5B non-embedding + 3.2B embedding parameters
             "bloom-560m": 0.559,  # its model card's 559,214,592
             "mpt-7b": 6.65}  # 6,649,286,656 (its card rounds to 6.7B)


@pytest.mark.parametrize("name", list(arch_shapes.SHAPES))
def test_a_shape_builds_the_model_it_names(name, tmp_path):
    mc = ModelConfig.from_pretrained(arch_shapes.write_shape(name, str(tmp_path / name)))
    with torch.device("meta"):
        model = get_model_class([mc.architecture])(mc.hf_config)
    count = sum(p.numel() for p in model.parameters()) / 1e9
    assert count == pytest.approx(PUBLISHED[name], rel=0.01), count


@pytest.mark.parametrize("name", list(arch_shapes.SHAPES))
def test_a_shape_sizes_its_cuda_kv_cache(name, tmp_path):
    """The engine's config of each published shape (real config.json forms: GPT-2-family widths under n_inner /
    ffn_hidden_size, no intermediate_size) gets through what a GPU start computes before its weights: the
    activation reserve, the piecewise graphs' bound, a KV block's bytes (session 36: `intermediate_size` was read
    directly there, an AttributeError for those forms that only a GPU run would have met)."""
    from replayllm.config import EngineConfig
    from replayllm.model_runner_v2.kv_cache import activation_reserve_bytes, kv_block_bytes

    cfg = EngineConfig(arch_shapes.write_shape(name, str(tmp_path / name)), device="cpu", max_model_len=2048,
                       load_format="dummy")
    cfg.torch_device = torch.device("cuda")  # what gpu_budget reads; nothing here touches a device
    assert activation_reserve_bytes(cfg) >= 2 << 30 and kv_block_bytes(cfg) > 0


def test_unknown_names_are_refused():
    with pytest.raises(ValueError, match="unknown shape 'gpt-5'; known: phi-4-mini"):
        arch_shapes.write_shape("gpt-5")
