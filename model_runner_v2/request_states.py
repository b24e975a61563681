"""RequestStates: persistent per-slot request state on the device (V2 style), with host mirrors."""

from __future__ import annotations

import numpy as np
import torch

from ..kernels import append_sampled
from ..kernels.dispatch import use_fused_kernels
from ..sampling.sampler import MultiPositionRows, SlotTokens
from ..sampling.staged_writes import StagedRowWrites, StagedSlotWrites, Upload
from .pinned_ring import PinnedRing


class RequestStates:
    """Each live request owns one slot (its row in every per-request table, here and in the sampler) from its
    first scheduling until it finishes or is preempted. Device tensors are indexed by slot; a step gathers them
    through `slots`, the slot of each batch row (vLLM's `idx_mapping`).

    Host mirrors (`host_token_ids`, `host_block_table`, `prompt_len.host`, `total_len.host`) let host-side rules
    (min_tokens, bad words) and batch preparation (slot mapping) run without reading the device.
    """

    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_seq: int, device: torch.device,
                 pad_block: int = 0):
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.device = device
        self.req_id_to_slot: dict[str, int] = {}
        self.free_slots = list(range(max_num_reqs - 1, -1, -1))  # pop() hands out slot 0 first
        self.token_ids = torch.zeros(max_num_reqs, max_model_len, dtype=torch.int32, device=device)
        self.host_token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        # One row more than there are slots: `pad_slot`, every entry `pad_block` (the KV cache's sink block), the
        # table of a CUDA graph's padding rows (decode_inputs.py); no request ever owns it.
        self.pad_slot = max_num_reqs
        self.block_table = torch.zeros(max_num_reqs + 1, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.block_table[self.pad_slot] = pad_block
        self.host_block_table = np.zeros((max_num_reqs + 1, max_blocks_per_seq), dtype=np.int32)  # its host mirror
        self.host_block_table[self.pad_slot] = pad_block
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)  # host: blocks written per slot
        self.prompt_len = StagedSlotWrites(torch.zeros(max_num_reqs, dtype=torch.int32, device=device))
        # total_len = tokens known for the slot (prompt + sampled). The device copy advances inside the step
        # right after sampling; the host mirror catches up after the step's one output copy.
        self.total_len = StagedSlotWrites(torch.zeros(max_num_reqs, dtype=torch.int32, device=device))
        self._token_writes = StagedRowWrites(self.token_ids)
        self._block_writes = StagedRowWrites(self.block_table)
        self.input_staging = PinnedRing(device)  # the step's packed inputs' way to the device (input_batch.py)

    def slot_tokens(self) -> SlotTokens:
        """What the sampler reads of these slots: views of the buffers above (they are never reallocated)."""
        return SlotTokens(self.token_ids, self.host_token_ids, self.prompt_len.tensor, self.total_len.tensor,
                          self.prompt_len.host, self.total_len.host)

    def add_request(self, request_id: str, token_ids: list[int], num_prompt_tokens: int,
                    block_ids: list[int]) -> int:
        """token_ids: prompt + outputs so far (a replaying request's trace tokens not emitted yet are not here:
        the sampler's trace rows hold the trace, and fast replay gathers a chunk's upcoming input ids there)."""
        if not self.free_slots:
            raise RuntimeError("no free request slot (scheduler exceeded max_num_seqs)")
        slot = self.free_slots.pop()
        self.req_id_to_slot[request_id] = slot
        self.host_token_ids[slot, : len(token_ids)] = token_ids
        self._token_writes.stage(slot, 0, token_ids)
        self.prompt_len.stage(slot, num_prompt_tokens)
        self.total_len.stage(slot, len(token_ids))
        self.num_blocks[slot] = 0
        self.append_blocks(slot, block_ids)
        return slot

    def append_blocks(self, slot: int, block_ids: list[int]) -> None:
        if block_ids:
            start = int(self.num_blocks[slot])
            self._block_writes.stage(slot, start, block_ids)
            self.host_block_table[slot, start:start + len(block_ids)] = block_ids
            self.num_blocks[slot] += len(block_ids)

    def flat_token_index(self, slots: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Host: where each (slot, position) sits in `token_ids.view(-1)` (the step's input-id gather), int64."""
        return slots * self.token_ids.shape[1] + positions

    def slot_mapping(self, slots: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
        """Host: each (slot, position)'s flat KV-cache slot (block * block_size + offset), int64, read from the
        host mirror of the block table."""
        blocks = self.host_block_table[slots, positions // block_size].astype(np.int64)
        return blocks * block_size + positions % block_size

    def stage_drafts(self, slot: int, draft_token_ids: list[int]) -> None:
        """Speculative decoding: the slot's drafted tokens, written right after its known tokens (not counted in
        total_len), where this step gathers its input ids. Needs the host total_len to be current (synchronous
        steps: speculative decoding implies them)."""
        self._token_writes.stage(slot, int(self.total_len.host[slot]), draft_token_ids)

    def remove_request(self, request_id: str) -> int | None:
        slot = self.req_id_to_slot.pop(request_id, None)
        if slot is not None:
            self.free_slots.append(slot)
        return slot

    def apply_staged_writes(self, upload: Upload | None = None) -> None:
        """The staged writes onto `upload` (model_runner_v2/step_upload.py; None: copied at once)."""
        self._token_writes.apply(upload)
        self._block_writes.apply(upload)
        self.prompt_len.apply(upload)
        self.total_len.apply(upload)

    def append_sampled_device(self, slots: torch.Tensor, sampled: torch.Tensor,
                              multi_position: MultiPositionRows | None = None,
                              num_kept: torch.Tensor | None = None) -> None:
        """On device, inside the step: token_ids[slot, total_len[slot]] = sampled; total_len += 1.
        slots [R] int64, sampled [R] int64. The next step's input ids are gathered from here. With `multi_position`
        (fast replay) both are [S]: a slot appears once per token it sampled, in order, and gains that many; with
        num_kept [R] too (speculative rows) it gains only its kept tokens (the rest are written past total_len,
        where later steps overwrite them)."""
        if multi_position is None:  # one launch on CUDA (kernels/append_sampled.py; REPLAYLLM_APPEND_KERNEL=0: torch)
            fused = append_sampled.ENABLED and use_fused_kernels(self.device)
            append = append_sampled.append_sampled_triton if fused else append_sampled.append_sampled_torch
            append(self.token_ids, self.total_len.tensor, slots, sampled)
            return
        pos = self.total_len.tensor[slots].long()
        self.token_ids[slots, pos + multi_position.step_offsets] = sampled.to(torch.int32)
        last = multi_position.last  # one entry per slot: no repeated index in the update below
        gained = multi_position.step_offsets[last] + 1 if num_kept is None else num_kept
        self.total_len.tensor[slots[last]] += gained.to(torch.int32)

    def append_sampled_host(self, slots: np.ndarray, sampled: np.ndarray,
                            step_offsets: np.ndarray | None = None) -> None:
        """The host mirror of append_sampled_device; step_offsets [S] (fast replay): 0 .. n-1 per slot."""
        pos = self.total_len.host[slots]
        if step_offsets is None:
            self.host_token_ids[slots, pos] = sampled
            self.total_len.host[slots] += 1
            return
        self.host_token_ids[slots, pos + step_offsets] = sampled
        np.add.at(self.total_len.host, slots, 1)
