"""Where a decode step's GPU time goes: torch.profiler over steady-state decode steps of the throughput workload.

Usage (on the device): python bench/profile_gpu.py [`replayllm bench throughput` args] [--steps 10] [--top 30]
Adds the workload's requests, steps until every request is decoding, then times --steps steps without the
profiler (wall ms/step) and profiles as many with it: kernels grouped by name, sorted by GPU time, as a table.
--whole-run: instead profile one whole `generate` of the workload after `bench throughput`'s warm-up and timed run
(fast replay's lookahead steps, prefill and all; prompts neither used, so the prefix cache misses as in the timed
run): wall time against the GPU's kernel time shows what the host costs.
--timeline: also where the GPU sits idle in the profiled steps: the gaps between consecutive kernels (sum per step,
the largest ones) and, for each large gap, the host calls (CUDA runtime and torch ops) running while the GPU
waited; --trace-json F additionally writes the Chrome trace (chrome://tracing, Perfetto).
"""

from __future__ import annotations

import argparse
import time

from replayllm.entrypoints.bench.throughput import build
from replayllm.entrypoints.cli.engine_args import engine_kwargs
from replayllm.entrypoints.cli.main import bench_throughput_args


def main() -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--whole-run", action="store_true")
    ap.add_argument("--timeline", action="store_true")
    ap.add_argument("--trace-json", default=None)
    own, rest = ap.parse_known_args()
    args = bench_throughput_args(rest)  # the workload and engine options
    args.steps, args.top = own.steps, own.top
    llm, workload, _ = build(args, engine_kwargs(args))
    prompts, params = workload.requests(llm.llm_engine.model_config.vocab_size)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    engine = llm.llm_engine
    if own.whole_run:
        _whole_run(llm, workload, args.top, own.timeline)
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
    print(f"[profile] wall {wall_ms:.2f} ms/step (no profiler); GPU kernels {total / 1000 / args.steps:.2f} ms/step "
          f"summed, {_busy_us(prof) / 1000 / args.steps:.2f} busy; "
          f"{sum(c for _, c in rows.values()) / args.steps:.0f} kernels/step; "
          f"batch {engine.last_step_num_reqs} rows")
    _print_rows(rows, args.steps, args.top)
    if own.timeline or own.trace_json:
        _print_gaps(prof, args.steps)
    if own.trace_json:
        prof.export_chrome_trace(own.trace_json)
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


def _busy_us(prof) -> float:
    """Microseconds in which at least one kernel ran (the union of the kernels' intervals). With programmatic
    dependent launch (kernels/pdl.py) a kernel's programs are resident, and its duration counting, while they
    wait for the kernel before it: the summed durations then exceed the time the GPU was busy."""
    import torch

    cuda = torch.autograd.DeviceType.CUDA
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == cuda)
    busy, end = 0.0, None
    for lo, hi in spans:
        if end is None or lo > end:
            busy, end = busy + (hi - lo), hi
        elif hi > end:
            busy, end = busy + (hi - end), hi
    return busy


def _print_gaps(prof, steps: int, min_gap_us: float = 20.0, show: int = 12) -> None:
    """GPU idle time between consecutive kernels over the profiled steps, and what the host ran in the largest
    gaps (the host-side events overlapping each gap, longest first)."""
    import torch

    cuda = torch.autograd.DeviceType.CUDA
    kernels, host = [], []
    for e in prof.events():
        (kernels if e.device_type == cuda else host).append((e.time_range.start, e.time_range.end, e.name))
    kernels.sort()
    gaps, busy_end = [], None
    for start, end, name in kernels:
        if busy_end is not None and start - busy_end > 0:
            gaps.append((start - busy_end, busy_end, start, name))
        busy_end = end if busy_end is None else max(busy_end, end)
    span = (kernels[-1][1] - kernels[0][0]) if kernels else 0.0
    idle = sum(g for g, *_ in gaps)
    big = sorted((g for g in gaps if g[0] >= min_gap_us), reverse=True)
    print(f"[timeline] kernels span {span / 1000 / steps:.2f} ms/step; GPU idle between kernels "
          f"{idle / 1000 / steps:.3f} ms/step ({100 * idle / max(span, 1):.0f}%); gaps >= {min_gap_us:.0f} us: "
          f"{len(big) / steps:.1f}/step, {sum(g for g, *_ in big) / 1000 / steps:.3f} ms/step")
    for gap, lo, hi, after in big[:show]:
        during = sorted(((min(hi, e) - max(lo, s), n) for s, e, n in host if s < hi and e > lo), reverse=True)
        names = ", ".join(f"{n[:40]} {t:.0f}" for t, n in during[:6])
        print(f"  {gap:7.0f} us idle before {after[:50]}: host {names}")


def _print_rows(rows: dict[str, tuple[float, int]], steps: int, top: int) -> None:
    total = sum(t for t, _ in rows.values())
    print(f"{'ms/step':>8} {'share':>6} {'n/step':>7}  kernel")
    for key, (t, c) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"{t / 1000 / steps:8.3f} {100 * t / total:5.1f}% {c / steps:7.1f}  {key[:110]}")


def _whole_run(llm, workload, top: int, timeline: bool) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from replayllm.entrypoints.bench.throughput import run_engine, unseen_workload

    plain = run_engine(llm, workload)  # warm-up + one timed run without the profiler
    engine = llm.llm_engine
    # New prompts: the timed run's would hit the prefix cache, and the profile would miss their prefill.
    prompts, params = unseen_workload(workload).requests(engine.model_config.vocab_size)
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
    if timeline:
        _print_gaps(prof, steps)
        _print_busy_over_time(prof)


def _print_busy_over_time(prof, bins: int = 24) -> None:
    """The run cut into equal time bins: the share of each the GPU spent in kernels (where the idle time sits:
    prefill, the decode steady state, the tail)."""
    import torch

    cuda = torch.autograd.DeviceType.CUDA
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == cuda)
    if not spans:
        return
    t0, t1 = spans[0][0], max(end for _, end in spans)
    width = (t1 - t0) / bins
    busy = [0.0] * bins
    last = t0
    for start, end in spans:  # union of the kernel intervals, split across bins
        start = max(start, last)
        while start < end:
            b = min(bins - 1, int((start - t0) / width))
            cut = min(end, t0 + (b + 1) * width) if b < bins - 1 else end
            busy[b] += cut - start
            start = cut
        last = max(last, end)
    print(f"[timeline] GPU busy per {width / 1000:.1f} ms of the run: "
          + " ".join(f"{100 * b / width:.0f}%" for b in busy))


if __name__ == "__main__":
    main()
