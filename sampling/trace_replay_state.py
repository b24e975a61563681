"""Per-slot trace storage for trace replay, with staged host writes and the host-side skip check."""

from __future__ import annotations

import numpy as np
import torch

from ..kernels.trace_replay import trace_replay
from .staged_writes import StagedRowWrites, StagedSlotWrites, Upload


class TraceReplayState:
    """Trace tokens of every persistent slot; built only when trace replay is enabled.

    Device: `trace` [max_num_reqs, max_model_len] int32 and `trace_len` [max_num_reqs] int32 (0 = the slot
    does not replay). Host: `trace_len_host` mirrors `trace_len` as soon as a write is staged, so the runner
    can skip the kernel without a device sync. Invariant: a slot never replays tokens of a previous owner,
    because every `add_request` stages its slot's `trace_len` (0 without a trace).
    """

    def __init__(self, max_num_reqs: int, max_model_len: int, device):
        if max_num_reqs < 1 or max_model_len < 1:
            raise ValueError(
                f"max_num_reqs and max_model_len must be >= 1, got {max_num_reqs} and {max_model_len}"
            )
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.device = torch.device(device)
        self.trace = torch.zeros(max_num_reqs, max_model_len, dtype=torch.int32, device=self.device)
        self.trace_len = torch.zeros(max_num_reqs, dtype=torch.int32, device=self.device)
        self._trace_writes = StagedRowWrites(self.trace)
        self._trace_len_writes = StagedSlotWrites(self.trace_len)
        # Trace rows staged since the last apply, by slot: a slot reused within one step keeps only its
        # last trace, so the single index_put_ never sees the same (row, col) twice (undefined on CUDA).
        self._pending_rows: dict[int, np.ndarray] = {}

    @property
    def trace_len_host(self) -> np.ndarray:
        """[max_num_reqs] int32 host mirror of `trace_len`, including writes not yet applied."""
        return self._trace_len_writes.host

    @property
    def has_trace(self) -> np.ndarray:
        """[max_num_reqs] bool host view: the slot's request replays a non-empty trace."""
        return self._trace_len_writes.host > 0

    def _check_slot(self, slot: int) -> None:
        """A bounds guard against a runner bug (slots come from RequestStates), not a trace rule."""
        if not 0 <= slot < self.max_num_reqs:
            raise ValueError(f"slot {slot} is out of range [0, {self.max_num_reqs})")

    def add_request(self, slot: int, trace_token_ids: list[int] | None) -> None:
        """Stage the slot's trace (None or [] = no replay; clears any trace left by the slot's last owner).

        The trace's rules (token ids in the vocabulary, at most max_model_len - prompt tokens, no conflicting
        options) were applied once, at admission (trace_rules.py, through SamplingParams)."""
        self._check_slot(slot)
        if trace_token_ids is None or len(trace_token_ids) == 0:
            self._pending_rows.pop(slot, None)
            self._trace_len_writes.stage(slot, 0)
            return
        self._pending_rows[slot] = np.asarray(trace_token_ids, dtype=np.int64)
        self._trace_len_writes.stage(slot, len(trace_token_ids))

    def remove_request(self, slot: int) -> None:
        """Stop replay on the slot (the trace row itself is left; trace_len = 0 makes it unreachable)."""
        self._check_slot(slot)
        self._pending_rows.pop(slot, None)
        self._trace_len_writes.stage(slot, 0)

    def apply_staged_writes(self, upload: Upload | None = None) -> None:
        """Copy this step's staged trace rows and lengths to the device; once per step, before sampling."""
        for slot, tokens in self._pending_rows.items():
            self._trace_writes.stage(slot, 0, tokens)
        self._pending_rows.clear()
        self._trace_writes.apply(upload)
        self._trace_len_writes.apply(upload)

    def any_replaying(self, slots: np.ndarray) -> bool:
        """Host-only: does any batch row (slot; < 0 = padding) replay a trace? False lets the sampler skip."""
        slots = np.asarray(slots)
        slots = slots[slots >= 0]
        return bool(slots.size) and bool((self._trace_len_writes.host[slots] > 0).any())

    def tokens_at(self, slots: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        """[U] int64 device: trace[slots[u], steps[u]], slots and steps [U] int64 device. Fast replay's upcoming
        input ids (model_runner_v2/input_batch.py): the trace is stored here only, not in the runner's token
        buffer. Steps must be within the slots' staged traces (applied: apply_staged_writes ran this step)."""
        return self.trace[slots, steps].long()

    def apply(
        self,
        sampled: torch.Tensor,
        slots: torch.Tensor,
        total_len: torch.Tensor,
        prompt_len: torch.Tensor,
        host_slots: np.ndarray,
        step_offsets: torch.Tensor | None = None,
    ) -> None:
        """Overwrite replaying rows of `sampled` [R] int64 in place; `host_slots` [R]: the same slots on host;
        `step_offsets` [R] int64 (fast replay): row r samples trace step total_len - prompt_len + step_offsets[r]."""
        if self.any_replaying(host_slots):
            trace_replay(sampled, slots, total_len, prompt_len, self.trace, self.trace_len, step_offsets)
