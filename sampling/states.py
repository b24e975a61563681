"""SamplingStates: per-slot sampling parameters on the device, with host mirrors for step skipping."""

from __future__ import annotations

import numpy as np
import torch

from ..model_runner_v2.staged_writes import StagedSlotWrites
from .params import SamplingParams


class SamplingStates:
    """One entry per runner slot. Device tensors feed the sampler's vectorised steps; the host mirrors answer
    "does any row of this batch need step X?" without a device read."""

    def __init__(self, max_num_reqs: int, device: torch.device):
        def slot_tensor(dtype: torch.dtype, fill: float) -> StagedSlotWrites:
            return StagedSlotWrites(torch.full((max_num_reqs,), fill, dtype=dtype, device=device))

        self.temperature = slot_tensor(torch.float32, 1.0)  # 0 = greedy
        self.top_k = slot_tensor(torch.int32, 0)  # 0 = off
        self.top_p = slot_tensor(torch.float32, 1.0)
        self.min_p = slot_tensor(torch.float32, 0.0)
        self.presence_penalty = slot_tensor(torch.float32, 0.0)
        self.frequency_penalty = slot_tensor(torch.float32, 0.0)
        self.repetition_penalty = slot_tensor(torch.float32, 1.0)
        self.seed = slot_tensor(torch.int64, 0)
        self._all = [self.temperature, self.top_k, self.top_p, self.min_p, self.presence_penalty,
                     self.frequency_penalty, self.repetition_penalty, self.seed]
        # Host-only rules (applied from host-built index lists).
        self.num_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)  # -1: no logprobs requested
        self.full_logprobs = np.zeros(max_num_reqs, dtype=bool)  # return_full_logprobs: copy whole rows
        self.min_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.stop_ids: list[list[int]] = [[] for _ in range(max_num_reqs)]  # masked while under min_tokens
        self.bad_words: list[list[list[int]]] = [[] for _ in range(max_num_reqs)]
        self.has_bad_words = np.zeros(max_num_reqs, dtype=bool)

    def add_request(self, slot: int, params: SamplingParams, seed: int, eos_token_ids: tuple[int, ...],
                    bad_words_token_ids: list[list[int]]) -> None:
        self.temperature.stage(slot, 0.0 if params.is_greedy else params.temperature)
        self.top_k.stage(slot, params.top_k)
        self.top_p.stage(slot, params.top_p)
        self.min_p.stage(slot, params.min_p)
        self.presence_penalty.stage(slot, params.presence_penalty)
        self.frequency_penalty.stage(slot, params.frequency_penalty)
        self.repetition_penalty.stage(slot, params.repetition_penalty)
        self.seed.stage(slot, seed)
        self.num_logprobs[slot] = -1 if params.logprobs is None else params.logprobs
        self.full_logprobs[slot] = params.return_full_logprobs
        self.min_tokens[slot] = params.min_tokens
        eos = [] if params.ignore_eos else list(eos_token_ids)
        self.stop_ids[slot] = eos + list(params.stop_token_ids) if params.min_tokens else []
        self.bad_words[slot] = bad_words_token_ids
        self.has_bad_words[slot] = bool(bad_words_token_ids)

    def apply_staged_writes(self) -> None:
        for t in self._all:
            t.apply()
