"""quantize_model: swap every Linear inside the decoder layers for its quantized form, after the weights load."""

from __future__ import annotations

import torch
from torch import nn

from ...config import QUANTIZATION_METHODS
from ..models.layers import Linear
from ..models.parallel import RowParallelLinear
from .fp8 import Fp8Linear
from .int8 import Int8Linear

# method -> module class with `from_linear(linear)`; keys == the non-None entries of QUANTIZATION_METHODS.
QUANTIZED_LINEARS: dict[str, type[nn.Module]] = {"int8": Int8Linear, "fp8": Fp8Linear}


@torch.no_grad()
def quantize_model(model: nn.Module, method: str) -> int:
    """Replace qkv_proj / o_proj / gate_up_proj / down_proj of every layer in `model.model.layers` in place;
    returns how many were replaced. Embeddings and lm_head live outside the layers and stay in the model dtype
    (a tied lm_head is the embedding table itself). Each float weight is dropped as its layer is replaced, so
    the peak memory is the float model plus one quantized linear."""
    if method not in QUANTIZED_LINEARS:
        valid = [m for m in QUANTIZATION_METHODS if m is not None]
        raise ValueError(f"quantization={method!r} is not supported; choose None or one of {valid}")
    cls = QUANTIZED_LINEARS[method]
    # (parent, name) only: holding the Linear objects here would keep every float weight alive to the end.
    targets = [(parent, name) for parent in model.model.layers.modules()
               for name, child in parent.named_children() if isinstance(child, Linear)]
    device = None
    for parent, name in targets:
        linear = getattr(parent, name)
        device = linear.weight.device
        # A row-parallel shard quantizes its local weight and keeps its all-reduce (models/parallel.py).
        quantized = linear.quantize(cls) if isinstance(linear, RowParallelLinear) else cls.from_linear(linear)
        setattr(parent, name, quantized)
        del linear
    if device is not None and device.type == "cuda":
        torch.cuda.empty_cache()  # hand the float weights back, so the KV cache sizing (mem_get_info) sees them
    return len(targets)
