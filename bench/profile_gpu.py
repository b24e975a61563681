"""Where a decode step's GPU time goes: torch.profiler over steady-state decode steps of the throughput workload.

Usage (on the device): python bench/profile_gpu.py [`replayllm bench throughput` args] [--steps 10] [--top 30]
Adds the workload's requests, steps until every request is decoding, then times --steps steps without the
profiler (wall ms/step) and profiles as many with it: kernels grouped by name, sorted by GPU time, as a table.
--whole-run: instead profile one whole `generate` of the workload after `bench throughput`'s warm-up (fast
replay's lookahead steps, prefill and all): wall time against the GPU's kernel time shows what the host costs.
"""

from __future__ import annotations

import argparse
import time

from replayllm.entrypoints.bench.throughput import build
from replayllm.entrypoints.cli.engine_args import engine_kwargs
from replayllm.entrypoints.cli.main import build_parser


def main() -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--whole-run", action="store_true")
    own, rest = ap.parse_known_args()
    args = build_parser().parse_args(["bench", "throughput", *rest])  # the workload and engine options
    args.steps, args.top = own.steps, own.top
    llm, workload, _ = build(args, engine_kwargs(args))
    prompts, params = workload.requests(llm.llm_engine.model_config.vocab_size)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    engine = llm.llm_engine
    if own.whole_run:
        _whole_run(llm, workload, args.top)
        return
    llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"p{i}", p, sp)
    # Step until no request is waiting or prefilling: the steady state of decode.
    while engine.scheduler.waiting or any(r.num_computed_tokens < len(r.prompt_token_ids)
                                          for r in engine.scheduler.running):
        engine.step()
    for _ in range(3):
        engine.step()
    sync()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    sync()
    wall_ms = 1000 * (time.perf_counter() - start) / args.steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            engine.step()
        sync()
    rows = _kernel_rows(prof)
    total = sum(t for t, _ in rows.values())
    print(f"[profile] {vars(args)}")
    print(f"[profile] wall {wall_ms:.2f} ms/step (no profiler); GPU kernels {total / 1000 / args.steps:.2f} ms/step; "
          f"{sum(c for _, c in rows.values()) / args.steps:.0f} kernels/step; "
          f"batch {engine.last_step_num_reqs} rows")
    _print_rows(rows, args.steps, args.top)
    while engine.has_unfinished_requests():
        engine.step()


def _kernel_rows(prof) -> dict[str, tuple[float, int]]:
    """kernel name -> (GPU microseconds, launches)."""
    import torch

    rows = {}
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = e.self_cuda_time_total
        if t > 0 and e.device_type == torch.autograd.DeviceType.CUDA:
            rows[e.key] = (t, e.count)
    return rows


def _print_rows(rows: dict[str, tuple[float, int]], steps: int, top: int) -> None:
    total = sum(t for t, _ in rows.values())
    print(f"{'ms/step':>8} {'share':>6} {'n/step':>7}  kernel")
    for key, (t, c) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"{t / 1000 / steps:8.3f} {100 * t / total:5.1f}% {c / steps:7.1f}  {key[:110]}")


def _whole_run(llm, workload, top: int) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from replayllm.entrypoints.bench.throughput import run_engine

    plain = run_engine(llm, workload)  # warm-up + one timed run without the profiler
    engine = llm.llm_engine
    prompts, params = workload.requests(engine.model_config.vocab_size)
    steps0 = engine.num_steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
    steps = engine.num_steps - steps0
    rows = _kernel_rows(prof)
    total = sum(t for t, _ in rows.values())
    print(f"[profile] whole run: wall {plain['elapsed_s']:.3f} s over {plain['steps']} steps (no profiler); "
          f"GPU kernels {total / 1e6:.3f} s ({100 * total / 1e6 / plain['elapsed_s']:.0f}% of the wall), "
          f"{sum(c for _, c in rows.values()) / steps:.0f} kernels/step")
    _print_rows(rows, steps, top)


if __name__ == "__main__":
    main()
