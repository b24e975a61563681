"""The paged attention launchers' shared inputs (kernels/paged_attention.py): their validation, the output buffer,
the precision choice, and the score arguments (scale, window, soft cap, attention sinks) as the kernels take them."""

from __future__ import annotations

import torch

from .rounding import fp8_code

LOG2E = 1.4426950408889634


def check_attention_inputs(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Validates the shared inputs; returns q with a contiguous last dim and the GQA group size."""
    if q.dim() != 3 or kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"expected q [T, Hq, D] and kv_cache [2, blocks, block_size, Hkv, D], got "
                         f"{tuple(q.shape)} and {tuple(kv_cache.shape)}")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16) or (q.dtype != kv_cache.dtype
                                                                         and not fp8_code(kv_cache.dtype)):
        raise ValueError(f"q must be float32/bfloat16/float16 and kv_cache of q's dtype or an fp8 format, got "
                         f"{q.dtype} and {kv_cache.dtype}")
    if q.shape[2] != kv_cache.shape[4]:
        raise ValueError(f"head_dim mismatch: q {q.shape[2]} vs kv_cache {kv_cache.shape[4]}")
    num_heads, num_kv_heads = q.shape[1], kv_cache.shape[3]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must be int32 [B, max_blocks] with unit column stride, got "
                         f"{block_tables.dtype} {tuple(block_tables.shape)}")
    if seq_lens.dtype != torch.int64 or not seq_lens.is_contiguous():
        raise ValueError(f"seq_lens must be contiguous int64, got {seq_lens.dtype}")
    block_size = kv_cache.shape[2]
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if q.stride(2) != 1:
        q = q.contiguous()
    return q, num_heads // num_kv_heads


def upcast(q: torch.Tensor) -> bool:
    """fp32 dots for fp32 inputs (exact parity with torch) and off CUDA (the interpreter's bf16 math is broken)."""
    return q.dtype == torch.float32 or q.device.type != "cuda"


def out_buffer(shape: tuple[int, ...], q: torch.Tensor) -> torch.Tensor:
    """The kernels' output buffer: q's dtype on CUDA; fp32 under the interpreter, whose fp32 -> bf16 store
    truncates instead of rounding to nearest (the launcher casts with torch afterwards)."""
    dtype = q.dtype if q.device.type == "cuda" else torch.float32
    return torch.empty(shape, dtype=dtype, device=q.device)


def score_args(scale: float, window: int, softcap: float) -> tuple[float, int, float]:
    """The kernels' (scale_log2, window, softcap) arguments: scores in base 2, s * scale * log2(e); with a cap,
    cap * tanh(s * scale / cap) * log2(e) (attention_tile.attend_tile), so scale / cap and cap * log2(e)."""
    if softcap > 0:
        return scale / softcap, window, softcap * LOG2E
    return scale * LOG2E, window, 0.0


def local_args(window: int, chunk: int) -> tuple[int, bool]:
    """The kernels' (window, CHUNKED) arguments for a sliding window (window > 0) or chunked attention (chunk > 0,
    passed in the same `window` slot): at most one of them; (0, False) for the full causal mask."""
    if window < 0 or chunk < 0 or (window and chunk):
        raise ValueError(f"window ({window}) and chunk ({chunk}) must be >= 0, and not both > 0")
    return (chunk, True) if chunk else (window, False)


def alibi_args(alibi: torch.Tensor | None, q: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The kernels' (alibi_ptr, ALIBI) arguments: ALiBi's slope per q head ([Hq] fp32: BLOOM's, MPT's), each score
    plus slope * (key position - query position), or (q, False): none, the pointer unread."""
    if alibi is None:
        return q, False
    if alibi.dim() != 1 or alibi.shape[0] != q.shape[1] or alibi.dtype != torch.float32 or alibi.stride(0) != 1:
        raise ValueError(f"alibi must be one fp32 slope per q head ({q.shape[1]}), contiguous, got {alibi.dtype} "
                         f"{tuple(alibi.shape)}")
    return alibi, True


def sinks_args(sinks: torch.Tensor | None, q: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The kernels' (sinks_ptr, SINKS) arguments: GPT-OSS's attention sinks, one logit per q head ([Hq], any float
    dtype, read as fp32 and scaled to base 2 in the kernel), or (q, False): no sink, the pointer unread."""
    if sinks is None:
        return q, False
    if sinks.dim() != 1 or sinks.shape[0] != q.shape[1] or not sinks.is_floating_point() or sinks.stride(0) != 1:
        raise ValueError(f"sinks must be one float per q head ({q.shape[1]}), contiguous, got {sinks.dtype} "
                         f"{tuple(sinks.shape)}")
    return sinks, True
