"""The torch attention backend's plan for one step: which rows (and which of their queries) share a padded SDPA call.

One padded call over g rows pads every row to Q queries and K keys, so its temporaries grow as g * Q * K (the
[g, Q, K] mask, and SDPA's additive copy of it) plus g * K gathered keys and values. Padding a whole step to
[rows, longest query, longest context] let one long prompt among many decodes cost rows x prompt x prompt
(issue 31). The plan keeps every call under a byte budget instead: the whole step in one call when it fits (the
common decode step: one call, as before), else rows grouped by shape and long rows cut into query chunks, so the
peak is the budget or, at least, one query of the longest row with the keys it reads. Plain numpy: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PartCost:
    """Bytes of a padded call's temporaries per unit of each padded extent (g rows, Q queries, K keys)."""

    per_qk: int  # per (row, query, key): the boolean mask and SDPA's additive float copy of it
    per_k: int  # per (row, key): gathered K and V, and their block / slot indices (int64)
    per_q: int  # per (row, query): gathered queries, their cast, SDPA's output and its transposed copy

    @classmethod
    def for_heads(cls, num_heads: int, num_kv_heads: int, head_dim: int, elem_size: int,
                  eager: bool = False) -> PartCost:
        """eager: the call is transformers' eager attention (attention._eager_attention: soft caps, sinks), which
        holds every head's scores, not SDPA's mask alone: per (query, key) and q head the scores, their scaled and
        capped copies, the masked copy, the sink column's concatenation (elem_size each), the fp32 softmax and its
        cast (4 + elem_size); and K / V repeated to every q head."""
        if eager:
            return cls(per_qk=1 + num_heads * (6 * elem_size + 4),
                       per_k=2 * (num_kv_heads + num_heads) * head_dim * elem_size + 16,
                       per_q=4 * num_heads * head_dim * elem_size)
        return cls(per_qk=1 + elem_size, per_k=2 * num_kv_heads * head_dim * elem_size + 16,
                   per_q=4 * num_heads * head_dim * elem_size)

    def bytes(self, num_rows: int, max_q: int, max_k: int) -> int:
        return num_rows * (max_q * max_k * self.per_qk + max_k * self.per_k + max_q * self.per_q)


@dataclass(frozen=True)
class AttentionPart:
    """One padded call: row rows[i] attends its queries q_begin[i] .. q_begin[i] + q_count[i] - 1 (0-based within
    the row's scheduled queries). max_query_len / max_seq_len: the call's padded Q and K (K = keys the part's
    latest query sees). rows is None for the whole step in one call (every row, every query)."""

    rows: np.ndarray | None  # [g] int64 batch rows, ascending
    q_begin: np.ndarray | None  # [g] int64
    q_count: np.ndarray | None  # [g] int64
    max_query_len: int
    max_seq_len: int


def plan_attention(q_lens: np.ndarray, seq_lens: np.ndarray, cost: PartCost, budget: int) -> list[AttentionPart]:
    """q_lens / seq_lens [B] int64 host arrays (queries scheduled this step, context after it). Returns parts that
    together cover every (row, query) exactly once, each with cost.bytes(...) <= budget unless it is a single
    query of a single row (the least a call can hold)."""
    num_rows = int(q_lens.shape[0])
    max_q, max_k = int(q_lens.max()), int(seq_lens.max())
    if cost.bytes(num_rows, max_q, max_k) <= budget:
        return [AttentionPart(None, None, None, max_q, max_k)]
    parts: list[AttentionPart] = []
    group: list[int] = []
    group_q = group_k = 0
    for row in np.lexsort((seq_lens, q_lens)).tolist():  # by query length, then context: similar shapes meet
        ql, kl = int(q_lens[row]), int(seq_lens[row])
        if cost.bytes(1, ql, kl) > budget:  # too long even alone: its queries in chunks
            parts.extend(_query_chunks(row, ql, kl, cost, budget))
            continue
        new_q, new_k = max(group_q, ql), max(group_k, kl)
        if group and cost.bytes(len(group) + 1, new_q, new_k) > budget:
            parts.append(_rows_part(group, q_lens, group_q, group_k))
            group, new_q, new_k = [], ql, kl
        group.append(row)
        group_q, group_k = new_q, new_k
    if group:
        parts.append(_rows_part(group, q_lens, group_q, group_k))
    return parts


def _rows_part(group: list[int], q_lens: np.ndarray, max_q: int, max_k: int) -> AttentionPart:
    rows = np.sort(np.asarray(group, dtype=np.int64))
    return AttentionPart(rows, np.zeros_like(rows), q_lens[rows].astype(np.int64), max_q, max_k)


def _query_chunks(row: int, q_len: int, seq_len: int, cost: PartCost, budget: int) -> list[AttentionPart]:
    """One row's queries in chunks of c, c sized so that c queries over all seq_len keys fit the budget (at least
    1). A chunk ending at query a + n (of the row's q_len) sees keys 0 .. seq_len - q_len + a + n - 1."""
    spare = budget - seq_len * cost.per_k
    chunk = max(1, min(q_len, spare // (seq_len * cost.per_qk + cost.per_q)))
    context = seq_len - q_len
    parts = []
    for begin in range(0, q_len, chunk):
        n = min(chunk, q_len - begin)
        one = np.array([row], dtype=np.int64)
        parts.append(AttentionPart(one, np.array([begin], dtype=np.int64), np.array([n], dtype=np.int64), n,
                                   context + begin + n))
    return parts
