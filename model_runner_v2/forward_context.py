"""Scoped per-step forward context: attention metadata and KV caches seen by every attention layer."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, all on the model's device. B = scheduled requests, T = scheduled tokens."""

    query_start_loc: torch.Tensor  # [B + 1] int64, prefix sums of query lengths
    seq_lens: torch.Tensor  # [B] int64, context length after this step (computed + scheduled)
    slot_mapping: torch.Tensor  # [T] int64, flat KV-cache slot (block * block_size + offset) per token
    block_tables: torch.Tensor  # [B, max_blocks] int32, physical block ids per request
    token_req_idx: torch.Tensor  # [T] int64, batch row owning each token
    positions: torch.Tensor  # [T] int64, absolute position of each token
    max_query_len: int  # host ints: shape padding without a device sync
    max_seq_len: int
    # [B] int64, each row's request slot (request_states.py; CUDA-graph padding rows: its pad slot): where hybrid
    # models' linear-attention layers keep each request's recurrent state (models/gated_deltanet.py). None: a
    # step built without requests (kernel tests), which such a layer refuses.
    req_slots: torch.Tensor | None = None
    # Host copies of query_start_loc / seq_lens where the step has them (prepare_inputs): the torch backend plans
    # its padded calls from them (attention_plan.py) without a device sync. None: read from the device tensors.
    host_query_start_loc: np.ndarray | None = None  # [B + 1] int64
    host_seq_lens: np.ndarray | None = None  # [B] int64
    # attention.py `_split_mixed`'s per-step cache (REPLAYLLM_SPLIT_MIXED_ATTENTION): the prefill part's inputs
    # made once for every layer, as fresh (16-byte aligned) tensors. None until a layer splits the step.
    split_tail: SplitTail | None = None


@dataclass(frozen=True)
class SplitTail:
    """A mixed step's rows after its `rows` leading one-token rows: their query_start_loc rebased to 0, seq_lens
    and block_tables, each a fresh tensor (slices of the step's tensors would start at 8-byte offsets for an odd
    `rows`, and Triton compiles another kernel variant per pointer alignment: inside a user's run); and the
    leading rows' longest context (their decode launch's split count)."""

    rows: int
    query_start_loc: torch.Tensor  # [B - rows + 1] int64
    seq_lens: torch.Tensor  # [B - rows] int64
    block_tables: torch.Tensor  # [B - rows, max_blocks] int32
    head_max_seq_len: int


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata
    kv_caches: list[torch.Tensor]  # per layer: [2, num_blocks, block_size, num_kv_heads, head_dim]
    attn_backend: str = "torch"  # EngineConfig.attention_backend (resolved): "torch" or "triton"
    # Piecewise CUDA graphs (piecewise_graph.py): each attention layer hands its query to this object's
    # `attention(layer, q, kv_cache, md)` instead of attending itself (None: attend in place).
    split: Any = None
    # MoE models with enable_return_routed_experts (docs/moe.md): [num_kv_slots, num_layers, top_k] int16, indexed
    # like the KV cache's slots; every sparse layer writes its top-k expert ids at the step's slot_mapping.
    routed_experts: torch.Tensor | None = None
    # Routing replay (SamplingParams.trace_routed_experts): [T, num_layers, top_k] int16, the experts each of the
    # step's tokens is forced to (-1: not forced, route as usual). None: no token of the step is forced.
    forced_experts: torch.Tensor | None = None


_CONTEXT: ForwardContext | None = None


@contextmanager
def set_forward_context(ctx: ForwardContext) -> Iterator[None]:
    global _CONTEXT
    prev, _CONTEXT = _CONTEXT, ctx
    try:
        yield
    finally:
        _CONTEXT = prev


def get_forward_context() -> ForwardContext:
    if _CONTEXT is None:
        raise RuntimeError("attention called outside set_forward_context(...)")
    return _CONTEXT
