"""W2 at several trace_replay_chunk_size values against W1, in one process (one engine, cold prompts per run).

Usage (on the device): python bench/fast_replay_sweep.py [--chunk-sizes 1,16,64] [`bench throughput` args]
Prints one line per chunk size: out tok/s, steps, and the ratio to W1 measured in the same process (W1 runs first
and last). Every run draws other random prompts (its own seed): a warm prefix cache would let all requests skip
prefill and start together, which changes the schedule being measured. The engine's default chunk size is
changed between runs (requests read it when they are added). `bash bench/gpu_check.sh` runs it with
BENCH_ONLY="W2-sweep".

Session 5 used an earlier version of this script that patched the scheduler's former lookahead limits
(FAST_REPLAY_MAX_RUNNING, MAX_LOOKAHEAD_TOKENS_PER_STEP, both gone since): docs/benchmarks.md has those numbers.
"""

from __future__ import annotations

import argparse
import dataclasses

from replayllm.entrypoints.bench.throughput import build, run_engine
from replayllm.entrypoints.cli.engine_args import engine_kwargs
from replayllm.entrypoints.cli.main import bench_throughput_args


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunk-sizes", default="1,16,64")
    own, rest = ap.parse_known_args()
    args = bench_throughput_args(["--trace", *rest])
    llm, w2, _ = build(args, engine_kwargs(args))
    config = llm.llm_engine.config
    seeds = iter(range(w2.seed + 100, w2.seed + 10_000, 10))  # run_engine warms up with seed + 1
    base = run_engine(llm, dataclasses.replace(w2, trace=False, seed=next(seeds)))
    print(f"W1: {base['output_tok_per_s']:,.0f} out tok/s, {base['steps']} steps")
    for k in (int(x) for x in own.chunk_sizes.split(",")):
        config.trace_replay_chunk_size = k
        r = run_engine(llm, dataclasses.replace(w2, seed=next(seeds)))
        print(f"W2 trace_replay_chunk_size={k}: {r['output_tok_per_s']:,.0f} out tok/s, {r['steps']} steps, "
              f"{r['output_tok_per_s'] / base['output_tok_per_s']:.2f}x W1", flush=True)
    again = run_engine(llm, dataclasses.replace(w2, trace=False, seed=next(seeds)))
    print(f"W1 again: {again['output_tok_per_s']:,.0f} out tok/s")


if __name__ == "__main__":
    main()
