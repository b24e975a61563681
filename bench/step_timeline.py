"""Where a whole run leaves the GPU idle: CUDA events around every launched step of the throughput workload.

Usage (device): python bench/step_timeline.py [`replayllm bench throughput` args, e.g. --batch-invariant] [--show 12]
After `bench throughput`'s warm-up and timed run, one `generate` of the workload drawn from another seed (new
prompts: a cold prefix cache, the prefill steps included) with an event recorded on the stream when each
step's forward is queued (`execute_model`) and one after its sampler (`sample_tokens`). Per step: its GPU span (end
event - start event: kernels, plus any wait for the host inside the step, e.g. between piecewise graphs) and the
GPU's idle time before it (its start event - the previous step's end event: the host had not queued it yet). Steps
are grouped by kind (decode only: every row runs one token; with prefill: some row runs a prompt chunk) so a
mode's extra wall time can be placed: slower kernels show in the spans, host-bound steps in the idle column.
No profiler: the walls are the run's own.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

from replayllm.entrypoints.bench.throughput import build, run_engine, unseen_workload
from replayllm.entrypoints.cli.engine_args import engine_kwargs
from replayllm.entrypoints.cli.main import bench_throughput_args


@dataclass
class StepMark:
    kind: str  # "decode" | "prefill" (some row runs more than one token)
    tokens: int  # tokens the step runs
    rows: int
    start: object  # torch.cuda.Event, recorded when the forward is queued
    end: object | None = None  # recorded after the sampler's kernels
    host_s: float = 0.0  # host time from execute_model's entry to sample_tokens' return


def instrument(runner, marks: list[StepMark]) -> None:
    """Wrap the runner's two launch calls (instance attributes shadow the methods)."""
    import torch

    execute_model, sample_tokens = runner.execute_model, runner.sample_tokens
    t0 = [0.0]

    def timed_execute(sched):
        t0[0] = time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        kind = "prefill" if any(r.num_scheduled_tokens > r.num_sampled_tokens for r in sched.rows) else "decode"
        marks.append(StepMark(kind, sched.num_scheduled_tokens, len(sched.rows), ev))
        return execute_model(sched)

    def timed_sample(grammar):
        handle = sample_tokens(grammar)
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        marks[-1].end = ev
        marks[-1].host_s = time.perf_counter() - t0[0]
        return handle

    runner.execute_model, runner.sample_tokens = timed_execute, timed_sample


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--show", type=int, default=12, help="the steps with the most idle before them, listed")
    own, rest = ap.parse_known_args()
    if not torch.cuda.is_available():
        sys.exit("step_timeline.py times steps with CUDA events: it needs a GPU")
    args = bench_throughput_args(rest)  # the workload and engine options
    llm, workload, _ = build(args, engine_kwargs(args))
    run_engine(llm, workload)  # warm-up + one timed run, as `bench throughput` does
    engine = llm.llm_engine
    # Prompts neither run above used: theirs would hit the prefix cache and skip their prefill.
    prompts, params = unseen_workload(workload).requests(engine.model_config.vocab_size)
    marks: list[StepMark] = []
    instrument(engine.runner, marks)
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    marks = [m for m in marks if m.end is not None]
    print(f"[steps] {vars(args)}")
    spans = [m.start.elapsed_time(m.end) for m in marks]  # ms
    idles = [0.0] + [prev.end.elapsed_time(m.start) for prev, m in zip(marks, marks[1:])]
    gpu_first_to_last = marks[0].start.elapsed_time(marks[-1].end) / 1000
    print(f"[steps] wall {wall:.3f} s, {len(marks)} steps; GPU first step start -> last step end "
          f"{gpu_first_to_last:.3f} s; spans {sum(spans) / 1000:.3f} s, idle between steps "
          f"{sum(max(0.0, i) for i in idles) / 1000:.3f} s")
    print(f"{'kind':>8} {'steps':>6} {'tokens':>8} {'span s':>8} {'idle s':>8} {'ms/step':>8} {'host ms':>8}")
    for kind in ("prefill", "decode"):
        sel = [i for i, m in enumerate(marks) if m.kind == kind]
        if not sel:
            continue
        span = sum(spans[i] for i in sel) / 1000
        idle = sum(max(0.0, idles[i]) for i in sel) / 1000
        host = sum(marks[i].host_s for i in sel) * 1000 / len(sel)
        print(f"{kind:>8} {len(sel):6d} {sum(marks[i].tokens for i in sel):8d} {span:8.3f} {idle:8.3f} "
              f"{1000 * (span + idle) / len(sel):8.2f} {host:8.2f}")
    order = sorted(range(len(marks)), key=lambda i: -idles[i])[:own.show]
    print("largest idle before a step: step kind tokens rows | idle ms, span ms, host ms")
    for i in sorted(order):
        m = marks[i]
        print(f"  {i:5d} {m.kind:>7} {m.tokens:6d} {m.rows:4d} | {idles[i]:7.2f} {spans[i]:7.2f} "
              f"{1000 * m.host_s:7.2f}")


if __name__ == "__main__":
    main()
