"""The sampler's vectorised in-place logits transforms (penalties, logit bias, token masks, top-k/top-p/min-p)."""

from __future__ import annotations

import torch


def apply_penalties(logits: torch.Tensor, token_ids: torch.Tensor, prompt_len: torch.Tensor,
                    total_len: torch.Tensor, repetition: torch.Tensor, frequency: torch.Tensor,
                    presence: torch.Tensor) -> None:
    """logits [R, V] in place. token_ids [R, L] (slot rows, L >= every total_len), prompt_len/total_len [R].

    Repetition penalty (vLLM/HF semantics) covers prompt and output tokens; presence and frequency penalties
    count output tokens only."""
    num_rows, vocab = logits.shape
    pos = torch.arange(token_ids.shape[1], device=logits.device)[None, :]
    in_seq = (pos < total_len[:, None]) & (token_ids < vocab)  # an input-only prompt id (a pruned head's) no logit
    is_out = in_seq & (pos >= prompt_len[:, None])
    ids = token_ids.long().clamp(0, vocab - 1)
    out_counts = torch.zeros(num_rows, vocab, device=logits.device).scatter_add_(1, ids, is_out.float())
    seen = torch.zeros(num_rows, vocab, device=logits.device).scatter_add_(1, ids, in_seq.float()) > 0
    rep = repetition[:, None]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits.copy_(torch.where(seen, penalised, logits))
    logits -= frequency[:, None] * out_counts + presence[:, None] * (out_counts > 0).float()


def apply_logit_bias(logits: torch.Tensor, token_ids: torch.Tensor, bias: torch.Tensor,
                     num_bias: torch.Tensor) -> None:
    """logits[r, token_ids[r, j]] += bias[r, j] for j < num_bias[r]. In place, one scatter for the batch.

    token_ids [R, W] int (padded slot rows), bias [R, W] float32, num_bias [R] int. Entries at j >= num_bias[r]
    are stale or padding: their bias is zeroed before the scatter, so they add an exact 0.0 (ids within a row
    are distinct per request, and adding 0.0 leaves any logit, -inf included, unchanged)."""
    width = token_ids.shape[1]
    valid = torch.arange(width, device=logits.device)[None, :] < num_bias[:, None]
    logits.scatter_add_(1, token_ids.long(), torch.where(valid, bias, 0.0))


def apply_allowed_token_ids(logits: torch.Tensor, token_ids: torch.Tensor, num_allowed: torch.Tensor) -> None:
    """Keep only logits[r, token_ids[r, :num_allowed[r]]]; every other entry becomes -inf. Rows with
    num_allowed == 0 are untouched. token_ids [R, W] int (padded slot rows), num_allowed [R] int. In place."""
    width = token_ids.shape[1]
    valid = torch.arange(width, device=logits.device)[None, :] < num_allowed[:, None]
    # Entries past the count point at the row's first id (allowed anyway), so the scatter only writes True.
    ids = torch.where(valid, token_ids, token_ids[:, :1]).long()
    keep = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device).scatter_(1, ids, True)
    keep |= (num_allowed == 0)[:, None]
    logits.masked_fill_(~keep, float("-inf"))


def apply_token_mask(logits: torch.Tensor, rows: list[int], token_ids: list[int]) -> None:
    """logits[rows[i], token_ids[i]] = -inf for host-built pairs (min_tokens stop ids, bad words)."""
    if rows:
        r = torch.tensor(rows, dtype=torch.int64).to(logits.device, non_blocking=True)
        t = torch.tensor(token_ids, dtype=torch.int64).to(logits.device, non_blocking=True)
        logits[r, t] = float("-inf")


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Drop tokens whose probability is below min_p [R] times the row's top probability. In place."""
    probs = logits.softmax(dim=-1)
    top = probs.max(dim=-1, keepdim=True).values
    logits.masked_fill_(probs < min_p[:, None] * top, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> None:
    """top_k [R] int (0 = off), top_p [R] float (1 = off); either may be None when no row uses it. In place."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=False)  # ascending: the kept tokens are at the end
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab).long()
        kth = sorted_logits.gather(1, (vocab - k)[:, None])  # [R, 1] smallest kept logit
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        cum = probs.cumsum(dim=-1)
        drop = cum <= (1 - top_p[:, None])
        drop[:, -1] = False  # always keep the most likely token
        sorted_logits.masked_fill_(drop, float("-inf"))
    logits.scatter_(1, order, sorted_logits)
