"""Where a step's time goes: the throughput workload (bench/throughput.py's model and shapes) under cProfile.

Usage: python bench/profile_step.py [--num-prompts 256 --input-len 256 --output-len 256 --trace --top 25]
With CUDA graphs the GPU runs asynchronously; the step waits for it in the runner's one device->host copy
(`Tensor.cpu` in the table), so that row is GPU time the host could not hide."""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import add_workload_args, build_workload  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    add_workload_args(ap)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    llm, prompts, params = build_workload(args)
    llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up
    steps0 = llm.llm_engine.num_steps
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    llm.generate(prompts, params, use_tqdm=False)
    prof.disable()
    elapsed = time.perf_counter() - start
    steps = llm.llm_engine.num_steps - steps0
    print(f"[profile] trace={args.trace} eager={args.enforce_eager}: {elapsed:.2f} s, "
          f"{1000 * elapsed / max(1, steps):.2f} ms/step over all steps (profiler overhead included)")
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(args.top)
    print(buf.getvalue())


if __name__ == "__main__":
    main()
