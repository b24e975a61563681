"""Piecewise CUDA graphs: every step the whole-forward graphs cannot serve, as graphs between attention calls.

Which steps: prefill, chunked prefill, mixed prefill + decode batches, fast-replay lookahead chunks, verify steps
where rows drafted unevenly, decode batches larger than the largest full graph — any step of at most
`max_piecewise_capture_size` tokens (cudagraph_mode FULL_AND_PIECEWISE or PIECEWISE).

Why: an eager forward launches ~300 kernels from Python (10 a layer), ~20 ms of host time a step on the H200's
host whatever the step's size, so every eager step under ~8k tokens was host-bound (a 128-token prefill: ~25 ms
for ~1 ms of GPU work). Attention cannot join a graph keyed on the token count alone: its grid and tiles follow
the rows' query and context lengths (host ints). Everything else (norms, rope, the GEMMs, SiLU, the KV write
through slot_mapping) is row-wise and depends on the token count only.

How: the model's forward runs unchanged under a ForwardContext whose `split` is this runner. At capture, each
Attention layer writes its K/V (inside the current graph), copies its query into the static `query` buffer and
hands over: the graph ends there and the next one begins; the next graph reads the attention output from the
static `attn_out` buffer. A replay stages the step's inputs, then for each layer replays graph i and runs that
layer's attention on query[:n] (n real tokens, the step's own metadata) into attn_out[:n]; the last graph leaves
the final hidden states in the static `hidden` buffer. So a step costs L + 1 graph launches and L attention
launches instead of ~10 L kernel launches.

Padding: tokens [n, size) are id 0 at position 0 and write their K/V into the sink block (never a request's);
no attention row reads them, and their rows of every buffer are garbage that no real row reads (all ops in the
graphs are row-wise).

Memory: one private pool for every graph, captured largest first. A step replays one size only and a tensor
freed during capture is dead at the same point of a replay, so graphs may reuse each other's temporaries (the
lifetimes of an eager forward); plus the static buffers at the largest size (model_runner_v2/kv_cache.py
reserves both).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from bisect import bisect_left

import torch
from torch import nn

from ..config import EngineConfig
from ..kernels.compile_ahead import compile_ahead
from .attention import Attention
from .cuda_graph import capture_stream
from .forward_context import AttentionMetadata, ForwardContext, set_forward_context
from .input_batch import InputBatch

logger = logging.getLogger(__name__)


def piecewise_sizes(max_tokens: int) -> list[int]:
    """Padded token counts that get graphs: 8 .. 256 doubling, then steps of 128 to 1024, 256 to 2048, 512 to
    4096, 1024 above, and max_tokens. Padding stays within a quarter above 512 tokens, where the GPU work
    grows with the step; below, the launch cost the graphs save dominates."""
    sizes = [s for s in (8, 16, 32, 64, 128, 256) if s < max_tokens]
    for start, stop, step in ((384, 1024, 128), (1280, 2048, 256), (2560, 4096, 512), (5120, 1 << 30, 1024)):
        sizes += [s for s in range(start, min(stop, max_tokens - 1) + 1, step)]
    return sizes + [max_tokens]


class PiecewiseGraphRunner:
    """Per-layer graphs for steps of up to `sizes[-1]` tokens. `replay=False` runs the same static-buffer path
    eagerly (no capture; attention attends at its hand-over): the CPU tests use it to check staging, padding
    and the hand-over without a GPU."""

    def __init__(self, model: nn.Module, kv_caches: list[torch.Tensor], config: EngineConfig, sink_block: int,
                 replay: bool = True, routed_experts: torch.Tensor | None = None):
        self.model = model
        self.kv_caches = kv_caches
        self.backend = config.attention_backend
        self.routed_experts = routed_experts  # MoE routes per KV slot (written inside the graphs) or None
        self.sizes = piecewise_sizes(config.max_piecewise_capture_size)
        attn = next(m for m in model.modules() if isinstance(m, Attention))
        self.num_heads, self.head_dim = attn.num_heads, attn.head_dim
        n, device = self.sizes[-1], config.torch_device
        i64 = dict(dtype=torch.int64, device=device)
        self.sink_slot = sink_block * config.block_size
        self.input_ids = torch.zeros(n, **i64)
        self.positions = torch.zeros(n, **i64)
        self.slot_mapping = torch.full((n,), self.sink_slot, **i64)
        width = self.num_heads * self.head_dim
        self.query = torch.zeros(n, width, dtype=config.model_config.dtype, device=device)  # [N, Hq*D]
        self.attn_out = torch.zeros_like(self.query)  # [N, Hq*D]
        self.hidden: torch.Tensor | None = None  # [N, H], the final norm's dtype: allocated by the first forward
        # One row per token in the sink block: the metadata of capture and warm-up forwards (`_pad_metadata`).
        self._pad_qsl = torch.arange(n + 1, **i64)
        self._pad_seq_lens = torch.ones(n, **i64)
        self._pad_tables = torch.full((n, 1), sink_block, dtype=torch.int32, device=device)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}  # size -> L + 1 graphs, in forward order
        self.layers: list[Attention] = []  # the attention layers in the order the forward calls them
        self.num_replays = 0  # steps served (tests and logs)
        self._capture: list[torch.cuda.CUDAGraph] | None = None  # graphs of the size being captured
        self._layers_seen: list[Attention] = []  # the layers handed over during that capture
        self._pool = None
        self._num_real = 0  # the static path run eagerly: tokens whose attention is computed
        self.replay = replay
        if replay:
            self._capture_all()

    def padded_size(self, batch: InputBatch) -> int | None:
        """The graph size (tokens) serving this step, or None when it has more tokens than the largest."""
        n = batch.input_ids.shape[0]
        if n > self.sizes[-1] or (self.replay and not self.graphs):
            return None
        return self.sizes[bisect_left(self.sizes, n)]

    # -- a step ----------------------------------------------------------------------------------------
    def run(self, batch: InputBatch, size: int) -> torch.Tensor:
        """hidden [n, H] for the step's n tokens (a view of the static buffer: consume it before the next step)."""
        n = batch.input_ids.shape[0]
        self._stage(batch, size)
        self.num_replays += 1
        md = batch.attn
        if not self.replay:
            md = dataclasses.replace(md, slot_mapping=self.slot_mapping[:size])
            return self._forward(size, md, n)[:n]
        query = self.query[:n].view(n, self.num_heads, self.head_dim)
        graphs = self.graphs[size]
        for graph, layer in zip(graphs, self.layers):
            graph.replay()
            out = layer.compute(query, self.kv_caches[layer.layer_idx], md, self.backend)  # [n, Hq, D]
            self.attn_out[:n].copy_(out.view(n, -1))
        graphs[-1].replay()
        return self.hidden[:n]

    def _stage(self, batch: InputBatch, size: int) -> None:
        """Copy the step's token inputs into the static buffers; tokens [n, size) become padding (they may hold
        an earlier step's live slots)."""
        n = batch.input_ids.shape[0]
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slot_mapping[:n].copy_(batch.attn.slot_mapping)
        if n < size:
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slot_mapping[n:size].fill_(self.sink_slot)

    def _pad_metadata(self, size: int) -> AttentionMetadata:
        """`size` one-token rows at position 0 of the sink block: capture (only the KV write's slot_mapping is
        read) and warm-up (a real decode attention over the sink)."""
        return AttentionMetadata(
            query_start_loc=self._pad_qsl[: size + 1], seq_lens=self._pad_seq_lens[:size],
            slot_mapping=self.slot_mapping[:size], block_tables=self._pad_tables[:size],
            token_req_idx=self._pad_qsl[:size], positions=self.positions[:size], max_query_len=1, max_seq_len=1)

    def _forward(self, size: int, md: AttentionMetadata, num_real: int) -> torch.Tensor:
        """The model over the static buffers' first `size` tokens, attention handed over to `attention`; the
        final hidden states land in `hidden`. Captured, or run eagerly (warm-up, replay=False)."""
        self._num_real = num_real
        with set_forward_context(ForwardContext(md, self.kv_caches, self.backend, split=self,
                                                routed_experts=self.routed_experts)):
            out = self.model(self.input_ids[:size], self.positions[:size])  # [size, H]
        if self.hidden is None:
            self.hidden = torch.empty((self.sizes[-1], out.shape[1]), dtype=out.dtype, device=out.device)
        self.hidden[:size].copy_(out)
        return self.hidden[:size]

    def attention(self, layer: Attention, q: torch.Tensor, kv_cache: torch.Tensor,
                  md: AttentionMetadata) -> torch.Tensor:
        """Attention's hand-over (ForwardContext.split): q [size, Hq, D] -> the attention output [size, Hq*D]
        (a view of `attn_out`). At capture the current graph ends here and the next begins."""
        size = q.shape[0]
        self.query[:size].copy_(q.reshape(size, -1))
        if self._capture is not None:
            self._next_graph(layer)
        else:
            n = self._num_real
            out = layer.compute(self.query[:n].view(n, self.num_heads, self.head_dim), kv_cache, md, self.backend)
            self.attn_out[:n].copy_(out.reshape(n, -1))
        return self.attn_out[:size]

    def release(self) -> None:
        """Free the graphs (their pool's memory returns to the allocator) and the static buffers."""
        for graphs in self.graphs.values():
            for graph in graphs:
                graph.reset()
        self.graphs.clear()
        self.layers = []
        self._pool = None
        self.input_ids = self.positions = self.slot_mapping = self.query = self.attn_out = self.hidden = None

    # -- capture -----------------------------------------------------------------------------------------
    def _next_graph(self, layer: Attention | None) -> None:
        """End the graph being captured (after `layer`'s query copy) and begin the next one."""
        self._capture[-1].capture_end()
        if layer is not None:
            self._layers_seen.append(layer)
        graph = torch.cuda.CUDAGraph()
        self._capture.append(graph)
        graph.capture_begin(pool=self._pool)

    def _capture_size(self, size: int) -> None:
        self._layers_seen = []
        first = torch.cuda.CUDAGraph()
        self._capture = [first]
        try:
            first.capture_begin(pool=self._pool)
            self._forward(size, self._pad_metadata(size), size)
            self._capture[-1].capture_end()
        except BaseException:
            if torch.cuda.is_current_stream_capturing():
                try:
                    self._capture[-1].capture_end()
                except RuntimeError:
                    pass
            raise
        finally:
            graphs, self._capture = self._capture, None
        if self.layers and self._layers_seen != self.layers:
            raise RuntimeError("the forward called its attention layers in another order at another size")
        self.layers = self._layers_seen
        self.graphs[size] = graphs

    @torch.inference_mode()
    def _capture_all(self) -> None:
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info()[0]
        self._pool = torch.cuda.graph_pool_handle()
        stream = capture_stream(torch.cuda.current_device())
        stream.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(stream):
                with compile_ahead(self.slot_mapping.device, "piecewise graphs"):  # every size's, in parallel
                    for size in self.sizes:
                        self._forward(size, self._pad_metadata(size), size)
                for size in reversed(self.sizes):  # most tokens first: smaller graphs reuse the pool's memory
                    # Eagerly first, on the capture stream: every Triton specialisation and cuBLAS algorithm and
                    # workspace this size uses exists before its capture (none may be made inside one).
                    self._forward(size, self._pad_metadata(size), size)
                    stream.synchronize()
                    self._capture_size(size)
        except Exception as e:  # an op that cannot be captured: these steps stay eager, said loudly
            self.graphs.clear()
            logger.warning("piecewise CUDA graphs disabled, steps other than uniform decode run eagerly: capture "
                           "failed with %s: %s", type(e).__name__, e)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        used_mib = (free_before - torch.cuda.mem_get_info()[0]) / 2**20
        if self.graphs:
            logger.info("captured piecewise CUDA graphs for %d token counts (%d..%d), %d graphs each, in %.1f s, "
                        "%.0f MiB", len(self.sizes), self.sizes[0], self.sizes[-1], len(self.layers) + 1,
                        time.perf_counter() - start, used_mib)
