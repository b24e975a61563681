"""An fp8 checkpoint made from a saved one, as DeepSeek-V3's / Qwen3-FP8's releases store theirs: every 2-D weight of
the decoder layers (not the norms, not the routers) as e4m3 values with a `weight_scale_inv` per block of `block`
(the block's max |w| / 448), the scales in a second shard (model.safetensors.index.json), and `quantization_config`
{"quant_method": "fp8", "weight_block_size": block}; beside it the same checkpoint with each quantized weight
replaced by its dequantized value, which transformers' own dequantization (`Fp8Dequantize`, its `dequantize=True`
load) computes: the reference the fp8 checkpoint must load as."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file, save_file


def transformers_dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """transformers' FineGrainedFP8 dequantization of one weight (its block size from the scale grid)."""
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    if not hasattr(fp8, "Fp8Dequantize"):
        pytest.skip("this transformers has no Fp8Dequantize (the reference dequantization)")
    return fp8.Fp8Dequantize(None)._dequantize_one(q, scale, output_dtype=dtype)


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (q [N, K] e4m3, scale_inv [ceil(N / bn), ceil(K / bk)] fp32), w ~ q * scale per block."""
    rows, cols = w.shape
    grid = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    scale = torch.empty(grid, dtype=torch.float32)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(grid[0]):
        for j in range(grid[1]):
            part = w[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]].float()
            scale[i, j] = part.abs().amax().clamp(min=1e-12) / 448.0
            q[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] = (part / scale[i, j]).to(q.dtype)
    return q, scale


def quantized(name: str, tensor: torch.Tensor) -> bool:
    """The weights an fp8 release quantizes: the layers' 2-D projection weights (not norms, routers or biases)."""
    return (name.startswith("model.layers.") and name.endswith(".weight") and tensor.dim() == 2
            and "norm" not in name and not name.endswith(".gate.weight"))


def compressed_tensors_config(strategy: str, block: tuple[int, int] | None = None) -> dict:
    """llm-compressor's quantization_config for fp8 weights per `strategy` ("channel": FP8-dynamic, "block")."""
    weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False}
    if block is not None:
        weights["block_structure"] = list(block)
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "ignore": ["lm_head"], "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                                                  "input_activations": {"num_bits": 8, "type": "float",
                                                                                        "strategy": "token",
                                                                                        "dynamic": True}}}}


def save_fp8_checkpoint(src, fp8_dir, dequant_dir, block: tuple[int, int], extra_tensors: dict | None = None,
                        form: str = "fp8") -> int:
    """fp8_dir: src's checkpoint in fp8 (two shards: weights, then the scales and `extra_tensors`): `form` "fp8"
    (DeepSeek-V3's: `weight_scale_inv` per block of `block`), "ct-block" (llm-compressor's FP8-block: `weight_scale`
    per block) or "ct-channel" (its FP8-dynamic: `weight_scale` per output row); dequant_dir: src's with the
    quantized weights replaced by transformers' dequantization (fp32). The other files (tokenizer, generation
    config) linked. Returns how many weights were quantized."""
    tensors = load_file(os.path.join(src, "model.safetensors"))
    weights, scales, plain = {}, dict(extra_tensors or {}), {}
    suffix = "_scale_inv" if form == "fp8" else "_scale"
    for name, t in tensors.items():
        if quantized(name, t):
            q, s = quantize_blocks(t, (1, t.shape[1]) if form == "ct-channel" else block)
            weights[name], scales[name + suffix] = q, s
            plain[name] = transformers_dequantize(q, s, torch.float32)
        else:
            weights[name] = plain[name] = t
    os.makedirs(fp8_dir)
    os.makedirs(dequant_dir)
    save_file(weights, os.path.join(fp8_dir, "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
    save_file(scales, os.path.join(fp8_dir, "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
    index = {n: "model-00001-of-00002.safetensors" for n in weights}
    index.update({n: "model-00002-of-00002.safetensors" for n in scales})
    with open(os.path.join(fp8_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": index}, f)
    save_file(plain, os.path.join(dequant_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(dequant_dir, "config.json"), "w") as f:
        json.dump(config, f)
    config["quantization_config"] = (
        {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
        if form == "fp8" else compressed_tensors_config("block", block) if form == "ct-block"
        else compressed_tensors_config("channel"))
    with open(os.path.join(fp8_dir, "config.json"), "w") as f:
        json.dump(config, f)
    for name in os.listdir(src):
        if name not in ("config.json", "model.safetensors"):
            for d in (fp8_dir, dequant_dir):
                os.symlink(os.path.join(src, name), os.path.join(d, name))
    return sum(1 for n in scales if n.endswith(suffix))
