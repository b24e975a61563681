"""DecodeInputs: a decode step's inputs, written from the host straight into the decode graphs' static buffers.

A decode step (every row one query token, at most the largest captured batch) replays a CUDA graph
(cuda_graph.py). The general input path (input_batch.py) built it from ~20 host-side torch calls: a packed copy
split into nine views, a device gather of the input ids and its cast, a gather of the rows' block tables, then
one copy per static buffer. At batch 1 the step is host-bound (docs/benchmarks.md, sessions 18-19), each call
costing ~10-30 µs of the H200's host. Here the host fills one pinned [7, size] int64 array per step (numpy, from
the slots' host mirrors), sends it with one copy into the static buffer of the graph of that size, and the graph
itself gathers the input ids (from the slots' token buffers) and the block tables (from the slots' table rows) as
its first kernels: the step's host work on the device is that copy and the replay.

Rows [n, size) are padding: slot `RequestStates.pad_slot` (a block-table row that holds only the sink block),
position 0, length 1, KV slot in the sink block, so padding reads and writes the sink and nothing else.
"""

from __future__ import annotations

import numpy as np
import torch

from .forward_context import AttentionMetadata
from .input_batch import InputBatch
from .pinned_ring import PinnedRing
from .request_states import RequestStates

# Row k of a size's [7, size] int64 buffer (the host array and the graph's static buffer share the layout).
SLOTS, FLAT_TOKEN, POSITIONS, SEQ_LENS, SLOT_MAPPING, LOGITS_IDX, SAMPLE_SLOTS = range(7)
NUM_FIELDS = 7


def _row_width(size: int) -> int:
    """Elements a row of a size's buffer takes: size rounded up to 2 int64, so every row starts 16-byte aligned
    (Triton specialises a pointer argument on 16-byte alignment: an odd size's rows would otherwise compile other
    variants of the kernels that read them, as input_batch.py's packed copy also avoids)."""
    return size + size % 2


class DecodeInputs:
    """Static inputs of the decode graphs: one [7, size] int64 buffer per captured size (the host-fed numbers), and
    the buffers the graph fills itself, shared by every size: input ids [rows] int64 and block tables [rows,
    max_blocks_per_seq] int32, rows = the largest size."""

    def __init__(self, states: RequestStates, sizes: list[int], block_size: int, sink_block: int):
        self.states = states
        self.sizes = sizes
        self.block_size = block_size
        self.sink_slot = sink_block * block_size
        device = states.device
        rows = sizes[-1]
        self._pads = {size: self._padding(size) for size in sizes}  # [7, size] host, what rows past a step hold
        # Per size: the [7, width] buffer the host's copy lands in, and its [7, size] view (rows contiguous).
        self._buffers = {size: torch.zeros(NUM_FIELDS, _row_width(size), dtype=torch.int64, device=device)
                         for size in sizes}
        self.packed = {size: buf[:, :size] for size, buf in self._buffers.items()}
        for size, view in self.packed.items():
            view.copy_(torch.from_numpy(self._pads[size]))
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.block_tables = states.block_table[states.pad_slot].repeat(rows, 1)  # [rows, max_blocks] int32
        self.query_start_loc = torch.arange(rows + 1, dtype=torch.int64, device=device)
        self.token_req_idx = torch.arange(rows, dtype=torch.int64, device=device)
        self.staging = PinnedRing(device)
        self._arange = np.arange(rows + 1, dtype=np.int64)

    def _padding(self, size: int) -> np.ndarray:
        """[7, size]: every row a padding row (what a size holds before its first step, and capture reads)."""
        pad = np.zeros((NUM_FIELDS, size), dtype=np.int64)
        pad[SLOTS] = pad[SAMPLE_SLOTS] = self.states.pad_slot
        pad[SEQ_LENS] = 1
        pad[SLOT_MAPPING] = self.sink_slot
        pad[LOGITS_IDX] = np.arange(size)
        return pad

    def gather(self, size: int) -> None:
        """The graph's first kernels (captured): the rows' input ids from the slots' token buffers and their block
        tables from the slots' table rows, into the shared static buffers."""
        packed, states = self.packed[size], self.states
        ids = states.token_ids.view(-1).index_select(0, packed[FLAT_TOKEN])  # [size] int32
        self.input_ids[:size].copy_(ids)
        torch.index_select(states.block_table, 0, packed[SLOTS], out=self.block_tables[:size])

    def metadata(self, size: int, max_model_len: int) -> AttentionMetadata:
        """The graph's attention metadata: views of the static buffers (host ints fixed at capture)."""
        packed = self.packed[size]
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: size + 1], seq_lens=packed[SEQ_LENS],
            slot_mapping=packed[SLOT_MAPPING], block_tables=self.block_tables[:size],
            token_req_idx=self.token_req_idx[:size], positions=packed[POSITIONS],
            max_query_len=1, max_seq_len=max_model_len, req_slots=packed[SLOTS],
        )

    def prepare(self, slots: np.ndarray, num_computed: np.ndarray, num_sampled: np.ndarray, size: int
                ) -> InputBatch:
        """One decode step of n = len(slots) rows (one query token each; num_sampled [n] 1, or 0 for a row that
        samples nothing) on the graph of `size` >= n rows: fills and sends the size's buffer, returns the step's
        InputBatch (device tensors: views of the static buffers, valid until the next step of this size;
        input_ids: filled by the replay)."""
        n, states = slots.shape[0], self.states
        width = _row_width(size)
        host = self.staging.host_buffer(NUM_FIELDS * width).reshape(NUM_FIELDS, width)[:, :size]
        if n < size:
            host[:, n:] = self._pads[size][:, n:]
        positions = num_computed
        host[SLOTS, :n] = slots
        host[FLAT_TOKEN, :n] = states.flat_token_index(slots, positions)
        host[POSITIONS, :n] = positions
        host[SEQ_LENS, :n] = positions + 1
        host[SLOT_MAPPING, :n] = states.slot_mapping(slots, positions, self.block_size)
        rows = self._arange[:n] if bool(num_sampled.all()) else np.flatnonzero(num_sampled)  # [R] sampled rows
        num_rows = rows.shape[0]
        host[LOGITS_IDX, :num_rows] = rows
        host[SAMPLE_SLOTS, :num_rows] = slots[rows]
        packed = self.packed[size]
        self.staging.send_into(self._buffers[size].view(-1), NUM_FIELDS * width)
        qsl = self._arange[: n + 1]
        seq_lens = positions + 1
        attn = AttentionMetadata(
            query_start_loc=self.query_start_loc[: n + 1], seq_lens=packed[SEQ_LENS, :n],
            slot_mapping=packed[SLOT_MAPPING, :n], block_tables=self.block_tables[:n],
            token_req_idx=self.token_req_idx[:n], positions=packed[POSITIONS, :n],
            max_query_len=1, max_seq_len=int(seq_lens.max()), host_query_start_loc=qsl, host_seq_lens=seq_lens,
            req_slots=packed[SLOTS, :n],
        )
        return InputBatch(self.input_ids[:n], packed[POSITIONS, :n], attn, packed[LOGITS_IDX, :num_rows],
                          packed[SAMPLE_SLOTS, :num_rows], slots, rows, qsl, num_computed,
                          every_token_sampled=num_rows == n, graph_size=size)
