"""Build a model from a ModelConfig and fill its weights (safetensors checkpoint or seeded dummy values)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from ..config import ModelConfig
from .models.layers import set_batch_invariant
from .models.parallel import full_shape, full_to_local
from .models.registry import get_model_class
from .quantization.quantize import quantize_model

LOAD_FORMATS: tuple[str, ...] = ("auto", "safetensors", "dummy")
DUMMY_RANGE = 1e-3  # dummy matrices/biases ~ U(-1e-3, 1e-3): finite, non-degenerate logits at any depth


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(prev)


def safetensors_files(path: str) -> list[str]:
    """model.safetensors, or the shards named by model.safetensors.index.json (sorted, deduplicated)."""
    single = os.path.join(path, "model.safetensors")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(path, name) for name in shards]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise FileNotFoundError(f"shards listed in {index} are missing: {missing}")
        return files
    if os.path.isfile(single):
        return [single]
    raise FileNotFoundError(
        f"no weights in {path}: expected model.safetensors or model.safetensors.index.json "
        "(use load_format='dummy' for random weights)"
    )


def iterate_safetensors(files: list[str], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream (name, tensor) one tensor at a time; floating tensors are cast to `dtype`."""
    from safetensors import safe_open

    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                yield name, tensor.to(dtype) if tensor.is_floating_point() else tensor


@torch.no_grad()
def fill_dummy_weights(model: nn.Module, seed: int) -> None:
    """Norm weights = 1; every other parameter ~ U(-DUMMY_RANGE, DUMMY_RANGE).

    Drawn in fp32 on the CPU from one seeded generator, in parameter order, then cast and copied: the same
    seed gives the same weights on every device and dtype, so dummy runs stay comparable across them.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            # Drawn in the full (unsharded) shape: tensor-parallel ranks keep their part of the same model.
            values = torch.empty(full_shape(param), dtype=torch.float32)
            param.copy_(full_to_local(param, values.uniform_(-DUMMY_RANGE, DUMMY_RANGE, generator=gen)))


def load_model(
    model_config: ModelConfig,
    device: torch.device,
    load_format: str = "auto",
    seed: int = 0,
    quantization: str | None = None,
    fp32_lm_head: bool = False,
    batch_invariant: bool = False,
) -> nn.Module:
    """Model in `model_config.dtype` on `device`, weights loaded, in eval mode. With `quantization` ("int8" /
    "fp8"), the decoder layers' linears are then quantized from the loaded float weights (quantization/); with
    `fp32_lm_head`, the final norm and lm_head compute in fp32 (DecoderLM.enable_fp32_lm_head); with
    `batch_invariant`, linears and attention switch to their row-invariant implementations (set_batch_invariant)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r} is not supported; choose one of {LOAD_FORMATS}")
    # Find the files before allocating anything, so a bad path fails fast.
    files = safetensors_files(model_config.path) if load_format != "dummy" else []
    model_cls = get_model_class([model_config.architecture])
    with _default_dtype(model_config.dtype), torch.device(device):
        model = model_cls(model_config.hf_config)
    if load_format == "dummy":
        fill_dummy_weights(model, seed)
    else:
        model.load_weights(iterate_safetensors(files, model_config.dtype))
    if quantization is not None:
        quantize_model(model, quantization)
    if fp32_lm_head:
        model.enable_fp32_lm_head()
    if batch_invariant:
        set_batch_invariant(model)
    return model.eval()
