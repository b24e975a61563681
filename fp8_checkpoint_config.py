"""Ground floor: which stored-fp8 checkpoint a `quantization_config` describes, and its weight block size, read
without torch or transformers (model_config checks it at start-up; the loader's dequantizer,
model_runner_v2/quantization/fp8_checkpoint.py, applies it).

Two config forms name fp8 weights with a scale tensor beside each:
- `quant_method: "fp8"` (DeepSeek-V3 / R1, Qwen3-*-FP8, GLM-4.5-FP8, MiniMax-M2; AutoFP8): `weight_block_size`
  [bn, bk] with `<w>.weight_scale_inv` per block, or none with `<w>.weight_scale` per tensor / row;
- `quant_method: "compressed-tensors"` with `format: "float-quantized"` (llm-compressor's FP8 / FP8-dynamic /
  FP8-block exports, e.g. RedHatAI's): every config group's `weights` 8-bit symmetric floats, `strategy` "tensor",
  "channel" or "block" (`block_structure` [bn, bk]), `<w>.weight_scale` beside each weight.
Anything else under compressed-tensors (int4 / int8 packs, asymmetric zero points, nvfp4, a sparse format) is
refused by name: its tensors would load as something else."""

from __future__ import annotations

from typing import Any

FP8_METHOD, COMPRESSED_TENSORS = "fp8", "compressed-tensors"


def _get(obj: Any, key: str, default=None):
    return obj.get(key, default) if isinstance(obj, dict) else getattr(obj, key, default)


def _block(block, what: str) -> tuple[int, int] | None:
    if block is None:
        return None
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ValueError(f"quantization_config {what} must be two positive integers, got {block!r}")
    return int(block[0]), int(block[1])


def is_fp8_checkpoint(quant) -> bool:
    """Whether `quant` (config.json's quantization_config, or None) describes fp8 weights this build dequantizes."""
    return bool(quant) and _get(quant, "quant_method") in (FP8_METHOD, COMPRESSED_TENSORS)


def fp8_weight_block(quant) -> tuple[int, int] | None:
    """The weight block [bn, bk] of an fp8 checkpoint's config, None for per-tensor / per-row scales; ValueError for
    a compressed-tensors config whose weights are not fp8 (or an fp8 form this build does not read)."""
    if _get(quant, "quant_method") == FP8_METHOD:
        return _block(_get(quant, "weight_block_size"), "weight_block_size")
    fmt = _get(quant, "format")
    if fmt != "float-quantized":
        raise ValueError(f"compressed-tensors format {fmt!r} is not supported (only 'float-quantized': fp8 weights "
                         "with their scales, dequantized at load)")
    blocks = set()
    for name, group in (_get(quant, "config_groups") or {}).items():
        w = _get(group, "weights") or {}
        strategy = _get(w, "strategy")
        if (_get(w, "type") != "float" or _get(w, "num_bits") != 8 or not _get(w, "symmetric", True)
                or strategy not in ("tensor", "channel", "block")):
            raise ValueError(f"compressed-tensors group {name!r}: weights {dict(w) if isinstance(w, dict) else w!r} "
                             "are not symmetric 8-bit floats per tensor, channel or block (the fp8 form dequantized "
                             "here)")
        blocks.add(_block(_get(w, "block_structure"), "block_structure") if strategy == "block" else None)
    if len(blocks) > 1:
        raise ValueError(f"compressed-tensors groups with different weight blocks {sorted(map(str, blocks))}")
    return blocks.pop() if blocks else None
