"""One layer's attention in a mixed step (chunked prefill beside running decode rows), kernel by kernel.

Usage (device): python3 bench/mixed_attention_bench.py [--prompts 16] [--prompt-len 512] [--decode-ctx 550]
Serving 500 x (512 in / 128 out) runs ~33 steps that prefill 16 prompts of 512 tokens while up to 240 other
rows decode; the prefill kernel (kernels/paged_attention.py) serves all their rows. Times, per layer (Qwen3-0.6B
heads: 16 q, 8 kv, D 128; bf16; random K/V in scattered pages), with CUDA events:
  prefill only       the prompts' rows alone through the prefill kernel
  decode via prefill D decode rows alone through the prefill kernel (its query block chosen for the prompts'
                     length, as in a mixed step, and for 1; before session 23 the grid was also sized by that
                     length: B x 16 programs per kv head, now T // BLOCK_Q + B, kernels/prefill_launch.py)
  decode via decode  the same rows through the split-context decode kernel
  mixed              both in one prefill-kernel launch (what a mixed step runs today), and both cases with the
                     programs numbered flat and by request (REPLAYLLM_PREFILL_GRID; the default picks per launch)
and a sweep of the prefill kernel's tiles on the prompts alone. Prints one line per case (ms).
"""

from __future__ import annotations

import argparse
import os

import torch

from replayllm.entrypoints.bench.workload import cuda_ms
from replayllm.kernels.paged_attention import paged_decode_attention_triton, paged_prefill_attention_triton

HQ, HKV, D, BLOCK = 16, 8, 128, 16


def _batch(q_lens: list[int], seq_lens: list[int], gen: torch.Generator):
    """q [T, HQ, D], kv_cache, query_start_loc, seq_lens, block_tables for rows of these query/sequence lengths,
    each sequence's pages a random draw of the cache's blocks."""
    dev = "cuda"
    blocks_per = [-(-s // BLOCK) for s in seq_lens]
    num_blocks = sum(blocks_per) + 1
    kv = torch.randn(2, num_blocks, BLOCK, HKV, D, generator=gen, device=dev).to(torch.bfloat16)
    perm = torch.randperm(num_blocks, generator=gen, device=dev).to(torch.int32)
    width = max(blocks_per)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32, device=dev)
    at = 0
    for i, n in enumerate(blocks_per):
        tables[i, :n] = perm[at:at + n]
        at += n
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int64, device=dev)
    q = torch.randn(sum(q_lens), HQ, D, generator=gen, device=dev).to(torch.bfloat16)
    return q, kv, qsl, torch.tensor(seq_lens, dtype=torch.int64, device=dev), tables


def _prefill_ms(batch: tuple, max_query_len: int, **tile) -> float:
    q, kv, qsl, sl, bt = batch
    return cuda_ms(lambda: paged_prefill_attention_triton(q, kv, qsl, sl, bt, D ** -0.5, max_query_len, **tile))


def _decode_ms(batch: tuple, max_seq_len: int) -> float:
    q, kv, _, sl, bt = batch
    return cuda_ms(lambda: paged_decode_attention_triton(q, kv, sl, bt, D ** -0.5, max_seq_len))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode-rows", default="64,128,240")
    ap.add_argument("--decode-ctx", type=int, default=550)
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    n, plen, ctx = args.prompts, args.prompt_len, args.decode_ctx
    prompts = _batch([plen] * n, [plen] * n, gen)
    print(f"prefill only ({n} x {plen}): {_prefill_ms(prompts, plen):.4f} ms")
    for rows in (int(r) for r in args.decode_rows.split(",")):
        decode = _batch([1] * rows, [ctx] * rows, gen)
        print(f"decode rows {rows} x ctx {ctx}: via prefill {_prefill_ms(decode, plen):.4f} ms (block_q for {plen}), "
              f"{_prefill_ms(decode, 1):.4f} ms (for 1); via decode {_decode_ms(decode, ctx):.4f} ms")
        mixed = _batch([1] * rows + [plen] * n, [ctx] * rows + [plen] * n, gen)
        by_grid = {}
        for numbering in ("flat", "request"):  # the same bits (kernels/prefill_launch.py prefill_grid)
            os.environ["REPLAYLLM_PREFILL_GRID"] = numbering
            by_grid[numbering] = (_prefill_ms(decode, plen), _prefill_ms(mixed, plen))
        os.environ.pop("REPLAYLLM_PREFILL_GRID")
        print(f"mixed {rows} decode + {n} x {plen}: {_prefill_ms(mixed, plen):.4f} ms in one prefill launch; "
              + "; ".join(f"numbered {k}: decode rows {d:.4f}, mixed {m:.4f} ms" for k, (d, m) in by_grid.items()))
    for block_q in (16, 32, 64):
        for tile in ((64, 4, 3), (32, 4, 3), (128, 8, 3), (64, 8, 3), (64, 4, 2)):
            try:
                ms = _prefill_ms(prompts, plen, block_q=block_q, tile=tile)
            except Exception as e:  # noqa: BLE001 (a tile that does not compile: reported, the sweep goes on)
                print(f"tile block_q {block_q} {tile}: failed {type(e).__name__}")
                continue
            print(f"tile block_q {block_q} (BLOCK_N, warps, stages) {tile}: {ms:.4f} ms")


if __name__ == "__main__":
    main()
