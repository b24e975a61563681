"""Batch-invariant paged attention: one kernel and one accumulation order for prefill, chunked prefill and decode.

A query token at absolute position p attends to keys 0..p. Both paths here walk those keys in fixed tiles that
start at key 0 (tile t = keys [t * N, (t + 1) * N), N fixed per dtype), with an online softmax in fp32 (the
kernel in base 2, the torch path in base e: torch.exp2's CPU SIMD body and scalar tail disagree in the last bit):

    m' = max(m, max_j s_j);  l' = l * e^(m - m') + sum_j e^(s_j - m');  acc' = acc * e^(m - m') + sum_j e^(s_j - m') v_j

A tile past p is masked for that query: m' = m, the factor is e^0 = 1 and every term is 0, so it leaves
(m, l, acc) bit-identical. Hence the bits of a query's output depend only on p and its keys: not on how many
queries share the step, the batch around it, whether its keys came from the prefix cache or an earlier chunk,
or how many tiles its program happens to walk. There is no split of the context (no split-KV reduction).

- `paged_attention_invariant_triton`: the varlen prefill kernel of kernels/paged_attention.py with a fixed
  number of query tokens per program, used for every step (decode too; CUDA graphs included).
- `paged_attention_invariant_torch`: the same recurrence in plain torch per scheduled token (the CPU path), every
  reduction a sum over a contiguous last dim of fixed length (D or N), which torch's CPU reduction computes in
  an order that depends on that length only. Not used on CUDA (torch's CUDA reductions depend on the shape).
"""

from __future__ import annotations

import torch
import triton

from .dispatch import max_shared_memory
from .kv_cache_read import gather_kv
from .paged_attention import paged_prefill_attention_triton

TORCH_KV_TILE = 32  # keys per tile of the torch path
# (BLOCK_N, num_warps, num_stages) of the kernel for 16-bit q with head_dim <= 128 (bench/batch_invariant_sweep.py,
# H200, 16 q / 8 kv heads of 128), against the launcher's (64, 4, 3): W1's decode step 108 us (125; the default
# decode kernel 102), a 16 x 256 prefill 89 us (110), 32 x 8192-key decodes 273 us (349), a 2 x 4096 prefill
# 1.31 ms (1.85). One warp, (32, 1, 4), is 4% faster on W1's decode but 1.6x slower on the long decode.
# fp32, wider heads, and GPUs whose shared memory cannot hold its K and V stages keep the launcher's tile.
TILE_16BIT = (128, 4, 3)
_NEG_INIT = -1.0e30  # initial running max, as in the kernel: finite, so a fully masked row stays at p = 0


def invariant_block_q(num_heads: int, num_kv_heads: int) -> int:
    """Query tokens per program of the invariant kernel: fixed by the model's GQA group (16 rows of
    (token, head) pairs, tl.dot's minimum M), never by the step's longest query."""
    return max(1, 16 // triton.next_power_of_2(num_heads // num_kv_heads))


def paged_attention_invariant_triton(q: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                                     seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                                     max_query_len: int, window: int = 0, softcap: float = 0.0,
                                     sinks: torch.Tensor | None = None, alibi: torch.Tensor | None = None,
                                     chunk: int = 0) -> torch.Tensor:
    """Same contract as `paged_prefill_attention_triton` (any mix of prefill chunks and decodes; `window`,
    `softcap`, `sinks`, `alibi` and `chunk` the same), with a fixed tile configuration: KV tiles of a BLOCK_N fixed
    by dtype and head_dim from key 0, `invariant_block_q` query tokens per program."""
    block_q = invariant_block_q(q.shape[1], kv_cache.shape[3])
    tile = TILE_16BIT if q.dtype != torch.float32 and q.shape[2] <= 128 else None
    smem = max_shared_memory(q.device)  # K and V tiles per stage must fit (192 KiB at head_dim 128: not an A100)
    if tile is not None and smem and 2 * tile[0] * max(16, triton.next_power_of_2(q.shape[2])) * 2 * tile[2] > smem:
        tile = None
    return paged_prefill_attention_triton(q, kv_cache, query_start_loc, seq_lens, block_tables, scale, max_query_len,
                                          block_q=block_q, tile=tile, window=window, softcap=softcap, sinks=sinks,
                                          alibi=alibi, chunk=chunk)


def paged_attention_invariant_torch(q: torch.Tensor, kv_cache: torch.Tensor, token_req_idx: torch.Tensor,
                                    positions: torch.Tensor, block_tables: torch.Tensor, scale: float,
                                    max_seq_len: int, window: int = 0, softcap: float = 0.0,
                                    sinks: torch.Tensor | None = None, alibi: torch.Tensor | None = None,
                                    chunk: int = 0) -> torch.Tensor:
    """q [T, Hq, D]; kv_cache [2, num_blocks, block_size, Hkv, D] (this step's K/V written); token_req_idx [T]
    int64 (batch row of each token); positions [T] int64 (absolute position: the token sees keys 0..p, with
    window > 0 only those past p - window, with chunk > 0 only those of p's chunk); block_tables [B, max_blocks]
    int32; max_seq_len: host int, tiles walked; softcap > 0: scores cap * tanh(s * scale / cap), the kernel's
    formula; sinks [Hq]: a sink logit per head folded in after the last tile, as the kernel does
    (attention_tile.fold_sink); alibi [Hq] fp32: each score plus slope * (key - query position), as the kernel
    adds it (attention_tile.alibi_bias, base e here). Returns [T, Hq, D] in q's dtype."""
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    device = q.device
    qg = q.float().reshape(num_tokens, num_kv_heads, group, 1, head_dim).contiguous()  # [T, Hkv, G, 1, D]
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    tables = block_tables[token_req_idx].long()  # [T, max_blocks]
    pos = positions[:, None]  # [T, 1]
    m = torch.full((num_tokens, num_kv_heads, group), _NEG_INIT, dtype=torch.float32, device=device)
    l = torch.zeros_like(m)
    acc = torch.zeros((num_tokens, num_kv_heads, group, head_dim), dtype=torch.float32, device=device)
    offs = torch.arange(TORCH_KV_TILE, device=device)
    for start in range(0, max_seq_len, TORCH_KV_TILE):
        kj = start + offs  # [N] key positions of this tile
        blk = (kj // block_size).clamp(max=tables.shape[1] - 1)  # past the table: masked below
        slots = tables[:, blk] * block_size + (kj % block_size)[None, :]  # [T, N]
        k = gather_kv(flat[0], slots, torch.float32).permute(0, 2, 1, 3).contiguous()  # [T, Hkv, N, D]
        v = gather_kv(flat[1], slots, torch.float32).permute(0, 2, 3, 1).contiguous()  # [T, Hkv, D, N]
        visible = kj[None, :] <= pos  # [T, N]
        if window:
            visible &= kj[None, :] > pos - window
        if chunk:
            visible &= kj[None, :] >= pos // chunk * chunk
        visible = visible[:, None, None, :]  # [T, 1, 1, N]
        s = (qg * k[:, :, None]).sum(-1)  # [T, Hkv, G, N, D] -> [T, Hkv, G, N]: a sum over D
        if softcap:  # the kernel's tanh (attention_tile.attend_tile), from exp
            s = softcap * (1.0 - 2.0 / (1.0 + torch.exp(s * (2.0 * scale / softcap))))
        else:
            s = s * scale
        if alibi is not None:  # [Hkv, G] slopes times [T, N] distances
            s = s + alibi.view(num_kv_heads, group)[None, :, :, None] * (kj[None, :] - pos).float()[:, None, None, :]
        s = torch.where(visible, s, float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        alpha = torch.exp(m - m_new)
        p = torch.exp(s - m_new[..., None])  # [T, Hkv, G, N]; masked keys: 0
        l = l * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + (p[:, :, :, None, :] * v[:, :, None]).sum(-1)  # [T,Hkv,G,D,N] -> sum over N
        m = m_new
    if sinks is not None:  # one more key of logit `sink` and value zero, per token alike
        sink = sinks.float().view(num_kv_heads, group).expand(num_tokens, -1, -1)  # [T, Hkv, G]
        m_new = torch.maximum(m, sink)
        alpha = torch.exp(m - m_new)
        l = l * alpha + torch.exp(sink - m_new)
        acc = acc * alpha[..., None]
    out = acc / torch.where(l > 0, l, 1.0)[..., None]
    return out.reshape(num_tokens, num_heads, head_dim).to(q.dtype)
