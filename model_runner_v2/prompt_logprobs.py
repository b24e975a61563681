"""Prompt logprobs: the raw logprob (and top-k) of each prompt token given the tokens before it."""

from __future__ import annotations

import numpy as np
import torch


def compute_prompt_logprobs(model, hidden: torch.Tensor, input_ids_next: torch.Tensor, token_start: int,
                            num_targets: int, k: int) -> tuple[np.ndarray, ...]:
    """hidden [T, H] of this step; the row's tokens token_start .. token_start + num_targets - 1 predict the
    next prompt tokens input_ids_next [num_targets]. Returns host arrays (logprob, rank, topk ids, topk lp)."""
    h = hidden[token_start : token_start + num_targets]
    logprobs = model.compute_logits(h).float().log_softmax(dim=-1)  # [n, V]
    target = input_ids_next.long()[:, None]
    lp = logprobs.gather(1, target)
    rank = (logprobs > lp).sum(dim=-1) + 1
    topk_lp, topk_ids = logprobs.topk(k, dim=-1) if k > 0 else (logprobs[:, :0], target[:, :0])
    return (lp[:, 0].cpu().numpy(), rank.cpu().numpy(), topk_ids.cpu().numpy(), topk_lp.cpu().numpy())
