"""When does fast replay's lookahead pay? W1 and W2 (`replayllm bench throughput` and `... --trace`) in one
process, W2 under several values of the scheduler's FAST_REPLAY_MAX_RUNNING and MAX_LOOKAHEAD_TOKENS_PER_STEP
(engine/scheduler.py; patched between runs, one engine for all).

Usage (on the device): python bench/fast_replay_sweep.py [--settings 0:4096,128:4096,256:16384]
(MAX_RUNNING:LOOKAHEAD pairs). Prints one line per setting: out tok/s, steps, and the ratio to W1 measured in
the same process. Every run draws other random prompts (its own seed): a warm prefix cache would let all
requests skip prefill and start together, which changes the schedule being measured.
"""

from __future__ import annotations

import argparse
import dataclasses

from replayllm.engine import scheduler
from replayllm.entrypoints.bench.throughput import build, run_engine
from replayllm.entrypoints.cli import build_parser, engine_kwargs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settings", default="0:4096,128:4096,256:4096,256:8192,256:16384,1024:16384")
    own, rest = ap.parse_known_args()
    args = build_parser().parse_args(["bench", "throughput", "--trace", *rest])
    llm, w2, _ = build(args, engine_kwargs(args))
    seeds = iter(range(w2.seed + 100, w2.seed + 10_000, 10))  # run_engine warms up with seed + 1
    base = run_engine(llm, dataclasses.replace(w2, trace=False, seed=next(seeds)))
    print(f"W1: {base['output_tok_per_s']:,.0f} out tok/s, {base['steps']} steps")
    for setting in own.settings.split(","):
        mr, la = (int(x) for x in setting.split(":"))
        scheduler.FAST_REPLAY_MAX_RUNNING, scheduler.MAX_LOOKAHEAD_TOKENS_PER_STEP = mr, la
        r = run_engine(llm, dataclasses.replace(w2, seed=next(seeds)))
        print(f"W2 max_running={mr} lookahead={la}: {r['output_tok_per_s']:,.0f} out tok/s, {r['steps']} steps, "
              f"{r['output_tok_per_s'] / base['output_tok_per_s']:.2f}x W1", flush=True)
    again = run_engine(llm, dataclasses.replace(w2, trace=False, seed=next(seeds)))
    print(f"W1 again: {again['output_tok_per_s']:,.0f} out tok/s")


if __name__ == "__main__":
    main()
