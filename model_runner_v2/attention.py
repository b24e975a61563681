"""Attention layer over the paged KV cache: the plain-torch backend (CPU and GPU) and the Triton one."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.batch_invariant_attention import (
    TORCH_KV_TILE,
    paged_attention_invariant_torch,
    paged_attention_invariant_triton,
)
from ..kernels.dispatch import env_flag, use_fused_kernels
from ..kernels.kv_cache_read import gather_kv
from ..kernels.kv_cache_write import write_kv_cache_torch
from ..kernels.paged_attention import paged_decode_attention_triton, paged_prefill_attention_triton
from ..kernels.rotary import KVWrite
from .attention_plan import PartCost, plan_attention
from .forward_context import AttentionMetadata, SplitTail, get_forward_context

TORCH_ATTENTION_WORKSPACE_BYTES = 256 << 20  # most bytes of padded temporaries per SDPA call (attention_plan.py)


def paged_attention_torch(q: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata, scale: float,
                          window: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None,
                          alibi: torch.Tensor | None = None,
                          workspace_bytes: int = TORCH_ATTENTION_WORKSPACE_BYTES, chunk: int = 0) -> torch.Tensor:
    """Causal attention of every scheduled query token over its request's cached context (window > 0: only the
    last `window` positions, the query's own included: sliding-window attention; chunk > 0: only the positions of
    the query's chunk, p // chunk * chunk on: Llama 4's chunked attention; softcap > 0: the scores capped,
    cap * tanh(s / cap), as Gemma 2's eager attention computes them; sinks [Hq]: one more logit per head in the
    softmax, attached to no value, as GPT-OSS's eager attention; alibi [Hq] fp32: ALiBi's slopes, each score plus
    slope * key position, as BLOOM's eager attention adds them).

    q [T, Hq, D] -> [T, Hq, D]. Each SDPA call pads its rows to [g, Q] queries and [g, K] keys (gathered through
    the block table); `plan_attention` picks the calls so that each one's temporaries stay within
    `workspace_bytes`: the whole step in one call when it fits (no per-request loop), else rows grouped by shape
    and long rows cut into query chunks. A step's attention memory is so bounded by the budget and the KV it reads,
    never rows x longest query x longest context.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = kv_cache.shape[3]
    qsl = md.host_query_start_loc if md.host_query_start_loc is not None else md.query_start_loc.cpu().numpy()
    seq_lens = md.host_seq_lens if md.host_seq_lens is not None else md.seq_lens.cpu().numpy()
    q_lens = qsl[1:] - qsl[:-1]  # [B]
    # Gathered K/V are converted to q's dtype (an fp8 cache's too): the temporaries are q-sized.
    cost = PartCost.for_heads(num_heads, num_kv_heads, head_dim, max(q.element_size(), kv_cache.element_size()),
                              eager=bool(softcap) or sinks is not None or alibi is not None)  # every head's scores
    result = torch.empty_like(q)
    for part in plan_attention(q_lens, seq_lens, cost, workspace_bytes):
        if part.rows is None:  # the whole step: the metadata's own device tensors, no copy
            tables, tok_start, q_count = md.block_tables, md.query_start_loc[:-1], md.query_start_loc.diff()
            pos_start = md.seq_lens - q_count
        else:  # [4, g]: first token, query count and first query's position per row, and the row
            host = np.stack([qsl[part.rows] + part.q_begin, part.q_count,
                             seq_lens[part.rows] - q_lens[part.rows] + part.q_begin, part.rows])
            tok_start, q_count, pos_start, rows = torch.from_numpy(host).to(q.device)
            tables = md.block_tables[rows]
        _padded_attention(q, kv_cache, tables, tok_start, q_count, pos_start, part.max_query_len,
                          part.max_seq_len, scale, result, window, softcap, sinks, alibi, chunk)
    return result


def _padded_attention(q: torch.Tensor, kv_cache: torch.Tensor, tables: torch.Tensor, tok_start: torch.Tensor,
                      q_count: torch.Tensor, pos_start: torch.Tensor, max_q: int, max_k: int, scale: float,
                      result: torch.Tensor, window: int = 0, softcap: float = 0.0,
                      sinks: torch.Tensor | None = None, alibi: torch.Tensor | None = None, chunk: int = 0
                      ) -> None:
    """One padded SDPA call over g rows: row b's queries are tokens tok_start[b] + i (i < q_count[b]) at absolute
    positions pos_start[b] + i; its keys are positions 0 .. max_k - 1 read through tables[b] ([g, >= ceil(max_k /
    block_size)] int32). Writes result [T, Hq, D] at the row's valid query tokens."""
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    device = q.device

    # Padded query gather: row b, column i -> token tok_start[b] + i (valid while i < q_count[b]).
    qi = torch.arange(max_q, device=device)
    q_valid = qi[None, :] < q_count[:, None]  # [g, Q]
    q_tok = (tok_start[:, None] + qi[None, :]).clamp(max=num_tokens - 1)  # [g, Q]
    qp = q[q_tok]  # [g, Q, Hq, D]

    # Key gather through the block table: position j of row b lives in slot table[b, j // bs] * bs + j % bs.
    kj = torch.arange(max_k, device=device)
    blocks = tables[:, kj // block_size].long()  # [g, K]
    slots = blocks * block_size + (kj % block_size)[None, :]
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    kp = gather_kv(flat[0], slots, q.dtype)  # [g, K, Hkv, D]
    vp = gather_kv(flat[1], slots, q.dtype)

    # Query i of row b sits at absolute position pos_start[b] + i and sees keys j <= that position.
    q_pos = pos_start[:, None] + qi[None, :]  # [g, Q]
    mask = kj[None, None, :] <= q_pos[:, :, None]  # [g, Q, K]
    if window:  # ... and, with a sliding window, only keys past q_pos - window
        mask &= kj[None, None, :] > q_pos[:, :, None] - window
    if chunk:  # ... and, in chunks, only keys of the query's chunk
        mask &= kj[None, None, :] >= q_pos[:, :, None] // chunk * chunk
    mask &= q_valid[:, :, None]
    mask[:, :, 0] |= ~q_valid  # padded query rows attend to key 0 (discarded) instead of producing NaN

    if softcap or sinks is not None or alibi is not None:
        bias = None if alibi is None else alibi.view(1, -1, 1, 1) * kj.float()  # [1, Hq, 1, K]: BLOOM's slope * key
        out = _eager_attention(qp.transpose(1, 2), kp.transpose(1, 2), vp.transpose(1, 2), mask[:, None], scale,
                               softcap, sinks, bias)
    else:
        out = F.scaled_dot_product_attention(
            qp.transpose(1, 2),
            kp.transpose(1, 2),
            vp.transpose(1, 2),
            attn_mask=mask[:, None, :, :],
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )  # [g, Hq, Q, D]
    out = out.transpose(1, 2)  # [g, Q, Hq, D]
    result[q_tok[q_valid]] = out[q_valid]


def _eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                     softcap: float, sinks: torch.Tensor | None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """q [g, Hq, Q, D], k/v [g, Hkv, K, D], mask [g, 1, Q, K] -> [g, Hq, Q, D]: transformers' eager attention where
    SDPA has no equivalent, op for op: Gemma 2's capped scores (times scale, / cap, tanh, * cap), GPT-OSS's sinks
    (a column of one logit per head appended to the masked scores, its probability dropped), BLOOM's ALiBi
    (`bias` [1, Hq, 1, K] fp32 plus the scaled scores, HF's baddbmm); softmax in fp32."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.matmul(q, k.transpose(2, 3)) * scale
    if bias is not None:
        s = (bias + s.float()).to(s.dtype)
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        column = sinks.to(s.dtype).view(1, -1, 1, 1).expand(s.shape[0], -1, s.shape[2], 1)
        p = torch.softmax(torch.cat((s, column), dim=-1), dim=-1, dtype=torch.float32)[..., :-1]
    else:
        p = torch.softmax(s, dim=-1, dtype=torch.float32)
    return torch.matmul(p.to(q.dtype), v)


# A mixed step's leading one-token rows (decode rows scheduled before the prompt chunks) through the
# split-context decode kernel, the rest through the prefill kernel, instead of all through the prefill kernel:
# one layer of 240 decode rows + 16 x 512 prompt tokens took 0.286 ms that way against 0.388 ms on the H200
# (bench/mixed_attention_bench.py, session 20). Opt-in (REPLAYLLM_SPLIT_MIXED_ATTENTION=1) until an end-to-end
# A/B on the GPU shows the gain (bench/gpu_check.sh's S1-engine rows); below MIN_SPLIT_DECODE_ROWS rows the two
# extra launches cost more than they save.
SPLIT_MIXED = env_flag("REPLAYLLM_SPLIT_MIXED_ATTENTION", default=False)
MIN_SPLIT_DECODE_ROWS = 16


def paged_attention_triton(
    q: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata, scale: float, window: int = 0,
    softcap: float = 0.0, sinks: torch.Tensor | None = None, alibi: torch.Tensor | None = None, chunk: int = 0,
) -> torch.Tensor:
    """Same contract as `paged_attention_torch`, with the Triton kernels of `kernels/paged_attention.py`:
    the split-context decode kernel when every row has one query token, else the varlen prefill kernel
    (which also serves the decode rows of a mixed batch, unless SPLIT_MIXED routes them to the decode kernel)."""
    if md.max_query_len == 1:
        return paged_decode_attention_triton(q, kv_cache, md.seq_lens, md.block_tables, scale, md.max_seq_len,
                                             window=window, softcap=softcap, sinks=sinks, alibi=alibi, chunk=chunk)
    rows = leading_decode_rows(md) if SPLIT_MIXED else 0
    if rows >= MIN_SPLIT_DECODE_ROWS:
        return _split_mixed(q, kv_cache, md, scale, rows, window, softcap, sinks, alibi, chunk)
    return paged_prefill_attention_triton(q, kv_cache, md.query_start_loc, md.seq_lens, md.block_tables, scale,
                                          md.max_query_len, window=window, softcap=softcap, sinks=sinks, alibi=alibi,
                                          chunk=chunk)


def leading_decode_rows(md: AttentionMetadata) -> int:
    """How many of the step's first rows run one query token (0 without the host copy of query_start_loc: no
    device sync to find out)."""
    if md.host_query_start_loc is None:
        return 0
    multi = np.flatnonzero(np.diff(md.host_query_start_loc) != 1)
    return int(multi[0]) if multi.size else md.host_query_start_loc.shape[0] - 1


def _split_mixed(q: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata, scale: float,
                 rows: int, window: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None,
                 alibi: torch.Tensor | None = None, chunk: int = 0) -> torch.Tensor:
    """Rows [0, rows) have one query token each (tokens [0, rows) of q): the decode kernel; the others the
    prefill kernel, their query_start_loc rebased to 0 (`SplitTail`, made by the step's first layer)."""
    tail = md.split_tail
    if tail is None or tail.rows != rows:
        head_max = int(md.host_seq_lens[:rows].max()) if md.host_seq_lens is not None else md.max_seq_len
        tail = md.split_tail = SplitTail(rows, md.query_start_loc[rows:] - rows, md.seq_lens[rows:].clone(),
                                         md.block_tables[rows:].clone(), head_max)
    head = paged_decode_attention_triton(q[:rows], kv_cache, md.seq_lens[:rows], md.block_tables[:rows], scale,
                                         tail.head_max_seq_len, window=window, softcap=softcap, sinks=sinks,
                                         alibi=alibi, chunk=chunk)
    rest = paged_prefill_attention_triton(q[rows:], kv_cache, tail.query_start_loc, tail.seq_lens,
                                          tail.block_tables, scale, md.max_query_len, window=window, softcap=softcap,
                                          sinks=sinks, alibi=alibi, chunk=chunk)
    return torch.cat((head, rest))


def invariant_attention_torch(q: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata, scale: float,
                              window: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None,
                              alibi: torch.Tensor | None = None,
                              workspace_bytes: int = TORCH_ATTENTION_WORKSPACE_BYTES, chunk: int = 0) -> torch.Tensor:
    """Batch-invariant mode, "torch" backend (CPU): fixed KV tiles per token (kernels/batch_invariant_attention.py).

    Its temporaries grow as tokens x tile x Hq x D, so the step's tokens run in chunks that fit `workspace_bytes`,
    each chunk walking the tiles up to its own furthest position. Bitwise the same as one call: every token is
    computed on its own, and tiles past a token's position leave its state unchanged (the kernel's invariant)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, tile = kv_cache.shape[3], TORCH_KV_TILE
    # Per token and tile: K and V gathered, upcast and permuted (3 copies each), the two [Hq, N, D] products, the
    # scores; its block-table row and slots (int64); q, acc and the output.
    per_token = (4 * tile * head_dim * (2 * num_heads + 6 * num_kv_heads) + 12 * num_heads * tile
                 + 8 * (md.block_tables.shape[1] + tile) + 12 * num_heads * head_dim)
    per_call = max(1, workspace_bytes // per_token)  # tokens per call
    if per_call >= num_tokens:
        return paged_attention_invariant_torch(q, kv_cache, md.token_req_idx, md.positions, md.block_tables, scale,
                                               md.max_seq_len, window, softcap, sinks, alibi, chunk)
    qsl = md.host_query_start_loc if md.host_query_start_loc is not None else md.query_start_loc.cpu().numpy()
    seq_lens = md.host_seq_lens if md.host_seq_lens is not None else md.seq_lens.cpu().numpy()
    q_lens = qsl[1:] - qsl[:-1]
    positions = np.repeat(seq_lens - q_lens - qsl[:-1], q_lens) + np.arange(num_tokens)  # [T] host copy
    out = torch.empty_like(q)
    for start in range(0, num_tokens, per_call):
        end = min(start + per_call, num_tokens)
        out[start:end] = paged_attention_invariant_torch(
            q[start:end], kv_cache, md.token_req_idx[start:end], md.positions[start:end], md.block_tables, scale,
            int(positions[start:end].max()) + 1, window, softcap, sinks, alibi, chunk)
    return out


def invariant_attention_triton(q: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata,
                               scale: float, window: int = 0, softcap: float = 0.0,
                               sinks: torch.Tensor | None = None, alibi: torch.Tensor | None = None,
                               chunk: int = 0) -> torch.Tensor:
    """Batch-invariant mode, "triton" backend: one fixed-tile kernel for prefill, chunks and decode alike."""
    return paged_attention_invariant_triton(q, kv_cache, md.query_start_loc, md.seq_lens, md.block_tables, scale,
                                            md.max_query_len, window, softcap, sinks, alibi, chunk)


ATTENTION_IMPLS = {"torch": paged_attention_torch, "triton": paged_attention_triton}  # by ForwardContext.attn_backend
INVARIANT_ATTENTION_IMPLS = {"torch": invariant_attention_torch, "triton": invariant_attention_triton}


class Attention(nn.Module):
    """Rotates q/k, writes this step's K/V into the layer's paged cache, then attends. q [T, Hq*D], k/v [T, Hkv*D].
    `batch_invariant` (set by `models/layers.set_batch_invariant`) picks INVARIANT_ATTENTION_IMPLS."""

    batch_invariant = False

    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window: int | None = None  # the model's window for this layer (set_window)
        self.window = 0  # the one the kernels apply: 0 = full causal attention (fit_context)
        self.attention_chunk: int | None = None  # the model's chunk size for this layer (set_chunk: Llama 4)
        self.chunk = 0  # the one the kernels apply: 0 = no chunks (fit_context)
        self.softcap = 0.0  # > 0: scores capped at +-softcap, cap * tanh(s / cap) (Gemma 2); 0: plain scores
        self.sinks: nn.Parameter | None = None  # [Hq] (this rank's heads): attention sinks (GPT-OSS, enable_sinks)
        self.register_buffer("alibi", None, persistent=False)  # [Hq] fp32, this rank's: ALiBi slopes (enable_alibi)

    def enable_sinks(self) -> None:
        """One learned sink logit per q head (GPT-OSS's `self_attn.sinks`), in every softmax's denominator; the
        model dtype (the loader's default dtype), as transformers keeps it."""
        self.sinks = nn.Parameter(torch.zeros(self.num_heads), requires_grad=False)

    def enable_alibi(self, slopes: torch.Tensor) -> None:
        """ALiBi (BLOOM): each score plus slope * (key position - query position), one fp32 slope per q head of
        this rank (a buffer: it follows the model to its device; not a checkpoint tensor)."""
        if slopes.shape != (self.num_heads,):
            raise ValueError(f"alibi needs {self.num_heads} slopes (this rank's q heads), got {tuple(slopes.shape)}")
        self.alibi = slopes.to(torch.float32).contiguous()  # the buffer registered (non-persistent) in __init__

    def set_window(self, window: int | None) -> None:
        """This layer's sliding window (the model's config: Mistral, Phi-3, Qwen2's later layers), or None."""
        self.sliding_window = window
        self.window = window or 0

    def set_chunk(self, chunk: int | None) -> None:
        """This layer's chunked attention (Llama 4's `attention_chunk_size` in its "chunked_attention" layers: a
        query at p sees the keys p // chunk * chunk .. p), or None."""
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise ValueError(f"attention chunk size must be a positive integer, got {chunk!r}")
        if chunk and self.sliding_window:
            raise ValueError("a layer cannot have both a sliding window and attention chunks")
        self.attention_chunk = chunk
        self.chunk = chunk or 0

    def fit_context(self, max_model_len: int) -> None:
        """An engine whose sequences never outgrow the window (or one chunk) runs full attention: the same
        computation, through the kernels' full-causal variants; past it, the window's (the chunks')."""
        self.window = self.sliding_window if self.sliding_window and max_model_len > self.sliding_window else 0
        chunk = self.attention_chunk
        self.chunk = chunk if chunk and max_model_len > chunk else 0

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                rotary: Callable[..., tuple[torch.Tensor, torch.Tensor | None]],
                q_norm: nn.Module | None = None, k_norm: nn.Module | None = None) -> torch.Tensor:
        """positions [T]; q [T, Hq*D], k and v [T, Hkv*D] as the projection gives them (strided views). Rotates q
        and k (`rotary`: models/layers.RotaryEmbedding, after Qwen3's per-head q/k norms when given), writes this
        step's K and V into the layer's paged cache, then attends: [T, Hq*D]. On the fused path (CUDA) one kernel
        rotates and writes the cache (kernels/rotary.py KVWrite: no rotated k to store and read back)."""
        ctx = get_forward_context()
        md = ctx.attn_metadata
        kv_cache = ctx.kv_caches[self.layer_idx]
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if use_fused_kernels(kv_cache.device):
            q, _ = rotary(positions, q, k, q_norm, k_norm, kv_write=KVWrite(kv_cache, v, md.slot_mapping))
        else:
            q, k = rotary(positions, q, k, q_norm, k_norm)  # [T, Hq*D], [T, Hkv*D]
            write_kv_cache_torch(kv_cache, k.view(-1, self.num_kv_heads, self.head_dim), v, md.slot_mapping)
        q = q.view(-1, self.num_heads, self.head_dim)
        if ctx.split is not None:  # piecewise CUDA graphs: the graph ends here, attention runs between graphs
            return ctx.split.attention(self, q, kv_cache, md)
        return self.compute(q, kv_cache, md, ctx.attn_backend).reshape(-1, self.num_heads * self.head_dim)

    def compute(self, q: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata, backend: str) -> torch.Tensor:
        """The attention itself (the K/V of this step already in `kv_cache`): q [T, Hq, D] -> [T, Hq, D]."""
        impls = INVARIANT_ATTENTION_IMPLS if self.batch_invariant else ATTENTION_IMPLS
        return impls[backend](q, kv_cache, md, self.scale, self.window, self.softcap, self.sinks, self.alibi,
                              chunk=self.chunk)
