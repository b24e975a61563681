"""CUDA graphs for decode steps: one graph per padded batch size, captured once at start-up, replayed whenever
every scheduled row has exactly one query token (the steady state of generation).

A graph fixes every tensor address and every host int of the forward pass, so the runner owns static input
buffers sized for the largest graph and copies each step's inputs into them. Rows past the real batch
(padding up to the captured size) read and write only the KV cache's *sink block* (one extra block the
BlockManager never hands out), so they cannot touch a live request's cache. Decode attention is captured with
`max_seq_len = max_model_len`: the split-context grid is fixed at capture and splits past a sequence's end
return at once (kernels/paged_attention.py).

Used on CUDA with the triton attention backend and tensor_parallel_size=1 unless `enforce_eager=True`; other
steps (prefill, chunked prefill, mixed batches, batches larger than the largest graph) run eagerly.
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_left

import torch
from torch import nn

from ..config import EngineConfig
from .forward_context import AttentionMetadata, ForwardContext, set_forward_context
from .input_batch import InputBatch

logger = logging.getLogger(__name__)


def capture_sizes(max_size: int) -> list[int]:
    """Padded batch sizes that get a graph: 1, 2, 4, then every 8 up to 256, every 16 above, and max_size."""
    sizes = [s for s in (1, 2, 4) if s <= max_size]
    sizes += [s for s in range(8, min(max_size, 256) + 1, 8)]
    sizes += [s for s in range(272, max_size + 1, 16)]
    if sizes[-1] != max_size:
        sizes.append(max_size)
    return sizes


class CudaGraphRunner:
    """Decode forward passes through captured graphs. `replay=False` runs the same padded static-buffer path
    eagerly (no capture): the CPU tests use it to check padding and sink isolation without a GPU."""

    def __init__(self, model: nn.Module, kv_caches: list[torch.Tensor], config: EngineConfig, sink_block: int,
                 replay: bool = True):
        self.model = model
        self.kv_caches = kv_caches
        self.attn_backend = config.attention_backend
        self.max_model_len = config.max_model_len
        self.sizes = capture_sizes(min(config.max_cudagraph_capture_size, config.max_num_seqs))
        self.replay = replay
        self.sink_block = sink_block
        self.sink_slot = sink_block * config.block_size
        self.num_replays = 0  # decode steps served by this runner (tests and logs)
        b, device = self.sizes[-1], config.torch_device
        i64 = dict(dtype=torch.int64, device=device)
        # Static inputs [max size]; row i of a step lives at index i. Initialised to padding values.
        self.input_ids = torch.zeros(b, **i64)
        self.positions = torch.zeros(b, **i64)
        self.seq_lens = torch.ones(b, **i64)
        self.slot_mapping = torch.full((b,), self.sink_slot, **i64)
        self.block_tables = torch.full((b, config.max_blocks_per_seq), sink_block, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(b + 1, **i64)  # one query token per row
        self.token_req_idx = torch.arange(b, **i64)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # size -> the graph's hidden output [size, H]
        if replay:
            self._capture_all()

    def padded_size(self, batch: InputBatch) -> int | None:
        """The graph size serving this step, or None when it must run eagerly."""
        num_rows = batch.host_slots.shape[0]
        if batch.attn.max_query_len != 1 or num_rows > self.sizes[-1]:
            return None
        return self.sizes[bisect_left(self.sizes, num_rows)]

    def run(self, batch: InputBatch, size: int) -> torch.Tensor:
        """Copy the step's inputs into the static buffers, pad rows [n, size) to the sink, replay.
        Returns hidden [n, H] (a view into the graph's output: consume it before the next step)."""
        n = batch.host_slots.shape[0]
        md = batch.attn
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.seq_lens[:n].copy_(md.seq_lens)
        self.slot_mapping[:n].copy_(md.slot_mapping)
        self.block_tables[:n, : md.block_tables.shape[1]].copy_(md.block_tables)
        if n < size:  # rows of a larger earlier batch may still hold live slots: point them at the sink
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.seq_lens[n:size].fill_(1)
            self.slot_mapping[n:size].fill_(self.sink_slot)
            self.block_tables[n:size, 0].fill_(self.sink_block)
        self.num_replays += 1
        if self.replay:
            self.graphs[size].replay()
            return self.outputs[size][:n]
        return self._forward(size)[:n]

    def _forward(self, size: int) -> torch.Tensor:
        md = AttentionMetadata(
            query_start_loc=self.query_start_loc[: size + 1], seq_lens=self.seq_lens[:size],
            slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables[:size],
            token_req_idx=self.token_req_idx[:size], positions=self.positions[:size],
            max_query_len=1, max_seq_len=self.max_model_len,  # fixed for every replay
        )
        with set_forward_context(ForwardContext(md, self.kv_caches, self.attn_backend)):
            return self.model(self.input_ids[:size], self.positions[:size])

    @torch.inference_mode()
    def _capture_all(self) -> None:
        start = time.perf_counter()
        self._forward(self.sizes[-1])  # warm-up: compiles the Triton kernels, creates cuBLAS handles
        torch.cuda.synchronize()
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):  # largest first: smaller graphs reuse its pool memory
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            self.graphs[size] = graph
        torch.cuda.synchronize()
        logger.info("captured %d CUDA graphs (decode batch sizes %d..%d) in %.1f s", len(self.sizes),
                    self.sizes[0], self.sizes[-1], time.perf_counter() - start)
