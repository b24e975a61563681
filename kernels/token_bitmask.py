"""Structured outputs: set the logits of tokens a grammar forbids to -inf, from xgrammar's packed bitmask."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dispatch import use_fused_kernels

_BLOCK = 2048  # tokens per program (64 bitmask words)


@triton.jit
def _token_bitmask_kernel(
    logits_ptr,  # [R, V] float, written in place (masked tokens -> -inf)
    logits_stride,  # elements between two logits rows
    rows_ptr,  # [G] int64, the logits row of each bitmask row
    bitmask_ptr,  # [G, W] int32, bit j of word i set = token 32*i + j allowed
    bitmask_stride,  # elements between two bitmask rows
    vocab_size,  # V: tokens at or past it are never touched
    BLOCK: tl.constexpr,
):
    # Grid (G, cdiv(V, BLOCK)): one bitmask row, one block of tokens per program.
    g = tl.program_id(0)
    tok = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = tok < vocab_size
    word = tl.load(bitmask_ptr + g * bitmask_stride + tok // 32, mask=in_vocab, other=-1)
    allowed = ((word >> (tok % 32)) & 1) != 0
    row = tl.load(rows_ptr + g)
    tl.store(logits_ptr + row * logits_stride + tok, float("-inf"), mask=in_vocab & ~allowed)


def _check(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    if logits.dim() != 2 or bitmask.dim() != 2 or rows.dim() != 1:
        raise ValueError(f"want logits [R, V], rows [G], bitmask [G, W]; got {tuple(logits.shape)}, "
                         f"{tuple(rows.shape)}, {tuple(bitmask.shape)}")
    if rows.dtype != torch.int64 or bitmask.dtype != torch.int32:
        raise ValueError(f"rows must be int64 and bitmask int32, got {rows.dtype} and {bitmask.dtype}")
    if rows.shape[0] != bitmask.shape[0]:
        raise ValueError(f"rows has {rows.shape[0]} entries but bitmask {bitmask.shape[0]} rows")
    if bitmask.shape[1] * 32 < logits.shape[1]:
        raise ValueError(f"bitmask width {bitmask.shape[1]} covers {bitmask.shape[1] * 32} tokens, logits have "
                         f"{logits.shape[1]}")
    if not (logits.device == rows.device == bitmask.device):
        raise ValueError("logits, rows and bitmask must be on one device")


def token_bitmask_triton(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Triton launcher: `logits[rows[g], t] = -inf` wherever bit t of `bitmask[g]` is 0 (t < V); other rows
    and allowed tokens are untouched. One launch for the whole batch."""
    _check(logits, rows, bitmask)
    if logits.stride(1) != 1 or bitmask.stride(1) != 1:
        raise ValueError("logits and bitmask rows must be contiguous")
    num_rows, vocab = bitmask.shape[0], logits.shape[1]
    if num_rows == 0:
        return
    grid = (num_rows, triton.cdiv(vocab, _BLOCK))
    _token_bitmask_kernel[grid](logits, logits.stride(0), rows, bitmask, bitmask.stride(0), vocab, BLOCK=_BLOCK)


def token_bitmask_torch(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Plain-torch reference of `token_bitmask_triton` (same arguments and in-place semantics)."""
    _check(logits, rows, bitmask)
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).bool().reshape(bitmask.shape[0], -1)[:, :vocab]  # [G, V]
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """The Triton kernel on CUDA (and on CPU under the interpreter when kernels/dispatch.py asks). On CPU
    otherwise xgrammar's own C++ op (5x the torch reference's speed; xgrammar is installed wherever grammars are
    compiled), or the torch reference if xgrammar is missing."""
    if use_fused_kernels(logits.device):
        token_bitmask_triton(logits, rows, bitmask)
        return
    try:
        import xgrammar
    except ImportError:
        xgrammar = None
    if xgrammar is None or logits.device.type != "cpu" or logits.dtype != torch.float32:
        token_bitmask_torch(logits, rows, bitmask)
        return
    _check(logits, rows, bitmask)
    vocab = logits.shape[1]
    if rows.shape[0] == logits.shape[0]:  # every row has a grammar (rows are increasing: 0 .. R-1)
        xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab)
        return
    # xgrammar indexes logits and bitmask with the same row numbers: mask a gathered copy of the G rows.
    sub = logits.index_select(0, rows)  # [G, V]
    xgrammar.apply_token_bitmask_inplace(sub, bitmask, vocab_size=vocab)
    logits.index_copy_(0, rows, sub)
