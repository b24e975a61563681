"""Attention layer over the paged KV cache: the plain-torch backend (CPU and GPU) and the Triton one."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.batch_invariant_attention import paged_attention_invariant_torch, paged_attention_invariant_triton
from ..kernels.dispatch import use_fused_kernels
from ..kernels.kv_cache_write import write_kv_cache_torch, write_kv_cache_triton
from ..kernels.paged_attention import paged_decode_attention, paged_prefill_attention
from .forward_context import AttentionMetadata, get_forward_context


def write_kv_cache(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """kv_cache [2, num_blocks, block_size, Hkv, D]; k, v [T, Hkv, D]; slot_mapping [T] (flat slot ids).
    One Triton launch for K and V where `use_fused_kernels` says so (CUDA), else two torch index_copy_."""
    if use_fused_kernels(kv_cache.device):
        write_kv_cache_triton(kv_cache, k, v, slot_mapping)
    else:
        write_kv_cache_torch(kv_cache, k, v, slot_mapping)


def paged_attention_torch(
    q: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Causal attention of every scheduled query token over its request's cached context.

    q [T, Hq, D] -> [T, Hq, D]. Requests are padded to [B, max_query_len] queries and [B, max_seq_len] keys
    (gathered through the block table), so there is no per-request Python loop and no host sync.
    """
    num_tokens, num_heads, head_dim = q.shape
    block_size = kv_cache.shape[2]
    num_kv_heads = kv_cache.shape[3]
    device = q.device
    num_reqs = md.seq_lens.shape[0]
    q_lens = md.query_start_loc[1:] - md.query_start_loc[:-1]  # [B]

    # Padded query gather: row b, column i -> token query_start_loc[b] + i (valid while i < q_len[b]).
    qi = torch.arange(md.max_query_len, device=device)
    q_valid = qi[None, :] < q_lens[:, None]  # [B, Q]
    q_tok = (md.query_start_loc[:-1, None] + qi[None, :]).clamp(max=num_tokens - 1)  # [B, Q]
    qp = q[q_tok]  # [B, Q, Hq, D]

    # Key gather through the block table: position j of row b lives in slot table[b, j // bs] * bs + j % bs.
    kj = torch.arange(md.max_seq_len, device=device)
    blocks = md.block_tables[:, kj // block_size].long()  # [B, K]
    slots = blocks * block_size + (kj % block_size)[None, :]
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    kp = flat[0][slots]  # [B, K, Hkv, D]
    vp = flat[1][slots]

    # Query i of row b sits at absolute position seq_len - q_len + i and sees keys j <= that position.
    q_pos = (md.seq_lens - q_lens)[:, None] + qi[None, :]  # [B, Q]
    mask = kj[None, None, :] <= q_pos[:, :, None]  # [B, Q, K]
    mask = mask & q_valid[:, :, None]
    mask[:, :, 0] |= ~q_valid  # padded query rows attend to key 0 (discarded) instead of producing NaN

    out = F.scaled_dot_product_attention(
        qp.transpose(1, 2).to(kp.dtype),
        kp.transpose(1, 2),
        vp.transpose(1, 2),
        attn_mask=mask[:, None, :, :],
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )  # [B, Hq, Q, D]
    out = out.transpose(1, 2)  # [B, Q, Hq, D]
    result = torch.empty_like(q)
    result[q_tok[q_valid]] = out[q_valid].to(q.dtype)
    del num_reqs
    return result


def paged_attention_triton(
    q: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Same contract as `paged_attention_torch`, with the Triton kernels of `kernels/paged_attention.py`:
    the split-context decode kernel when every row has one query token, else the varlen prefill kernel
    (which also serves the decode rows of a mixed batch)."""
    if md.max_query_len == 1:
        return paged_decode_attention(q, kv_cache, md.seq_lens, md.block_tables, scale, md.max_seq_len)
    return paged_prefill_attention(q, kv_cache, md.query_start_loc, md.seq_lens, md.block_tables, scale,
                                   md.max_query_len)


def invariant_attention_torch(q: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata,
                              scale: float) -> torch.Tensor:
    """Batch-invariant mode, "torch" backend (CPU): fixed KV tiles per token (kernels/batch_invariant_attention.py)."""
    return paged_attention_invariant_torch(q, kv_cache, md.token_req_idx, md.positions, md.block_tables, scale,
                                           md.max_seq_len)


def invariant_attention_triton(q: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata,
                               scale: float) -> torch.Tensor:
    """Batch-invariant mode, "triton" backend: one fixed-tile kernel for prefill, chunks and decode alike."""
    return paged_attention_invariant_triton(q, kv_cache, md.query_start_loc, md.seq_lens, md.block_tables, scale,
                                            md.max_query_len)


ATTENTION_IMPLS = {"torch": paged_attention_torch, "triton": paged_attention_triton}  # by ForwardContext.attn_backend
INVARIANT_ATTENTION_IMPLS = {"torch": invariant_attention_torch, "triton": invariant_attention_triton}


class Attention(nn.Module):
    """Writes this step's K/V into the layer's paged cache, then attends. q [T, Hq*D], k/v [T, Hkv*D].
    `batch_invariant` (set by `models/layers.set_batch_invariant`) picks INVARIANT_ATTENTION_IMPLS."""

    batch_invariant = False

    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        md = ctx.attn_metadata
        kv_cache = ctx.kv_caches[self.layer_idx]
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        write_kv_cache(kv_cache, k, v, md.slot_mapping)
        if ctx.split is not None:  # piecewise CUDA graphs: the graph ends here, attention runs between graphs
            return ctx.split.attention(self, q, kv_cache, md)
        return self.compute(q, kv_cache, md, ctx.attn_backend).reshape(-1, self.num_heads * self.head_dim)

    def compute(self, q: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata, backend: str) -> torch.Tensor:
        """The attention itself (the K/V of this step already in `kv_cache`): q [T, Hq, D] -> [T, Hq, D]."""
        impls = INVARIANT_ATTENTION_IMPLS if self.batch_invariant else ATTENTION_IMPLS
        return impls[backend](q, kv_cache, md, self.scale)
