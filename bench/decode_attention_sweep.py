"""Decode attention kernel alone, with its achieved HBM bandwidth, across shapes and tiles (GPU only).

Usage: python bench/decode_attention_sweep.py [--shapes 256x384,64x1100,1x600] [--tiles 64,4,3/32,1,4] [--grid]
                                              [--kv-cache-dtype fp8] [--heads 71,1,64] [--splits 1,2,4]
                                              [--reduce-rows 1,8]
  --shapes  NUM_SEQSxCONTEXT list: the launcher (its split count) with each tile of --tiles forced through
            REPLAYLLM_DECODE_TILE, plus the launcher's own choice ("auto").
  --grid    also the raw kernel without splits at the first shape over BLOCK_N x num_warps x num_stages.
  --kv-cache-dtype  auto (bf16, the default) | fp8 | fp8_e5m2: the cache's dtype (EngineConfig.kv_cache_dtype).
  --heads   Q_HEADS,KV_HEADS,HEAD_DIM of the attention (default 16,8,128: Qwen3-0.6B; 16,16,256 GPT-J, 8,4,256
            Gemma-2-2B, 71,1,64 Falcon-7B, 16,1,128 StarCoderBase-1B).
  --splits  forced split counts measured after the launcher's own ("auto") with the auto tile.
  --reduce-rows  q heads per reduce program (REPLAYLLM_DECODE_REDUCE_ROWS) measured with each --splits count.
  --layers  N (default 8): time N layers' launches (each over its own cache, as a decode step's) captured in one
            CUDA graph and report ms per layer, as the engine runs them; 1: eager back-to-back launches of one
            layer, whose Python launcher (~0.09 ms a call) floors small shapes (MQA at 256 x 300: ~0.1 ms
            whatever the tile, session 38).
One JSON line per measurement. Shape: --heads's attention (Qwen3-0.6B's by default), bf16 queries,
block_size 16, random block tables. Bytes counted: every K and V element of every context token once (1 byte each
in fp8), + q and out.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch
import triton

from replayllm.config import KV_CACHE_TORCH_DTYPES
from replayllm.entrypoints.bench.workload import cuda_ms
from replayllm.kernels import decode_launch as dl
from replayllm.kernels import paged_attention as pa
from replayllm.kernels.attention_inputs import LOG2E

HQ, HKV, D, BS = 16, 8, 128, 16  # --heads replaces the first three


def _inputs(b: int, ctx: int, kv_dtype: torch.dtype = torch.bfloat16):
    dev, dt = torch.device("cuda"), torch.bfloat16
    blocks_per_seq = triton.cdiv(ctx, BS)
    num_blocks = b * blocks_per_seq + 1
    kv = torch.randn(2, num_blocks, BS, HKV, D, device=dev, dtype=dt).to(kv_dtype)
    tables = torch.randperm(num_blocks - 1, device=dev)[: b * blocks_per_seq].view(b, -1).to(torch.int32)
    seq_lens = torch.full((b,), ctx, dtype=torch.int64, device=dev)
    q = torch.randn(b, HQ, D, device=dev, dtype=dt)
    nbytes = 2 * b * ctx * HKV * D * kv.element_size() + 2 * q.numel() * 2
    return q, kv, tables, seq_lens, nbytes


def graph_ms(launches, reps: int = 20) -> float:
    """Milliseconds per launch of `launches` (one per layer) captured in one CUDA graph, replayed `reps` times."""
    for launch in launches:  # compile, and the warm-up a capture needs, on a side stream
        launch()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for launch in launches:
            launch()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for launch in launches:
            launch()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps / len(launches)


def _report(launch, nbytes: int, **config) -> None:
    """launch: one callable (eager timing) or a list of one per layer (CUDA-graph timing, ms per layer)."""
    try:
        ms = graph_ms(launch) if isinstance(launch, list) else cuda_ms(launch)
    except Exception as e:  # a config that does not compile (shared memory, registers) is reported, not fatal
        print(json.dumps({"bench": "decode_attention", **config, "error": type(e).__name__}))
        return
    print(json.dumps({"bench": "decode_attention", **config, "ms": round(ms, 4),
                      "GB_per_s": round(nbytes / ms / 1e6, 1)}))


def _launches(layers, seq_lens, tables, ctx: int, *rest):
    """The launcher over each layer's (q, kv) with the shared tables and lengths: a list of calls (one per layer;
    CUDA-graph timing), or the one call of a single layer (eager timing). rest: the launcher's num_splits."""
    calls = [lambda a=(q, kv, seq_lens, tables, 0.088, ctx, *rest): pa.paged_decode_attention_triton(*a)
             for q, kv in layers]
    return calls if len(calls) > 1 else calls[0]


def main() -> None:
    global HQ, HKV, D
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="256x384,256x512,64x1100,64x2100,16x1000,1x600")
    ap.add_argument("--tiles", default="64,4,3/32,1,4/32,2,3/32,1,2")
    ap.add_argument("--grid", action="store_true")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"])
    ap.add_argument("--heads", default=f"{HQ},{HKV},{D}")
    ap.add_argument("--splits", default="")
    ap.add_argument("--reduce-rows", default="1")
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()
    HQ, HKV, D = (int(x) for x in args.heads.split(","))
    kv_dtype = KV_CACHE_TORCH_DTYPES.get(args.kv_cache_dtype, torch.bfloat16)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    for b, ctx in shapes:
        q, kv, tables, seq_lens, nbytes = _inputs(b, ctx, kv_dtype)
        # the other layers' caches (same tables and lengths): what a step's launches read one after another
        layers = [(q, kv)] + [_inputs(b, ctx, kv_dtype)[:2] for _ in range(args.layers - 1)]

        ref = pa.paged_decode_attention_triton(q, kv, seq_lens, tables, 0.088, ctx).float()
        for tile in ["auto", *args.tiles.split("/")]:
            if tile == "auto":
                os.environ.pop(dl._DECODE_TILE_ENV, None)
            else:
                os.environ[dl._DECODE_TILE_ENV] = tile
            out = pa.paged_decode_attention_triton(q, kv, seq_lens, tables, 0.088, ctx).float()
            if (out - ref).abs().max() > 0.05:  # bf16 outputs of two tile orders: a few ulps apart at most
                raise AssertionError(f"tile {tile} at {b}x{ctx} differs from the auto tile")
            _report(_launches(layers, seq_lens, tables, ctx), nbytes, num_seqs=b, context=ctx, tile=tile,
                    layers=args.layers, kv_cache_dtype=str(kv_dtype).removeprefix("torch."), heads=args.heads)
        os.environ.pop(dl._DECODE_TILE_ENV, None)
        for splits, rows in itertools.product([int(x) for x in args.splits.split(",") if x],
                                              args.reduce_rows.split(",")):
            os.environ[dl._REDUCE_ROWS_ENV] = rows
            args_ = (q, kv, seq_lens, tables, 0.088, ctx, splits)
            out = pa.paged_decode_attention_triton(*args_).float()
            if (out - ref).abs().max() > 0.05:
                raise AssertionError(f"{splits} splits, {rows} reduce rows at {b}x{ctx} differ from auto")
            _report(_launches(layers, seq_lens, tables, ctx, splits), nbytes, num_seqs=b, context=ctx,
                    splits=splits, reduce_rows=int(rows), layers=args.layers, heads=args.heads)
        os.environ.pop(dl._REDUCE_ROWS_ENV, None)
    if not args.grid:
        return
    b, ctx = shapes[0]
    q, kv, tables, seq_lens, nbytes = _inputs(b, ctx, kv_dtype)
    out = torch.empty_like(q)
    for block_n, warps, stages in itertools.product((16, 32, 64, 128), (1, 2, 4, 8), (1, 2, 3, 4)):
        def launch(block_n=block_n, warps=warps, stages=stages):
            pa._paged_decode_kernel[(b, HKV, 1)](
                out, out, out, q, kv, tables, seq_lens, seq_lens, 0.088 * LOG2E, 0, 0.0, q, q,  # no sinks, no ALiBi
                triton.cdiv(ctx, block_n) * block_n,
                q.stride(0), q.stride(1), out.stride(0), out.stride(1),
                kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3), tables.stride(0),
                SPLIT=False, FUSED_REDUCE=False, SPLITS_PAD=1, GROUP=HQ // HKV,
                GROUP_PAD=max(16, triton.next_power_of_2(HQ // HKV)), BLOCK_N=block_n,
                BLOCK_SIZE=BS, HEAD_DIM=D, HEAD_DIM_PAD=triton.next_power_of_2(D), UPCAST=False, PDL=False,
                num_warps=warps, num_stages=stages)
        _report(launch, nbytes, num_seqs=b, context=ctx, block_n=block_n, num_warps=warps, num_stages=stages)


if __name__ == "__main__":
    main()
