"""The GEMV kernel (kernels/gemv.py) vs cuBLAS at the Qwen3-0.6B linear shapes, and batch-1 decode attention
with the old and the new split rule (kernels/decode_launch.py) (GPU only, ~2 minutes on an H200).

Usage: python bench/gemv_sweep.py [--m 1,2,4] [--tiles 2,1024,2/4,512,4/...] [--reps 200]
Part 1, for each weight shape [N, K] (qkv 4096x1024, o 1024x2048, gate_up 6144x1024, down 1024x3072, the LM head
151936x1024, bf16) and each M: F.linear (cuBLAS), the launcher's own choice ("auto": gemv_tile), and every
--tiles entry (BLOCK_N,BLOCK_K,num_warps); microseconds (median of --reps, each
rep's CUDA events around one call, the host queued ahead behind a sleep kernel, so launch gaps are the GPU's own),
TB/s of the bytes that must move (weight + x + y) and max |y - F.linear| (bf16: an ulp or two of |y| ~ 1-4).
Weights rotate through a pool larger than 2x the 50 MB L2, so every rep streams its weight from HBM.
Then the best configuration per shape and M, and a decode-step estimate (28 x the four layers + the LM head).
Part 2: paged_decode_attention_triton at batch 1 (16 q heads, 8 kv heads, head_dim 128, 16-token blocks) over 128 /
384 / 700 keys, a pool of 28 caches (one per layer), with max_seq_len = the context (eager) and = 40,960 (a
CUDA graph's max_model_len, which fixes the split count), for the old rule (REPLAYLLM_DECODE_SMALL_SPLIT=256)
the new one, and 32-key chunks on 32-key tiles. On a machine without CUDA it exits at once saying so.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
import triton

SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072),
          "lm_head": (151936, 1024)}
LAYERS = 28
POOL_BYTES = 120 * 2**20  # > 2x the H200's 50 MB L2
# Decode split rules at batch 1: (label, REPLAYLLM_DECODE_SMALL_SPLIT, REPLAYLLM_DECODE_TILE); None = unset.
RULES = [("old (256)", "256", None), ("new", None, None), ("32 keys", "32", "32,4,3"), ("32 keys 2w", "32", "32,2,3")]
DEFAULT_TILES = "1,1024,4/2,1024,2/4,1024,4/2,512,4/4,512,2/4,512,4/8,512,4/8,256,2"


def median_us(fn: Callable[[int], object], reps: int) -> float:
    """Median microseconds of fn(i), i = 0..reps-1, each between two CUDA events; a sleep kernel holds the stream
    while the host queues every rep, so the host's launch cost is not timed."""
    for i in range(3):
        fn(i)
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    torch.cuda._sleep(50_000_000)  # ~25 ms: longer than queueing 200 launches
    for i, (start, end) in enumerate(events):
        start.record()
        fn(i)
        end.record()
    torch.cuda.synchronize()
    return 1000 * statistics.median(s.elapsed_time(e) for s, e in events)


def _row(name: str, m: int, config: str, us: float, nbytes: int, diff: float | None) -> dict:
    row = {"shape": name, "M": m, "config": config, "us": us, "TB/s": nbytes / us / 1e6, "diff": diff}
    print(f"{name:8s} M={m:<3d} {config:18s} {us:8.2f} us {row['TB/s']:6.2f} TB/s"
          + ("" if diff is None else f"  max|diff| {diff:.3g}"))
    return row


def gemm_rows(name: str, n: int, k: int, ms: list[int], tiles: list[str], reps: int) -> list[dict]:
    dev, dt = torch.device("cuda"), torch.bfloat16
    pool = [torch.randn(n, k, device=dev, dtype=dt) / k**0.5 for _ in range(max(1, -(-POOL_BYTES // (2 * n * k))))]
    rows = []
    for m in ms:
        x = torch.randn(m, k, device=dev, dtype=dt)
        nbytes = 2 * (n * k + m * k + m * n)
        rows.append(_row(name, m, "cublas", median_us(partial(_cublas, x, pool), reps), nbytes, None))
        ref = F.linear(x, pool[0]).float()
        for spec in ["auto", *tiles]:
            run = partial(_gemv, x, pool, spec)
            try:
                diff = (run(0).float() - ref).abs().max().item()
                us = median_us(run, reps)
            except Exception as e:  # a tile that does not compile (shared memory, registers): reported, not fatal
                print(f"{name:8s} M={m:<3d} {spec:18s} failed: {type(e).__name__}: {str(e)[:120]}")
                continue
            rows.append(_row(name, m, spec, us, nbytes, diff))
    return rows


def _cublas(x: torch.Tensor, pool: list[torch.Tensor], i: int) -> torch.Tensor:
    return F.linear(x, pool[i % len(pool)])


def _gemv(x: torch.Tensor, pool: list[torch.Tensor], spec: str, i: int) -> torch.Tensor:
    """The kernel with the weight of rep i; spec "auto" (the launcher's tile) or BLOCK_N,BLOCK_K,num_warps."""
    from replayllm.kernels import gemv

    tile = None if spec == "auto" else gemv.GemvTile(*(int(v) for v in spec.split(",")))
    return gemv.gemv_triton(x, pool[i % len(pool)], tile=tile)


def summarize(rows: list[dict], ms: list[int]) -> None:
    """Best configuration per (shape, M) against cuBLAS, and a decode step's linear layers (28 x the four layer
    shapes + the LM head) with cuBLAS, the auto choice, what `gemv.linear` dispatches (the GEMV's auto tile where
    `gemv_wanted`, cuBLAS elsewhere) and the per-shape best."""
    from replayllm.kernels.gemv import gemv_wanted

    print("\nbest per shape:")
    step = {m: {"cublas": 0.0, "auto": 0.0, "dispatched": 0.0, "best": 0.0} for m in ms}
    for name in dict.fromkeys(r["shape"] for r in rows):
        count = 1 if name == "lm_head" else LAYERS
        for m in ms:
            here = [r for r in rows if r["shape"] == name and r["M"] == m]
            cublas = next(r for r in here if r["config"] == "cublas")
            triton_rows = [r for r in here if r["config"] != "cublas"]
            if not triton_rows:
                continue
            best = min(triton_rows, key=lambda r: r["us"])
            auto = next((r for r in triton_rows if r["config"] == "auto"), best)
            print(f"{name:8s} M={m:<3d} cublas {cublas['us']:7.2f} us | auto {auto['us']:7.2f} us | best "
                  f"{best['config']:18s} {best['us']:7.2f} us {best['TB/s']:5.2f} TB/s "
                  f"({cublas['us'] / best['us']:.2f}x)")
            dispatched = auto if gemv_wanted(m, *SHAPES[name]) else cublas
            for key, r in (("cublas", cublas), ("auto", auto), ("dispatched", dispatched), ("best", best)):
                step[m][key] += count * r["us"]
    print("\ndecode step, the linear layers measured (28 x each layer shape, 1 x the LM head), ms:")
    for m in ms:
        s = step[m]
        print(f"M={m:<3d} cublas {s['cublas'] / 1000:.3f} | auto {s['auto'] / 1000:.3f} | dispatched "
              f"{s['dispatched'] / 1000:.3f} | best per shape {s['best'] / 1000:.3f}")


def decode_attention(reps: int) -> None:
    from replayllm.kernels import decode_launch as dl
    from replayllm.kernels.device_info import sm_count

    dev, dt, hq, hkv, d, bs = torch.device("cuda"), torch.bfloat16, 16, 8, 128, 16
    print("\ndecode attention, batch 1 (16 q / 8 kv heads, head_dim 128, block 16), a pool of 28 caches:")
    for ctx in (128, 384, 700):
        blocks = -(-ctx // bs)
        caches = [torch.randn(2, blocks + 1, bs, hkv, d, device=dev, dtype=dt) for _ in range(LAYERS)]
        tables = torch.randperm(blocks, device=dev).to(torch.int32)[None]
        seq_lens = torch.tensor([ctx], device=dev)
        q = torch.randn(1, hq, d, device=dev, dtype=dt)
        nbytes = 2 * ctx * hkv * d * 2 + 2 * q.numel() * 2
        outs = {}
        for max_len in (ctx, 40960):
            for rule, env, tile in RULES:
                _set_env(dl._SMALL_SPLIT_ENV, env)
                _set_env(dl._DECODE_TILE_ENV, tile)
                splits = dl.decode_num_splits(1, hkv, max_len, sm_count(dev))
                busy = _busy_splits(ctx, splits, dl.decode_min_split_len(1, hkv, sm_count(dev)),
                                    dl.decode_tile(dt, d, hkv * splits)[0])
                run = partial(_attend, q, caches, seq_lens, tables, max_len)
                outs[rule] = run(0).float()
                us = median_us(run, reps)
                print(f"keys {ctx:4d} max_seq_len {max_len:5d} {rule:10s} splits {splits:2d} ({busy:2d} with keys) "
                      f"{us:7.2f} us "
                      f"{nbytes / us / 1e6:5.2f} TB/s")
            worst = max((out - outs[RULES[0][0]]).abs().max().item() for out in outs.values())
            print(f"   max |rule - old| over the rules = {worst:.3g} (bf16 outputs of ~1: an ulp or two)")
        _set_env(dl._SMALL_SPLIT_ENV, None)
        _set_env(dl._DECODE_TILE_ENV, None)


def _set_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def _busy_splits(ctx: int, splits: int, min_len: int, block_n: int) -> int:
    """Splits that get keys: the kernel's chunk is cdiv(ctx, splits) rounded up to BLOCK_N, at least min_len
    rounded up to BLOCK_N (kernels/paged_attention.py)."""
    chunk = max(triton.cdiv(triton.cdiv(ctx, splits), block_n), triton.cdiv(min_len, block_n)) * block_n
    return triton.cdiv(ctx, chunk)


def _attend(q: torch.Tensor, caches: list[torch.Tensor], seq_lens: torch.Tensor, tables: torch.Tensor,
            max_seq_len: int, i: int) -> torch.Tensor:
    from replayllm.kernels.paged_attention import paged_decode_attention_triton

    return paged_decode_attention_triton(q, caches[i % len(caches)], seq_lens, tables, 0.088, max_seq_len)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", default="1,2,4")
    ap.add_argument("--tiles", default=DEFAULT_TILES, help="'/'-separated BLOCK_N,BLOCK_K,num_warps")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--no-attention", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gemv_sweep.py needs CUDA (a GPU); nothing to measure on this machine")
    ms = [int(v) for v in args.m.split(",")]
    tiles = [t for t in args.tiles.split("/") if t]
    torch.manual_seed(0)
    rows = []
    for name in args.shapes.split(","):
        rows += gemm_rows(name, *SHAPES[name], ms, tiles, args.reps)
    summarize(rows, ms)
    if not args.no_attention:
        decode_attention(args.reps)


if __name__ == "__main__":
    main()
