"""Decode attention kernel alone at the throughput bench's shape, with its achieved HBM bandwidth, across tile
sizes and warp counts (GPU only). One JSON line per config; the launcher's choice is marked "default".

Usage: python bench/decode_attention_sweep.py [--num-seqs 256 --context 384]
Shape: Qwen3-0.6B attention (16 q heads, 8 kv heads, head_dim 128), bf16, block_size 16, random block tables.
Bytes counted: every K and V element of every context token once, plus q and out."""

from __future__ import annotations

import argparse
import json

import torch
import triton

from replayllm.entrypoints.bench.workload import cuda_ms
from replayllm.kernels import paged_attention as pa


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--context", type=int, default=384)
    args = ap.parse_args()
    b, ctx, hq, hkv, d, bs = args.num_seqs, args.context, 16, 8, 128, 16
    dev, dt = torch.device("cuda"), torch.bfloat16
    blocks_per_seq = triton.cdiv(ctx, bs)
    num_blocks = b * blocks_per_seq + 1
    kv = torch.randn(2, num_blocks, bs, hkv, d, device=dev, dtype=dt)
    tables = torch.randperm(num_blocks - 1, device=dev)[: b * blocks_per_seq].view(b, -1).to(torch.int32)
    seq_lens = torch.full((b,), ctx, dtype=torch.int64, device=dev)
    q = torch.randn(b, hq, d, device=dev, dtype=dt)
    out = torch.empty_like(q)
    nbytes = 2 * b * ctx * hkv * d * 2 + 2 * q.numel() * 2

    ms = cuda_ms(lambda: pa.paged_decode_attention(q, kv, seq_lens, tables, 0.088, ctx))
    print(json.dumps({"bench": "decode_attention", "config": "default", "num_seqs": b, "context": ctx,
                      "ms": round(ms, 4), "GB_per_s": round(nbytes / ms / 1e6, 1)}))
    for splits in (1, 2, 4, 8, 16):  # the launcher's tiles, context split into this many chunks (+ reduce)
        ms = cuda_ms(lambda splits=splits: pa.paged_decode_attention(q, kv, seq_lens, tables, 0.088, ctx, splits))
        print(json.dumps({"bench": "decode_attention", "num_splits": splits, "num_seqs": b, "context": ctx,
                          "ms": round(ms, 4), "GB_per_s": round(nbytes / ms / 1e6, 1)}))
    for block_n in (32, 64, 128):
        for warps in (2, 4, 8):
            def launch(block_n=block_n, warps=warps):
                pa._paged_decode_kernel[(b, hkv, 1)](
                    out, out, out, q, kv, tables, seq_lens, 0.088 * pa._LOG2E, triton.cdiv(ctx, block_n) * block_n,
                    q.stride(0), q.stride(1), out.stride(0), out.stride(1),
                    kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3), tables.stride(0),
                    SPLIT=False, GROUP=hq // hkv, GROUP_PAD=16, BLOCK_N=block_n, BLOCK_SIZE=bs, HEAD_DIM=d,
                    HEAD_DIM_PAD=d, UPCAST=False, num_warps=warps)
            try:
                ms = cuda_ms(launch)
            except Exception as e:  # a config that does not compile (shared memory) is reported, not fatal
                print(json.dumps({"bench": "decode_attention", "block_n": block_n, "num_warps": warps,
                                  "error": type(e).__name__}))
                continue
            print(json.dumps({"bench": "decode_attention", "block_n": block_n, "num_warps": warps,
                              "ms": round(ms, 4), "GB_per_s": round(nbytes / ms / 1e6, 1)}))


if __name__ == "__main__":
    main()
