"""Input preparation: host metadata for one step (numpy, no per-token loops), one copy, one device gather of the
input ids (and the block tables)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..sampling.sampler import MultiPositionRows
from ..sampling.trace_replay_state import TraceReplayState
from .forward_context import AttentionMetadata
from .pinned_ring import PinnedRing
from .request_states import RequestStates


@dataclass
class InputBatch:
    """One step's batch. B rows (requests), T tokens, R sampled rows, S sampled positions (S == R unless a
    fast-replay row samples several: then `multi_position` says which)."""

    input_ids: torch.Tensor  # [T] int64, gathered on device from the slots' token buffers
    positions: torch.Tensor  # [T] int64
    attn: AttentionMetadata
    logits_indices: torch.Tensor  # [S] int64, the sampled positions: each sampled row's last (or last n) tokens
    sample_slots: torch.Tensor  # [S] int64, slot of each sampled position (the sampler's `slots`)
    host_slots: np.ndarray  # [B] slot per row
    host_sample_rows: np.ndarray  # [R] row index of each sampled row
    host_query_start_loc: np.ndarray  # [B + 1]
    host_positions_start: np.ndarray  # [B] num_computed_tokens per row
    multi_position: MultiPositionRows | None = None  # None: one sampled position per sampled row
    every_token_sampled: bool = False  # logits_indices == arange(T) (a decode step): the hidden rows as they are
    # The decode graph (its padded rows) this step replays, its inputs already in that graph's static buffers
    # (decode_inputs.py); None: the step's tensors above are its own, for eager / piecewise / verify graphs.
    graph_size: int | None = None

    @property
    def host_sample_slots(self) -> np.ndarray:
        """[S] slot of each sampled position."""
        rows = self.host_sample_rows
        if self.multi_position is not None:
            rows = np.repeat(rows, self.multi_position.num_sampled)
        return self.host_slots[rows]


@dataclass(frozen=True)
class _SampledPositions:
    """Host: which positions of the step are sampled. R sampled rows, S sampled positions."""

    rows: np.ndarray  # [R] row index of each sampled row
    counts: np.ndarray  # [R] positions sampled per row
    pos_row: np.ndarray  # [S] row of each sampled position
    logits_indices: np.ndarray  # [S] token index of each sampled position
    chunk_parts: list[np.ndarray]  # fast replay / speculative: [S] offsets 0 .. n-1 and [R] each row's last; else []


def _sampled_positions(qsl: np.ndarray, num_sampled: np.ndarray) -> _SampledPositions:
    rows = np.flatnonzero(num_sampled)
    counts = num_sampled[rows]  # [R]
    if not (counts.size and counts.max() > 1):
        return _SampledPositions(rows, counts, rows, qsl[1:][rows] - 1, [])
    # Several positions per row: a row's last n positions are all sampled.
    pos_row = np.repeat(rows, counts)  # [S]
    ends = np.cumsum(counts)
    offsets = np.arange(int(ends[-1]), dtype=np.int64) - np.repeat(ends - counts, counts)  # [S] 0 .. n-1
    logits_indices = qsl[pos_row + 1] - np.repeat(counts, counts) + offsets
    return _SampledPositions(rows, counts, pos_row, logits_indices, [offsets, ends - 1])


def _upcoming_trace(states: RequestStates, slots: np.ndarray, sampled_pos: _SampledPositions,
                    positions: np.ndarray) -> list[np.ndarray]:
    """Fast replay: a replaying row's chunk [last token, trace[i], ..., trace[i+n-2]] samples its last n
    positions, and all but the first of them hold upcoming trace tokens, which the slot's token buffer does not
    have yet (it holds the known tokens only). [U] token index, [U] slot and [U] trace step of each."""
    upcoming = sampled_pos.chunk_parts[0] > 0  # [S]
    token_idx = sampled_pos.logits_indices[upcoming]
    up_slots = slots[sampled_pos.pos_row[upcoming]].astype(np.int64)
    steps = positions[token_idx] - states.prompt_len.host[up_slots]  # trace step = position - prompt length
    return [token_idx, up_slots, steps.astype(np.int64)]


def prepare_inputs(states: RequestStates, slots: np.ndarray, num_computed: np.ndarray,
                   num_scheduled: np.ndarray, num_sampled: np.ndarray, block_size: int,
                   trace: TraceReplayState | None = None) -> InputBatch:
    """slots/num_computed/num_scheduled/num_sampled: [B] host arrays in batch order (num_sampled: tokens sampled
    at the end of each row's chunk, 0 for a partial prefill, > 1 for a fast-replay chunk). trace: the sampler's
    trace rows (with enable_trace_replay, which excludes speculative decoding: every chunk of several sampled
    positions is then a fast-replay chunk, whose upcoming input ids are read from it)."""
    device = states.device
    num_rows = slots.shape[0]
    qsl = np.zeros(num_rows + 1, dtype=np.int64)
    np.cumsum(num_scheduled, out=qsl[1:])
    num_tokens = int(qsl[-1])
    token_row = np.repeat(np.arange(num_rows, dtype=np.int64), num_scheduled)  # [T]
    positions = num_computed[token_row] + (np.arange(num_tokens, dtype=np.int64) - qsl[token_row])
    seq_lens = num_computed + num_scheduled
    sampled_pos = _sampled_positions(qsl, num_sampled)
    up_parts = []
    if trace is not None and sampled_pos.chunk_parts:
        up_parts = _upcoming_trace(states, slots, sampled_pos, positions)
    max_seq_len = int(seq_lens.max())
    # Per token, on the host: its slot, its flat index in the token buffer and its KV slot (the host block table
    # mirrors the device's), so the device only gathers the input ids.
    token_slots = slots[token_row].astype(np.int64)
    flat_token_idx = states.flat_token_index(token_slots, positions)
    slot_mapping = states.slot_mapping(token_slots, positions, block_size)

    # One host->device copy for every int array of the step, split on the device.
    parts = [slots.astype(np.int64), qsl, seq_lens.astype(np.int64), token_row, positions, sampled_pos.logits_indices,
             slots[sampled_pos.pos_row].astype(np.int64), flat_token_idx, slot_mapping, *sampled_pos.chunk_parts,
             *up_parts]
    (d_slots, d_qsl, d_seq_lens, d_token_row, d_positions, d_logits_idx, d_sample_slots, d_flat_token_idx,
     d_slot_mapping, *d_rest) = _to_device(parts, device, states.input_staging)
    multi_position = None
    if sampled_pos.chunk_parts:
        multi_position = MultiPositionRows(sampled_pos.counts, d_rest[0], sampled_pos.chunk_parts[0], d_rest[1],
                                           sampled_pos.chunk_parts[1])

    input_ids = states.token_ids.view(-1)[d_flat_token_idx].long()  # [T]
    if up_parts:
        d_up_idx, d_up_slots, d_up_steps = d_rest[2:]
        input_ids[d_up_idx] = trace.tokens_at(d_up_slots, d_up_steps)
    max_blocks = -(-max_seq_len // block_size)
    block_tables = states.block_table[d_slots, :max_blocks]  # [B, max_blocks]
    attn = AttentionMetadata(
        query_start_loc=d_qsl, seq_lens=d_seq_lens, slot_mapping=d_slot_mapping, block_tables=block_tables,
        token_req_idx=d_token_row, positions=d_positions,
        max_query_len=int(num_scheduled.max()), max_seq_len=max_seq_len, req_slots=d_slots,
        host_query_start_loc=qsl, host_seq_lens=seq_lens.astype(np.int64),
    )
    every = bool(np.array_equal(sampled_pos.logits_indices, np.arange(num_tokens)))
    return InputBatch(input_ids, d_positions, attn, d_logits_idx, d_sample_slots, slots, sampled_pos.rows, qsl,
                      num_computed, multi_position, every)


def _to_device(parts: list[np.ndarray], device: torch.device, staging: PinnedRing | None = None
               ) -> list[torch.Tensor]:
    """int64 host arrays -> device views, in one (pinned, non-blocking) copy through `staging` (a fresh ring
    when None). Each part starts 16-byte aligned (PinnedRing.upload): Triton specialises a pointer argument on
    16-byte alignment, so with packed offsets that follow the batch size (an odd B put query_start_loc at an 8-byte
    offset) one kernel compiled two variants, the second inside a user's run (a prefix-hit step); aligned, every
    step passes the same kind of pointer."""
    return (staging or PinnedRing(device)).upload(parts)
