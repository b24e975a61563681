"""Fused MoE experts (kernels/fused_moe.py) vs the plain-torch expert loop, one Qwen3-30B-A3B sparse layer (GPU only).

Usage: python bench/fused_moe_bench.py [--tokens 1,16,256,4096] [--tile 64,64,64,4,3 ...] [--reps 20]
Shape: E=128 experts, top-8, hidden 2048, expert width 768, bf16 (override with --experts/--topk/--hidden/--inter/
--dtype). Routing: random router logits, fp32 softmax, top-k, renormalised (Qwen3-MoE's norm_topk_prob).
For each T: the torch loop (`fused_experts_torch`, moe.py's loop: one host sync per call), `fused_experts_triton`
eager, and `fused_experts_triton` replayed from a CUDA graph (what a graph-captured decode step would pay), each
with the tile(s) asked for (default: the launcher's). Bandwidth: bytes of the weights the active experts read (each
active expert's w13 and w2 once: 3*H*I*itemsize), the roofline of a memory-bound step, against --peak-gbps (the H200's
measured device copy, 4,254 GB/s, ../shared/ENVIRONMENT.md). One JSON line per measurement, then a table.
On a machine without CUDA it exits at once saying so.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial

import torch

from replayllm.entrypoints.bench.workload import cuda_ms


def _graph(fn):
    """fn captured in a CUDA graph (after a warm-up on a side stream): returns replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1,16,256,4096")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--tile", action="append", default=[],
                    help="BLOCK_M,BLOCK_N,BLOCK_K,num_warps,num_stages (repeatable); default: the launcher's")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--peak-gbps", type=float, default=4254.0)
    ap.add_argument("--no-torch", action="store_true", help="skip the torch loop")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("fused_moe_bench.py needs CUDA (a GPU); nothing to measure on this machine")

    from replayllm.kernels.fused_moe import MoeTile, default_tile, fused_experts_torch, fused_experts_triton

    dev, dtype = torch.device("cuda"), getattr(torch, args.dtype)
    num_experts, k, hidden, inter = args.experts, args.topk, args.hidden, args.inter
    tiles = [MoeTile(*map(int, t.split(","))) for t in args.tile] or [default_tile(dtype, dev)]
    g = torch.Generator(device=dev).manual_seed(0)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=g, device=dev) / hidden**0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=g, device=dev) / inter**0.5).to(dtype)
    expert_bytes = 3 * hidden * inter * w13.element_size()
    print(f"# E={num_experts} k={k} H={hidden} I={inter} {args.dtype}; {expert_bytes / 1e6:.2f} MB per expert, "
          f"{torch.cuda.get_device_name()}", flush=True)
    rows = []
    for num_tokens in [int(t) for t in args.tokens.split(",")]:
        x = torch.randn(num_tokens, hidden, generator=g, device=dev).to(dtype)
        logits = torch.randn(num_tokens, num_experts, generator=g, device=dev)
        weights, ids = torch.softmax(logits, -1, dtype=torch.float32).topk(k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        active = int(ids.unique().numel())
        nbytes = active * expert_bytes + 2 * x.numel() * x.element_size()  # weights once, x in, out
        roofline_ms = nbytes / (args.peak_gbps * 1e9) * 1e3
        ref = fused_experts_torch(x, w13, w2, ids, weights)
        cases = []
        if not args.no_torch:
            cases.append(("torch loop", None, partial(fused_experts_torch, x, w13, w2, ids, weights)))
        for tile in tiles:
            fn = partial(fused_experts_triton, x, w13, w2, ids, weights, tile=tile)
            diff = (fn().float() - ref.float()).abs().max().item()
            cases.append((f"fused {tuple(tile)}", diff, fn))
            cases.append((f"fused {tuple(tile)} graph", diff, _graph(fn)))
        for name, diff, fn in cases:
            fn()  # one more warm-up call than cuda_ms makes: the first compiles
            ms = cuda_ms(fn, args.reps)
            row = dict(tokens=num_tokens, impl=name, ms=round(ms, 4), active_experts=active,
                       weight_gb_s=round(nbytes / ms / 1e6, 1), roofline_ms=round(roofline_ms, 4),
                       frac_of_peak=round(roofline_ms / ms, 3), max_abs_diff_vs_torch=diff)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n| T | impl | ms | GB/s (active weights) | % of peak | max diff vs torch |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        diff = "" if r["max_abs_diff_vs_torch"] is None else f"{r['max_abs_diff_vs_torch']:.3g}"
        print(f"| {r['tokens']} | {r['impl']} | {r['ms']:.3f} | {r['weight_gb_s']:.0f} | "
              f"{100 * r['frac_of_peak']:.0f} | {diff} |")


if __name__ == "__main__":
    main()
