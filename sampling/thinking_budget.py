"""ThinkingBudgetState: per-slot thinking_token_budget, counted and enforced on the device after each draw."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..reasoning import ReasoningTokens
from .staged_writes import StagedSlotWrites, Upload


class ThinkingBudgetState:
    """One entry per runner slot: the request's budget (-1: none), its reasoning start/end token ids, and where it
    is: inside a reasoning span or not, and how many tokens it generated there.

    The state advances on the device, in the sampler, right after each draw: the tokens of step N never have to
    reach the host before step N+1 is launched (async scheduling needs no sync for it). `add_request` stages the
    slot's starting state, computed on the host from the tokens known then (prompt, plus the outputs of a request
    resumed after preemption), so a prompt that already opened <think> starts inside with its own reasoning tokens
    counted, as vLLM's thinking-budget processor counts them."""

    def __init__(self, max_num_reqs: int, device: torch.device):
        def slot_tensor(dtype: torch.dtype, fill: int) -> StagedSlotWrites:
            return StagedSlotWrites(torch.full((max_num_reqs,), fill, dtype=dtype, device=device))

        self.budget = slot_tensor(torch.int32, -1)  # host mirror: "does any row of the batch have a budget?"
        self.start_token_id = slot_tensor(torch.int64, 0)
        self.end_token_id = slot_tensor(torch.int64, 0)
        # Advanced on the device every step (their host mirrors only hold the staged starting values).
        self.inside = slot_tensor(torch.bool, 0)
        self.count = slot_tensor(torch.int32, 0)
        self._all = (self.budget, self.start_token_id, self.end_token_id, self.inside, self.count)

    def add_request(self, slot: int, budget: int | None, reasoning: ReasoningTokens | None,
                    token_ids: Sequence[int]) -> None:
        """Every add stages the budget, so a reused slot never keeps its previous owner's."""
        if budget is None or reasoning is None:  # reasoning is resolved whenever a budget passed admission
            self.budget.stage(slot, -1)
            return
        inside, count = reasoning.state_after(token_ids)
        self.budget.stage(slot, budget)
        self.start_token_id.stage(slot, reasoning.start_token_id)
        self.end_token_id.stage(slot, reasoning.end_token_id)
        self.inside.stage(slot, inside)
        self.count.stage(slot, count)

    def apply_staged_writes(self, upload: Upload | None = None) -> None:
        for t in self._all:
            t.apply(upload)

    def apply(self, sampled: torch.Tensor, slots: torch.Tensor, host_slots: np.ndarray) -> None:
        """Force the end token where a span has used its budget, then advance every budgeted row's state with the
        final token. sampled [R] int64, overwritten in place; slots [R] int64 device (distinct); host_slots [R]."""
        if not (self.budget.host[host_slots] >= 0).any():
            return  # no request of the batch has a budget: skip
        budget = self.budget.tensor[slots]  # [R]
        inside = self.inside.tensor[slots]
        count = self.count.tensor[slots]
        start, end = self.start_token_id.tensor[slots], self.end_token_id.tensor[slots]
        active = budget >= 0
        force = active & inside & (count >= budget)
        sampled.copy_(torch.where(force, end, sampled))  # = masking all but the end token, without a [R, V] pass
        opens = ~inside & (sampled == start)
        now_inside = (inside & (sampled != end)) | opens
        # A span's count: tokens after its start token; 0 outside and on the start token itself.
        new_count = torch.where(now_inside & ~opens, count + 1, torch.zeros_like(count))
        self.inside.tensor[slots] = now_inside & active
        self.count.tensor[slots] = new_count
