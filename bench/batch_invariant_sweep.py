"""Batch-invariant kernels (kernels/batch_invariant_matmul.py, kernels/batch_invariant_attention.py) against the
default path, per tile, at the Qwen3-0.6B shapes of W1 (GPU only, ~1-2 minutes on an H200).

Usage: python bench/batch_invariant_sweep.py [--m 1,64,256,8192] [--tiles BM,BN,BK,W,S/...] [--attn-tiles N,W,S/...]
Part 1, for each weight shape [N, K] (qkv 4096x1024, o 1024x2048, gate_up 6144x1024, down 1024x3072, the LM head
151936x1024, bf16) and each M: F.linear (cuBLAS) and `_matmul_kernel` with every --tiles entry (BLOCK_M, BLOCK_N,
BLOCK_K, num_warps, num_stages); microseconds (median of --reps, CUDA events around each call, the host queued
ahead), whether row 0 of the M-row call equals the engine's 1-row call bit for bit (the invariance a tile must
keep to be chosen at that M), and whether the whole output equals the engine's tile's at that M. Then per shape
and M the engine's tile beside the fastest such tile, and the step's linear layers (28 x four layers + the LM
head) with cuBLAS, the engine's tiles and the best per shape.
Part 2, attention: `paged_prefill_attention_triton` with the invariant query block (8 tokens for the 0.6B's
group of 2) and each --attn-tiles entry (BLOCK_N, num_warps, num_stages), on a decode step (256 seqs x 384 keys)
and a prefill step (16 requests x 256 new tokens) of W1, then a long decode (32 x 8192 keys) and a long prefill
(2 x 4096 new tokens), beside the default decode kernel; GB/s of the K/V bytes read.
Numbers in docs/benchmarks.md; the chosen tiles in the kernels' modules.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial

import torch
import torch.nn.functional as F
import triton

# The same shapes, layer count, weight pool and CUDA-event medians as the GEMV sweep
from gemv_sweep import LAYERS, POOL_BYTES, SHAPES, median_us

DEFAULT_TILES = ("64,64,64,4,3/64,128,64,4,3/128,64,64,4,3/128,128,64,8,3/128,128,64,4,4/64,256,64,8,3/"
                 "128,256,64,8,3/64,128,128,4,3/128,128,128,8,3/64,64,128,4,4/64,32,128,4,4/128,64,128,8,3/"
                 "64,128,64,4,5/128,128,64,8,4")
DEFAULT_ATTN_TILES = "64,4,3/32,1,4/32,2,4/32,4,3/64,2,3/64,4,4/64,8,3/128,4,3/128,8,3/16,1,4/32,1,3/32,1,5"
HQ, HKV, D, BS = 16, 8, 128, 16
# (label, sequences, keys each, new query tokens each): W1's decode and prefill steps, then long contexts
ATTN_CASES = (("decode 256 x 384 keys", 256, 384, 1), ("prefill 16 x 256", 16, 256, 256),
              ("decode 32 x 8192 keys", 32, 8192, 1), ("prefill 2 x 4096", 2, 4096, 4096))


def gemm_rows(name: str, n: int, k: int, ms: list[int], tiles: list[str], reps: int) -> list[dict]:
    from replayllm.kernels.batch_invariant_matmul import batch_invariant_linear_triton

    dev, dt = torch.device("cuda"), torch.bfloat16
    pool = [torch.randn(n, k, device=dev, dtype=dt) / k**0.5 for _ in range(max(1, -(-POOL_BYTES // (2 * n * k))))]
    rows = []
    for m in ms:
        current = _current(n, m)
        x = torch.randn(m, k, device=dev, dtype=dt)
        flops = 2 * m * n * k
        us = median_us(partial(_cublas, x, pool), reps)
        rows.append({"shape": name, "M": m, "config": "cublas", "us": us})
        print(f"{name:8s} M={m:<5d} {'cublas':18s} {us:9.2f} us {flops / us / 1e6:6.1f} TFLOP/s")
        ref = None  # the current tile's output at this M: does another tile give the same bits?
        for spec in dict.fromkeys([current, *tiles]):
            tile = tuple(int(v) for v in spec.split(","))
            run = partial(_invariant_linear, x, pool, tile)
            try:
                full = run(0)
                ref = full if ref is None else ref
                same = torch.equal(full[:1], batch_invariant_linear_triton(x[:1], pool[0]))  # the engine's tile
                as_current = torch.equal(full, ref)
                us = median_us(run, reps)
            except Exception as e:  # a tile that does not compile (shared memory, registers): reported, not fatal
                print(f"{name:8s} M={m:<5d} {spec:18s} failed: {type(e).__name__}: {str(e)[:100]}")
                continue
            rows.append({"shape": name, "M": m, "config": spec, "us": us, "invariant": same,
                         "bits_as_current": as_current})
            print(f"{name:8s} M={m:<5d} {spec:18s} {us:9.2f} us {flops / us / 1e6:6.1f} TFLOP/s"
                  f" row0 == engine's 1-row call: {same!s:5s} == current tile: {as_current}"
                  + ("  <- current" if spec == current else ""))
    return rows


def _cublas(x: torch.Tensor, pool: list[torch.Tensor], i: int) -> torch.Tensor:
    return F.linear(x, pool[i % len(pool)])


def _invariant_linear(x: torch.Tensor, pool: list[torch.Tensor], tile: tuple, i: int) -> torch.Tensor:
    from replayllm.kernels.batch_invariant_matmul import batch_invariant_linear_triton

    return batch_invariant_linear_triton(x, pool[i % len(pool)], tile=tile)


def _current(n: int, m: int) -> str:
    from replayllm.kernels.batch_invariant_matmul import invariant_tile
    from replayllm.kernels.dispatch import max_shared_memory

    tile = invariant_tile(n, torch.bfloat16, max_shared_memory(torch.device("cuda")) or 0, m)
    return ",".join(str(v) for v in tile)


def _us_of(rows: list[dict], m: int, config: str) -> float:
    return next((r["us"] for r in rows if r["M"] == m and r["config"] == config), float("nan"))


def summarize(rows: list[dict], ms: list[int]) -> None:
    print("\nper shape and M: cuBLAS, the engine's tile (invariant_tile) and the fastest tile whose rows equal the "
          "engine's 1-row call:")
    step = {m: {"cublas": 0.0, "current": 0.0, "best": 0.0} for m in ms}
    for name in dict.fromkeys(r["shape"] for r in rows):
        here = [r for r in rows if r["shape"] == name]
        count = 1 if name == "lm_head" else LAYERS
        for m in ms:
            ok = [r for r in here if r["M"] == m and r["config"] != "cublas" and r.get("invariant")]
            if not ok:
                continue
            best = min(ok, key=lambda r: r["us"])["config"]
            current = _current(SHAPES[name][0], m)
            us = partial(_us_of, here, m)
            print(f"{name:8s} M={m:<5d} cublas {us('cublas'):9.2f} | current {current:16s} {us(current):9.2f} | "
                  f"best {best:16s} {us(best):9.2f} us ({us('cublas') / us(best):.2f}x of cuBLAS)")
            step[m]["cublas"] += count * us("cublas")
            step[m]["current"] += count * us(current)
            step[m]["best"] += count * us(best)
    print("\nthe linear layers of one step (28 x each layer shape + 1 x the LM head), ms:")
    for m in ms:
        s = step[m]
        print(f"M={m:<5d} cublas {s['cublas'] / 1000:.3f} | current {s['current'] / 1000:.3f} | best per shape "
              f"{s['best'] / 1000:.3f}")


def _kv(num_seqs: int, ctx: int):
    dev, dt = torch.device("cuda"), torch.bfloat16
    per_seq = triton.cdiv(ctx, BS)
    kv = torch.randn(2, num_seqs * per_seq + 1, BS, HKV, D, device=dev, dtype=dt)
    tables = torch.randperm(num_seqs * per_seq, device=dev).view(num_seqs, per_seq).to(torch.int32)
    seq_lens = torch.full((num_seqs,), ctx, dtype=torch.int64, device=dev)
    return kv, tables, seq_lens


def _decode(q, kv, seq_lens, tables, ctx: int, i: int) -> torch.Tensor:
    from replayllm.kernels.paged_attention import paged_decode_attention_triton

    return paged_decode_attention_triton(q, kv, seq_lens, tables, 0.088, ctx)


def _invariant_attention(q, kv, qsl, seq_lens, tables, q_len: int, block_q: int, tile: tuple, i: int):
    from replayllm.kernels.paged_attention import paged_prefill_attention_triton

    return paged_prefill_attention_triton(q, kv, qsl, seq_lens, tables, 0.088, q_len, block_q=block_q, tile=tile)


def attention(tiles: list[str], reps: int) -> None:
    from replayllm.kernels.batch_invariant_attention import invariant_block_q

    dev, dt = torch.device("cuda"), torch.bfloat16
    block_q = invariant_block_q(HQ, HKV)
    for label, num_seqs, ctx, q_len in ATTN_CASES:
        kv, tables, seq_lens = _kv(num_seqs, ctx)
        q = torch.randn(num_seqs * q_len, HQ, D, device=dev, dtype=dt)
        qsl = torch.arange(0, num_seqs + 1, device=dev, dtype=torch.int64) * q_len
        nbytes = 2 * num_seqs * ctx * HKV * D * 2
        print(f"\nattention, {label} (16 q / 8 kv heads, head_dim 128, block 16, bf16), invariant block_q {block_q}:")
        ref = None
        if q_len == 1:
            us = median_us(partial(_decode, q, kv, seq_lens, tables, ctx), reps)
            print(f"  default decode kernel       {us:8.2f} us {nbytes / us / 1e3:7.1f} GB/s")
        for spec in tiles:
            tile = tuple(int(v) for v in spec.split(","))
            run = partial(_invariant_attention, q, kv, qsl, seq_lens, tables, q_len, block_q, tile)
            try:
                out = run(0).float()
                us = median_us(run, reps)
            except Exception as e:
                print(f"  invariant {spec:12s} failed: {type(e).__name__}: {str(e)[:100]}")
                continue
            ref = out if ref is None else ref
            print(f"  invariant {spec:12s}      {us:8.2f} us {nbytes / us / 1e3:7.1f} GB/s  "
                  f"max|diff| vs first {(out - ref).abs().max().item():.3g}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", default="1,64,256,8192")
    ap.add_argument("--tiles", default=DEFAULT_TILES, help="'/'-separated BLOCK_M,BLOCK_N,BLOCK_K,warps,stages")
    ap.add_argument("--attn-tiles", default=DEFAULT_ATTN_TILES, help="'/'-separated BLOCK_N,warps,stages")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--no-attention", action="store_true")
    ap.add_argument("--no-gemm", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("batch_invariant_sweep.py needs CUDA (a GPU); nothing to measure on this machine")
    ms = [int(v) for v in args.m.split(",")]
    torch.manual_seed(0)
    if not args.no_gemm:
        rows = []
        for name in args.shapes.split(","):
            rows += gemm_rows(name, *SHAPES[name], ms, [t for t in args.tiles.split("/") if t], args.reps)
        summarize(rows, ms)
    if not args.no_attention:
        attention([t for t in args.attn_tiles.split("/") if t], args.reps)


if __name__ == "__main__":
    main()
