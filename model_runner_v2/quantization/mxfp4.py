"""MXFP4 (OCP microscaling FP4) weights, dequantized at load: openai's GPT-OSS checkpoints store each expert matrix
so (quantization_config {"quant_method": "mxfp4"}), as two tensors per weight:

  <name>_blocks  uint8 [..., rows, G, 16]   32 FP4 (e2m1) values per group of a row, two per byte, low nibble first
  <name>_scales  uint8 [..., rows, G]       the group's power-of-two scale, e8m0: 2^(s - 127)

value(row, 32 g + 2 b)     = E2M1[blocks[row, g, b] & 0xF] * 2^(scales[row, g] - 127)
value(row, 32 g + 2 b + 1) = E2M1[blocks[row, g, b] >> 4]  * 2^(scales[row, g] - 127)

Every such value is exact in bf16/fp16/fp32 (3 significant bits, a power-of-two scale), so the dequantized weights
are the checkpoint's weights bit for bit; they take 4x (bf16) the checkpoint's bytes (gpt-oss-20b: ~13 GB of MXFP4
experts become ~39 GB). The engine then runs its bf16 MoE kernels on them; a kernel that reads MXFP4 directly is
not built yet."""

from __future__ import annotations

import torch

# e2m1: sign, 2 exponent bits (bias 1), 1 mantissa bit; codes 0-7 positive, 8-15 their negatives.
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks uint8 [..., rows, G, 16], scales uint8 [..., rows, G] -> [..., rows, 32 G] in `dtype`. Works one
    slice of the leading dim at a time, so its temporaries stay a slice's size."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 3 or blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks [..., rows, G, 16] and scales [..., rows, G] do not match: "
                         f"{tuple(blocks.shape)} and {tuple(scales.shape)}")
    lut = torch.tensor(E2M1, dtype=torch.float32, device=blocks.device)
    lead = blocks.shape[:-2]
    flat_blocks, flat_scales = blocks.reshape(-1, *blocks.shape[-2:]), scales.reshape(-1, scales.shape[-1])
    out = torch.empty(flat_blocks.shape[0], blocks.shape[-2], 32, dtype=dtype, device=blocks.device)
    rows_per_slice = max(1, (1 << 22) // (blocks.shape[-2] * 32))  # ~4M values of temporaries at a time
    for r0 in range(0, flat_blocks.shape[0], rows_per_slice):
        blk = flat_blocks[r0:r0 + rows_per_slice].long()  # [r, G, 16]
        values = torch.stack((lut[blk & 0xF], lut[blk >> 4]), dim=-1).flatten(-2)  # [r, G, 32], low nibble first
        exponent = flat_scales[r0:r0 + rows_per_slice].to(torch.int32) - 127  # [r, G]
        out[r0:r0 + rows_per_slice] = torch.ldexp(values, exponent[..., None].float()).to(dtype)
    return out.reshape(*lead, -1)
