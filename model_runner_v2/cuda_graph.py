"""CUDA graphs for uniform steps: one graph per padded batch size, captured once at start-up, replayed whenever
every scheduled row has exactly q query tokens — q = 1 (decode, the steady state of generation) and, with a
speculative_config, q = 1 + num_speculative_tokens (n-gram verify steps where every row drafted k tokens).

A graph fixes every tensor address and every host int of the forward pass, so each family (one q) owns static
input buffers and each step's inputs go into them: a decode step's straight from the host, one copy into its
size's buffer, the graph gathering the input ids and block tables itself (decode_inputs.py); a verify step's by
copies from the step's own tensors (`GraphFamily.stage`). Rows past the real batch (padding up to the captured
size) read and write only the KV cache's *sink block* (one extra block the BlockManager never hands out), so
they cannot touch a live request's cache. Host ints fixed at capture: decode
attention runs with `max_seq_len = max_model_len` (the split-context grid; splits past a sequence's end return
at once), verify attention is the varlen prefill kernel with `max_query_len = q` (its grid and tile); both read
seq_lens, query_start_loc and block tables from the static buffers inside the kernel, so one graph serves any
context lengths (kernels/paged_attention.py).

Used on CUDA with the triton attention backend and tensor_parallel_size=1 unless `enforce_eager=True`; other
steps (prefill, chunked prefill, mixed batches, verify steps where some row drafted fewer than k tokens,
batches larger than the largest graph) run eagerly.
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_left

import numpy as np
import torch
from torch import nn

from ..config import EngineConfig
from ..kernels.compile_ahead import compile_ahead
from .decode_inputs import POSITIONS, DecodeInputs
from .forward_context import AttentionMetadata, ForwardContext, set_forward_context
from .input_batch import InputBatch
from .request_states import RequestStates

logger = logging.getLogger(__name__)


_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}


def capture_stream(device_index: int) -> torch.cuda.Stream:
    """One side stream per device for every capture of the process (decode and piecewise graphs, every engine):
    cuBLAS keeps a workspace for each stream it ran on, for the life of the process, so a new stream per engine
    would leave ~40 MiB behind each engine built."""
    if device_index not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[device_index] = torch.cuda.Stream(device_index)
    return _CAPTURE_STREAMS[device_index]


def capture_sizes(max_size: int) -> list[int]:
    """Padded batch sizes that get a graph: 1, 2, 4, then every 8 up to 256, every 16 above, and max_size."""
    sizes = [s for s in (1, 2, 4) if s <= max_size]
    sizes += [s for s in range(8, min(max_size, 256) + 1, 8)]
    sizes += [s for s in range(272, max_size + 1, 16)]
    if sizes[-1] != max_size:
        sizes.append(max_size)
    return sizes


def verify_max_rows(config: EngineConfig) -> int:
    """Most rows of a verify graph: its tokens (rows * q) stay within max_cudagraph_capture_size, the bound on a
    decode graph's tokens, and never fewer than one row (batch 1 is where speculation pays most)."""
    q = 1 + config.speculative_config.num_speculative_tokens
    return min(config.max_num_seqs, max(1, config.max_cudagraph_capture_size // q))


class GraphFamily:
    """Static inputs, graphs and outputs for verify steps: B rows with exactly q > 1 query tokens each. Buffers are
    [rows] for per-row data and [rows * q] for per-token data; row i's tokens sit at [i * q, (i + 1) * q)."""

    def __init__(self, q: int, sizes: list[int], config: EngineConfig, sink_block: int):
        self.q = q
        self.sizes = sizes
        self.sink_block = sink_block
        rows, device = sizes[-1], config.torch_device
        i64 = dict(dtype=torch.int64, device=device)
        # Padding values: a padded row is a q-token sequence at positions 0..q-1 that lives in the sink block
        # (q <= block_size in practice; longer rows wrap inside it, and every column of their table is the sink).
        pad_pos = torch.arange(q, **i64).repeat(rows)  # [rows * q]
        self.pad_positions = pad_pos
        self.pad_slots = sink_block * config.block_size + pad_pos % config.block_size
        self.input_ids = torch.zeros(rows * q, **i64)
        self.positions = pad_pos.clone()
        self.slot_mapping = self.pad_slots.clone()
        self.seq_lens = torch.full((rows,), q, **i64)
        self.block_tables = torch.full((rows, config.max_blocks_per_seq), sink_block, dtype=torch.int32,
                                       device=device)
        self.query_start_loc = torch.arange(0, rows * q + 1, q, **i64)  # [rows + 1]
        self.token_req_idx = torch.arange(rows, **i64).repeat_interleave(q)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # size -> the graph's hidden output [size * q, H]

    def serves(self, num_rows: int, num_tokens: int, max_query_len: int) -> bool:
        return max_query_len == self.q and num_tokens == num_rows * self.q and num_rows <= self.sizes[-1]

    def stage(self, batch: InputBatch, size: int) -> None:
        """Copy the step's inputs into the static buffers; rows [n, size) become padding (they may hold a
        larger earlier batch's live slots)."""
        n, q = batch.host_slots.shape[0], self.q
        t, end = n * q, size * q
        md = batch.attn
        self.input_ids[:t].copy_(batch.input_ids)
        self.positions[:t].copy_(batch.positions)
        self.seq_lens[:n].copy_(md.seq_lens)
        self.slot_mapping[:t].copy_(md.slot_mapping)
        self.block_tables[:n, : md.block_tables.shape[1]].copy_(md.block_tables)
        if n < size:
            self.input_ids[t:end].zero_()
            self.positions[t:end].copy_(self.pad_positions[t:end])
            self.seq_lens[n:size].fill_(q)
            self.slot_mapping[t:end].copy_(self.pad_slots[t:end])
            self.block_tables[n:size].fill_(self.sink_block)

    def forward_inputs(self, size: int, max_model_len: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """What the graph of `size` rows runs the model on: input ids, positions, metadata (static views)."""
        end = size * self.q
        md = AttentionMetadata(
            query_start_loc=self.query_start_loc[: size + 1], seq_lens=self.seq_lens[:size],
            slot_mapping=self.slot_mapping[:end], block_tables=self.block_tables[:size],
            token_req_idx=self.token_req_idx[:end], positions=self.positions[:end],
            max_query_len=self.q, max_seq_len=max_model_len,  # fixed for every replay
        )
        return self.input_ids[:end], self.positions[:end], md


class DecodeFamily:
    """Graphs and outputs for decode steps (q = 1), their static inputs in `inputs` (decode_inputs.py): each graph
    starts by gathering its rows' input ids and block tables."""

    q = 1

    def __init__(self, sizes: list[int], config: EngineConfig, sink_block: int, states: RequestStates):
        self.sizes = sizes
        self.inputs = DecodeInputs(states, sizes, config.block_size, sink_block)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # size -> the graph's hidden output [size, H]

    def forward_inputs(self, size: int, max_model_len: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        self.inputs.gather(size)  # inside the capture: every replay gathers again
        return (self.inputs.input_ids[:size], self.inputs.packed[size][POSITIONS],
                self.inputs.metadata(size, max_model_len))


class CudaGraphRunner:
    """Decode (and verify) forward passes through captured graphs. `replay=False` runs the same padded
    static-buffer path eagerly (no capture): the CPU tests use it to check padding and sink isolation without a
    GPU."""

    def __init__(self, model: nn.Module, kv_caches: list[torch.Tensor], config: EngineConfig, sink_block: int,
                 states: RequestStates, replay: bool = True, routed_experts: torch.Tensor | None = None):
        """states: the runner's slots, whose token buffers and block tables the decode graphs gather from (their
        `pad_slot` row must hold `sink_block`)."""
        self.model = model
        self.kv_caches = kv_caches
        self.routed_experts = routed_experts  # MoE routes per KV slot (written inside the graphs) or None
        self.attn_backend = config.attention_backend
        self.max_model_len = config.max_model_len
        self.replay = replay
        self.sink_block = sink_block
        self.sink_slot = sink_block * config.block_size
        self.decode = DecodeFamily(capture_sizes(min(config.max_cudagraph_capture_size, config.max_num_seqs)),
                                   config, sink_block, states)
        self.verify: GraphFamily | None = None  # with a speculative_config: q = 1 + num_speculative_tokens
        if config.speculative_config is not None:
            q = 1 + config.speculative_config.num_speculative_tokens
            self.verify = GraphFamily(q, capture_sizes(verify_max_rows(config)), config, sink_block)
        self.sizes = self.decode.sizes
        self.num_replays = 0  # steps served by this runner, decode and verify (tests and logs)
        self.num_verify_replays = 0  # of which verify steps
        if replay:
            self._capture_all()

    @property
    def families(self) -> list[GraphFamily | DecodeFamily]:
        return [f for f in (self.verify, self.decode) if f is not None]  # most tokens first: capture order

    def decode_size(self, num_rows: int) -> int | None:
        """The decode graph (padded rows) for a step of `num_rows` one-token rows; None: more than the largest."""
        sizes = self.decode.sizes
        return sizes[bisect_left(sizes, num_rows)] if num_rows <= sizes[-1] else None

    def prepare_decode(self, slots: np.ndarray, num_computed: np.ndarray, num_sampled: np.ndarray,
                       size: int) -> InputBatch:
        """A decode step's inputs straight into the static buffers of the graph of `size` rows
        (DecodeInputs.prepare: [n] host arrays in batch order); `run` replays it."""
        return self.decode.inputs.prepare(slots, num_computed, num_sampled, size)

    def padded_size(self, batch: InputBatch) -> int | None:
        """The verify graph size (rows) serving a step that did not come from `prepare_decode`, or None when it must
        run eagerly: every row has exactly q query tokens (num_tokens == rows * q), and no more rows than the
        largest verify graph. (A decode step takes `decode_size` / `prepare_decode` instead.)"""
        verify, num_rows = self.verify, batch.host_slots.shape[0]
        if verify is None or not verify.serves(num_rows, batch.input_ids.shape[0], batch.attn.max_query_len):
            return None
        return verify.sizes[bisect_left(verify.sizes, num_rows)]

    def run(self, batch: InputBatch, size: int) -> torch.Tensor:
        """Replay the graph of `size` rows for the step: a decode step from `prepare_decode` (its inputs already
        in place), or a verify step, whose inputs are copied into the static buffers first (rows [n, size) padded
        to the sink). Returns hidden [T, H] (a view into the graph's output: consume it before the next step); the
        real rows' tokens come first, in batch order, so `batch.logits_indices` select from it as from eager."""
        if batch.graph_size is not None:
            family, size = self.decode, batch.graph_size
        else:
            family = self.verify
            family.stage(batch, size)
            self.num_verify_replays += 1
        self.num_replays += 1
        num_tokens = batch.input_ids.shape[0]
        if self.replay:
            family.graphs[size].replay()
            return family.outputs[size][:num_tokens]
        return self._forward(family, size)[:num_tokens]

    def _forward(self, family: GraphFamily | DecodeFamily, size: int) -> torch.Tensor:
        input_ids, positions, md = family.forward_inputs(size, self.max_model_len)
        with set_forward_context(ForwardContext(md, self.kv_caches, self.attn_backend,
                                                routed_experts=self.routed_experts)):
            return self.model(input_ids, positions)

    def release(self) -> None:
        """Free the graphs (their pool's memory returns to the allocator) and the static buffers."""
        for family in self.families:
            for graph in family.graphs.values():
                graph.reset()
            family.graphs.clear()
            family.outputs.clear()
        self.decode = self.verify = None
        self.sizes = []

    @torch.inference_mode()
    def _capture_all(self) -> None:
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info()[0]
        pool = torch.cuda.graph_pool_handle()
        # Warm-up and capture on one side stream. Each size runs eagerly right before its capture: a smaller
        # size may pick another decode tile (another Triton compile) or another cuBLAS algorithm and workspace,
        # and nothing may compile or allocate a handle inside a capture (on a cold Triton cache that failed
        # with "operation failed due to a previous error during capture").
        stream = capture_stream(torch.cuda.current_device())
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            device = self.decode.inputs.input_ids.device
            with compile_ahead(device, "decode graphs"):  # every size's variants, in parallel
                for family in self.families:
                    for size in family.sizes:
                        self._forward(family, size)
            for family in self.families:  # most tokens first: smaller graphs reuse the pool's memory
                for size in reversed(family.sizes):
                    self._forward(family, size)
                    stream.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        family.outputs[size] = self._forward(family, size)
                    family.graphs[size] = graph
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        used_mib = (free_before - torch.cuda.mem_get_info()[0]) / 2**20
        verify = ("" if self.verify is None else
                  f" + {len(self.verify.sizes)} verify graphs (rows 1..{self.verify.sizes[-1]}, "
                  f"{self.verify.q} tokens each)")
        logger.info("captured %d CUDA graphs (decode batch sizes %d..%d)%s in %.1f s, %.0f MiB", len(self.sizes),
                    self.sizes[0], self.sizes[-1], verify, time.perf_counter() - start, used_mib)
