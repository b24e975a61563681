"""fp8 checkpoints (config.json `quantization_config.quant_method` "fp8", or compressed-tensors' "float-quantized":
fp8_checkpoint_config.py reads which, and the block size), dequantized at load: each quantized weight is stored as
e4m3 (or e5m2) values beside a scale tensor, and the model gets value * scale in its own dtype.

Two layouts, by the scale's name:
- `<w>.weight_scale_inv` [ceil(N / bn), ceil(K / bk)] fp32 with `weight_block_size` [bn, bk] (DeepSeek-V3 / R1,
  Qwen3-*-FP8, GLM-4.5-FP8, MiniMax-M2): element (n, k) times the scale of its block (n // bn, k // bk). Despite
  its name the scale multiplies (as transformers' `Fp8Dequantize` and vLLM apply it);
- `<w>.weight_scale`, one per tensor or per output row (AutoFP8; llm-compressor's FP8 / FP8-dynamic exports), or
  per block (its FP8-block exports, `block_structure`).
The product is taken in fp32 and rounded once to the model dtype, transformers' `dequantize=True` to the bit
(`tests/model_runner/test_fp8_checkpoint.py`). Activation scales (`input_scale`) and KV-cache scales (`k_scale`,
`v_scale`, `kv_scale`) belong to fp8 GEMMs and an fp8 cache this dequantized model does not run: they are dropped
(the engine's own `quantization="fp8"` / `kv_cache_dtype="fp8"` options quantize again, with their own scales).

A weight and its scale may sit in different files (sharded checkpoints): `dequantize_fp8_weights` holds whichever
comes first until its partner arrives; the names that carry a scale are known up front (`scaled_weight_names`,
from the files' headers), so unquantized tensors (norms, embeddings, routers, `modules_to_not_convert`) pass
straight through."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator

import torch

logger = logging.getLogger(__name__)

SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale")  # the multiplier of <name>.weight
DROPPED_SUFFIXES = (".input_scale", ".k_scale", ".v_scale", ".kv_scale")  # fp8 GEMM / fp8 cache scales: not used


def scaled_weight_names(names: Iterable[str]) -> set[str]:
    """The `<w>.weight` names whose scale tensor a checkpoint holds (its files' tensor names)."""
    out = set()
    for name in names:
        for suffix in SCALE_SUFFIXES:
            if name.endswith(suffix):
                out.add(name[: -len(suffix)] + ".weight")
    return out


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, dtype: torch.dtype
                   ) -> torch.Tensor:
    """q [..., N, K] fp8 (or already upcast), scale: one value, [..., N] / [..., N, 1] per row, or the block grid
    [..., ceil(N / bn), ceil(K / bk)] -> q * scale [..., N, K] in `dtype` (fp32 product, one rounding)."""
    values, s = q.to(torch.float32), scale.to(torch.float32)
    if s.numel() == 1:
        return (values * s.reshape(())).to(dtype)
    rows, cols = values.shape[-2:]
    lead = tuple(values.shape[:-2])
    if block is not None:
        grid = (*lead, math.ceil(rows / block[0]), math.ceil(cols / block[1]))
        if tuple(s.shape) != grid:
            raise ValueError(f"fp8 weight {tuple(values.shape)} with blocks {list(block)} needs a scale grid "
                             f"{list(grid)}, got {list(s.shape)}")
        s = s.repeat_interleave(block[0], dim=-2)[..., :rows, :].repeat_interleave(block[1], dim=-1)[..., :cols]
        return (values * s).to(dtype)
    if s.numel() == math.prod(lead) * rows:  # one per output row
        return (values * s.reshape(*lead, rows, 1)).to(dtype)
    raise ValueError(f"fp8 weight {tuple(values.shape)}: a scale of shape {list(s.shape)} is neither one value nor "
                     "one per row, and quantization_config names no weight_block_size")


def dequantize_fp8_weights(weights: Iterable[tuple[str, torch.Tensor]], scaled: set[str],
                           block: tuple[int, int] | None, dtype: torch.dtype, device: torch.device | None = None
                           ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's (name, tensor) stream with every weight in `scaled` dequantized (on `device`, None: where
    it was read) once its scale has come (or the scale once its weight has), the scales and the activation / cache
    scales consumed; any other tensor as it comes. A weight whose scale never comes (or the reverse) is a
    ValueError at the end."""
    values: dict[str, torch.Tensor] = {}  # weight name -> its fp8 tensor, waiting for its scale
    scales: dict[str, torch.Tensor] = {}  # weight name -> its scale, waiting for the weight
    dropped = 0
    for name, tensor in weights:
        if name.endswith(DROPPED_SUFFIXES):
            dropped += 1
            continue
        suffix = next((s for s in SCALE_SUFFIXES if name.endswith(s)), None)
        weight_name = name[: -len(suffix)] + ".weight" if suffix else name
        if weight_name not in scaled:
            yield name, tensor
            continue
        (scales if suffix else values)[weight_name] = tensor
        if weight_name in scales and weight_name in values:
            try:
                q, scale = values.pop(weight_name), scales.pop(weight_name)
                if device is not None:
                    q, scale = q.to(device), scale.to(device)
                yield weight_name, dequantize_fp8(q, scale, block, dtype)
            except ValueError as e:
                raise ValueError(f"checkpoint tensor {weight_name!r}: {e}") from None
    held = sorted(values) + sorted(f"the scale of {n}" for n in scales)
    if held:
        raise ValueError(f"fp8 checkpoint: {len(held)} weights or scales without their partner, e.g. "
                         f"{sorted(held)[:3]}")
    if dropped:
        logger.info("fp8 checkpoint: %d activation / KV-cache scales not used (weights dequantized at load)",
                    dropped)
