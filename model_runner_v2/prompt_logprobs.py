"""Prompt logprobs: the raw logprob (and top-k) of each prompt token given the tokens before it."""

from __future__ import annotations

import numpy as np
import torch

from ..kernels.logprobs import raw_logprobs


def compute_prompt_logprobs(model, hidden: torch.Tensor, input_ids_next: torch.Tensor, token_start: int,
                            num_targets: int, k: int) -> tuple[np.ndarray, ...]:
    """hidden [T, H] of this step; the row's tokens token_start .. token_start + num_targets - 1 predict the
    next prompt tokens input_ids_next [num_targets]. Returns host arrays (logprob, rank, topk ids, topk lp).

    The same function as the sampler's logprobs (`raw_logprobs`: fp32 `logit - logsumexp`, rank = the logits >= the
    token's), so a token's prompt logprob has the bits its decode logprob had when the logits agree (as
    they do in batch-invariant mode)."""
    h = hidden[token_start : token_start + num_targets]
    logits = model.compute_logits(h)  # [n, V] model dtype (upcast inside, like the sampler's raw logits)
    lp, rank, topk_ids, topk_lp = raw_logprobs(logits, input_ids_next.long(), max(k, 0))
    if topk_ids is None:
        topk_ids = torch.zeros((num_targets, 0), dtype=torch.int64)
        topk_lp = torch.zeros((num_targets, 0), dtype=torch.float32)
    return (lp.cpu().numpy(), rank.cpu().numpy(), topk_ids.cpu().numpy(), topk_lp.cpu().numpy())
