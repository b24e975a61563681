"""Inkling's attention (models/inkling.py), as transformers' InklingAttention computes it: no rotary; k and v each
through a short convolution (conv + its input, fp32) before the per-head RMSNorms of q and k; scores q k^T / head_dim
plus a relative bias per head, query and key (each query's `r_proj` states mix the bank `rel_logits_proj.proj`
[d_rel, extent] into one bias per backward distance, zero past the extent); a sliding layer's window; the full
layers' logarithmic scaling of q and the bias past `log_scaling_n_floor`. The bias has no place in the engine's
paged kernels, so the attention runs here in torch over each request's keys gathered from its paged cache, one
request at a time (a row's bits never depend on the others); in batch-invariant mode one query at a time over its
own keys, so that neither the step's other queries nor how a prompt is cut into chunks changes its bits."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from ...inkling_facts import InklingLayer
from ...kernels.kv_cache_read import gather_kv
from ...kernels.kv_cache_write import write_kv_cache_torch
from ..forward_context import AttentionMetadata, get_forward_context
from .gated_deltanet import ConvWeight
from .layers import RMSNorm
from .parallel import ColumnParallelLinear, RowParallelLinear


class ShortConvWeight(nn.Module):
    """One of a layer's four depthwise convolutions under its checkpoint name (`<name>.conv1d.weight` [C, 1, K]),
    held [C, K] in fp32 as transformers keeps it (`_keep_in_fp32_modules_strict`); `offset`: its channels' first
    column in the layer's convolution history (models/inkling.InklingLayer.short_conv)."""

    def __init__(self, channels: int, kernel: int, offset: int):
        super().__init__()
        self.conv1d = ConvWeight(channels, kernel)
        self.conv1d.weight = nn.Parameter(self.conv1d.weight.detach().float(), requires_grad=False)
        self.channels, self.offset = channels, offset


class RelativeLogits(nn.Module):
    """`proj` [d_rel, extent]: the bank of bias-by-distance profiles (transformers' InklingRelativeLogits)."""

    def __init__(self, d_rel: int, extent: int):
        super().__init__()
        self.extent = extent
        self.proj = nn.Parameter(torch.empty(d_rel, extent), requires_grad=False)

    def forward(self, r: torch.Tensor, distance: torch.Tensor) -> torch.Tensor:
        """r [Q, H, d_rel], distance [Q, K] (query position - key position) -> bias [H, Q, K], zero outside
        0 <= distance < extent."""
        profiles = r @ self.proj  # [Q, H, extent]
        index = distance.clamp(0, self.extent - 1)[:, None, :].expand(-1, profiles.shape[1], -1)  # [Q, H, K]
        bias = profiles.gather(-1, index).masked_fill(((distance < 0) | (distance >= self.extent))[:, None], 0.0)
        return bias.transpose(0, 1)


class InklingAttention(nn.Module):
    """q_proj, k_proj -> k_sconv, v_proj -> v_sconv, r_proj, q_norm / k_norm, rel_logits_proj, o_proj; `layer_idx`
    the layer's own KV cache (every Inkling layer has one)."""

    batch_invariant = False  # layers.set_batch_invariant: each query alone over the keys it sees (attend)

    def __init__(self, hf_config, plan: InklingLayer, layer_idx: int, kernel: int, v_offset: int):
        super().__init__()
        hidden, eps = int(hf_config.hidden_size), float(hf_config.rms_norm_eps)
        self.plan, self.layer_idx = plan, layer_idx
        self.heads, self.kv_heads, self.head_dim = plan.heads, plan.kv_heads, plan.head_dim
        self.scale = 1.0 / self.head_dim  # q and k are RMS-normalised per head: 1/d, not 1/sqrt(d)
        self.window = int(hf_config.sliding_window_size) if plan.sliding else 0
        floor = getattr(hf_config, "log_scaling_n_floor", None)
        self.log_floor = None if plan.sliding or floor is None else int(floor)
        self.log_alpha = float(getattr(hf_config, "log_scaling_alpha", 0.1))
        self.q_proj = ColumnParallelLinear(hidden, [plan.heads * plan.head_dim])
        self.k_proj = ColumnParallelLinear(hidden, [plan.kv_width])
        self.v_proj = ColumnParallelLinear(hidden, [plan.kv_width])
        self.r_proj = ColumnParallelLinear(hidden, [plan.heads * int(hf_config.d_rel)])
        self.o_proj = RowParallelLinear(plan.heads * plan.head_dim, hidden)
        self.k_sconv = ShortConvWeight(plan.kv_width, kernel, 0)
        self.v_sconv = ShortConvWeight(plan.kv_width, kernel, v_offset)
        self.q_norm = RMSNorm(plan.head_dim, eps)
        self.k_norm = RMSNorm(plan.head_dim, eps)
        self.rel_logits_proj = RelativeLogits(int(hf_config.d_rel), plan.rel_extent)

    def forward(self, x: torch.Tensor, short_conv: Callable[[torch.Tensor, ShortConvWeight], torch.Tensor]
                ) -> torch.Tensor:
        """x [T, hidden] (normed) -> [T, hidden]; short_conv: the layer's convolution over the step's requests."""
        ctx = get_forward_context()
        md, kv_cache = ctx.attn_metadata, ctx.kv_caches[self.layer_idx]
        q = self.q_norm(self.q_proj(x).view(-1, self.heads, self.head_dim))
        k = self.k_norm(short_conv(self.k_proj(x), self.k_sconv).view(-1, self.kv_heads, self.head_dim))
        v = short_conv(self.v_proj(x), self.v_sconv).view(-1, self.kv_heads, self.head_dim)
        r = self.r_proj(x).view(-1, self.heads, self.rel_logits_proj.proj.shape[0])  # [T, H, d_rel]
        write_kv_cache_torch(kv_cache, k, v, md.slot_mapping)
        return self.o_proj(self.attend(q, r, kv_cache, md).reshape(-1, self.heads * self.head_dim))

    def attend(self, q: torch.Tensor, r: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata
               ) -> torch.Tensor:
        """q [T, H, D], r [T, H, d_rel] -> [T, H, D]: each request's queries over its cached keys (this step's
        written), read through its block table [2, blocks, block_size, Hkv, D]."""
        qsl = md.host_query_start_loc if md.host_query_start_loc is not None else md.query_start_loc.cpu().numpy()
        seq_lens = md.host_seq_lens if md.host_seq_lens is not None else md.seq_lens.cpu().numpy()
        block_size = kv_cache.shape[2]
        flat = kv_cache.view(2, -1, self.kv_heads, self.head_dim)
        out = torch.empty_like(q)
        for b in range(len(seq_lens)):
            start, end, length = int(qsl[b]), int(qsl[b + 1]), int(seq_lens[b])
            first = length - (end - start)  # the first query's position
            # (token range, the last key + 1): the row's queries at once, or each alone (batch-invariant mode)
            parts = ([(start + i, start + i + 1, first + i + 1) for i in range(end - start)] if self.batch_invariant
                     else [(start, end, length)] if end > start else [])
            for lo, hi, stop in parts:
                p0 = stop - (hi - lo)  # the part's first query position
                low = max(0, p0 - self.window + 1) if self.window else 0  # no key before the window is seen
                keys = torch.arange(low, stop, device=q.device)
                slots = md.block_tables[b, keys // block_size].long() * block_size + keys % block_size
                k, v = gather_kv(flat[0], slots, q.dtype), gather_kv(flat[1], slots, q.dtype)  # [K, Hkv, D]
                queries = torch.arange(p0, stop, device=q.device)
                out[lo:hi] = self.attend_row(q[lo:hi], r[lo:hi], k, v, queries, keys)
        return out

    def attend_row(self, q: torch.Tensor, r: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """One request: q [Q, H, D], r [Q, H, d_rel], k / v [K, Hkv, D] at positions queries [Q], keys [K] ->
        [Q, H, D], transformers' eager order: (q k^T) * scale + bias, masked, softmax in fp32, cast, times v."""
        distance = queries[:, None] - keys[None, :]  # [Q, K]
        bias = self.rel_logits_proj(r, distance)  # [H, Q, K]
        q = q.transpose(0, 1)  # [H, Q, D]
        if self.log_floor is not None:  # tau = 1 + alpha log(max(1, (p + 1) / floor)) on q and the bias, in fp32
            n = (queries + 1).float()
            tau = (1.0 + self.log_alpha * torch.log((n / self.log_floor).clamp(min=1.0))).view(1, -1, 1)
            q, bias = (q.float() * tau).to(q.dtype), (bias.float() * tau).to(bias.dtype)
        group = self.heads // self.kv_heads
        k = k.transpose(0, 1).repeat_interleave(group, 0)  # [H, K, D]
        v = v.transpose(0, 1).repeat_interleave(group, 0)
        scores = torch.matmul(q, k.transpose(1, 2)) * self.scale + bias  # [H, Q, K]
        allowed = distance >= 0
        if self.window:
            allowed &= distance < self.window
        scores = scores.masked_fill(~allowed, -math.inf)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, v).transpose(0, 1)  # [Q, H, D]
