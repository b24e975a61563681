"""Sampler logprobs: token logprob, rank and top-k from the raw logits, plus full rows for those that ask."""

from __future__ import annotations

import numpy as np
import torch

from ..kernels.logprobs import raw_logprobs


def sampler_logprobs(raw_logits: torch.Tensor, sampled: torch.Tensor, k: int, full_rows: np.ndarray) -> tuple:
    """raw_logits [R, V] (untransformed); sampled [R] int64 final tokens; k = largest `logprobs` of the batch
    (< 0: none); full_rows [F] host, the rows with return_full_logprobs. Returns SamplerOutput's fields after
    `sampled`: (logprob [R] fp32, rank [R] int64, topk_ids [R, k] | None, topk_logprobs [R, k] | None,
    full_logprobs [F, V] fp32 | None, full_rows | None). Full rows are `logit - lse` with the kernel's lse, so
    `full_logprobs[f, token]` is bit-equal to the reported logprob of that row's token."""
    token_lp, rank, topk_ids, topk_lp, lse = raw_logprobs(raw_logits, sampled, max(k, 0), with_lse=True)
    if not full_rows.size:
        return token_lp, rank, topk_ids, topk_lp, None, None
    if full_rows.size == raw_logits.shape[0]:  # every row asked: no gather
        full = raw_logits.float() - lse[:, None]
    else:
        rows = torch.from_numpy(full_rows).to(raw_logits.device, non_blocking=True)  # a plain .to() syncs the stream
        full = raw_logits[rows].float() - lse[rows, None]  # [F, V]
    return token_lp, rank, topk_ids, topk_lp, full, full_rows
