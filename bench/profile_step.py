"""Where a step's time goes: the throughput workload (`replayllm bench throughput`'s) under cProfile.

Usage: python bench/profile_step.py [--num-prompts 256 --input-len 256 --output-len 256 --trace --top 25]
With CUDA graphs the GPU runs asynchronously; the step waits for it in the runner's one device->host copy
(`Tensor.cpu` in the table), so that row is GPU time the host could not hide."""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

from replayllm.entrypoints.bench.throughput import build
from replayllm.entrypoints.cli.engine_args import engine_kwargs
from replayllm.entrypoints.cli.main import bench_throughput_args


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--top", type=int, default=30)
    own, rest = ap.parse_known_args()
    args = bench_throughput_args(rest)  # the workload and engine options
    args.top = own.top
    llm, workload, _ = build(args, engine_kwargs(args))
    prompts, params = workload.requests(llm.llm_engine.model_config.vocab_size)
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
