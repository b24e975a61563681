"""Where the engine thread's time goes per step of W1 (plain and with a JSON schema per request), phase by phase.

Usage (device): python3 bench/host_phases.py [--num-prompts 256 --input-len 256 --output-len 256] [--no-json]
Wraps the engine's step phases (schedule, input preparation, forward launch, logits, sampler launch, waiting for
the previous step's tokens, scheduler update, grammar accept / fill (or, async, the wait for the fill thread),
output processing) with timers that count
each phase's own time (a phase's time excludes the phases it calls), over one timed `generate` after a warm-up.
"wait" is the host blocked on the device (the D2H copy of a step's tokens): a host-bound loop shows little of it,
a device-bound one most of the step. The same workload as bench/structured_bench.py (its SCHEMA, its prompts)."""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

from structured_bench import SCHEMA, qwen_dummy_llm, warm_up, workload_args

from replayllm import LLM, SamplingParams, StructuredOutputsParams
from replayllm.engine import grammar_workers, output_processor, scheduler
from replayllm.entrypoints.bench.workload import Workload
from replayllm.model_runner_v2 import async_output, decode_inputs, model_runner
from replayllm.sampling import sampler


class PhaseTimer:
    """Own time per phase name: a wrapped call's elapsed time less its wrapped callees' (a stack of frames)."""

    def __init__(self):
        self.own = defaultdict(float)
        self.calls = defaultdict(int)
        self._stack: list[list[float]] = []  # per open frame: [children's elapsed]

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            self._stack.append([0.0])
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                children = self._stack.pop()[0]
                self.own[name] += elapsed - children
                self.calls[name] += 1
                if self._stack:
                    self._stack[-1][0] += elapsed

        return timed

    def patch(self, owner, attr: str, name: str) -> None:
        setattr(owner, attr, self.wrap(name, getattr(owner, attr)))

    def reset(self) -> None:
        self.own.clear()
        self.calls.clear()


def install(timer: PhaseTimer, llm: LLM) -> None:
    engine = llm.llm_engine
    timer.patch(scheduler.Scheduler, "schedule", "schedule")
    timer.patch(scheduler.Scheduler, "update", "scheduler.update")
    timer.patch(output_processor.OutputProcessor, "process", "outputs")
    timer.patch(async_output.AsyncModelRunnerOutput, "get", "wait+d2h")
    timer.patch(model_runner, "prepare_inputs", "prepare_inputs")
    timer.patch(decode_inputs.DecodeInputs, "prepare", "prepare_inputs")  # decode steps on the graphs
    runner = engine.runner
    timer.patch(type(runner), "_forward", "forward launch")
    timer.patch(type(runner), "execute_model", "runner other")
    timer.patch(type(runner), "sample_tokens", "runner other")
    timer.patch(type(runner.model), "compute_logits", "logits launch")
    timer.patch(sampler.Sampler, "__call__", "sampler launch")
    timer.patch(grammar_workers.GrammarWorkers, "accept", "grammar accept")
    timer.patch(grammar_workers.GrammarWorkers, "fill", "grammar fill")
    timer.patch(grammar_workers.GrammarWorkers, "start_fill", "grammar fill start")
    timer.patch(grammar_workers.PendingFill, "wait", "grammar fill wait")
    timer.patch(type(engine), "step", "engine other")


def timed_run(llm: LLM, timer: PhaseTimer, prompts, params, warm_prompts) -> dict:
    warm_up(llm, params, warm_prompts)
    engine = llm.llm_engine
    steps0 = engine.num_steps
    timer.reset()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    steps = engine.num_steps - steps0
    phases = {k: 1e3 * v / steps for k, v in sorted(timer.own.items(), key=lambda kv: -kv[1])}
    return {"ms_per_step": 1e3 * elapsed / steps, "steps": steps, "phases_ms_per_step": phases,
            "outside_step_ms_per_step": 1e3 * elapsed / steps - sum(phases.values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    workload_args(ap)
    ap.add_argument("--no-json", action="store_true")
    args = ap.parse_args()
    llm = qwen_dummy_llm(args)
    timer = PhaseTimer()
    install(timer, llm)
    vocab = llm.llm_engine.model_config.vocab_size
    sets = [Workload(args.num_prompts, args.input_len, args.output_len, seed=s).requests(vocab)[0] for s in range(4)]
    plain = [SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True) for _ in sets[0]]
    runs = [("W1", sets[0], plain, sets[2])]
    if not args.no_json:
        spec = StructuredOutputsParams(json=SCHEMA)
        js = [SamplingParams(temperature=0, max_tokens=args.output_len, structured_outputs=spec) for _ in sets[1]]
        runs.append(("W1-json", sets[1], js, sets[3]))
    for name, prompts, params, warm in runs:
        r = timed_run(llm, timer, prompts, params, warm)
        parts = ", ".join(f"{k} {v:.3f}" for k, v in r["phases_ms_per_step"].items())
        print(f"{name}: {r['ms_per_step']:.2f} ms/step over {r['steps']} steps = {parts}, "
              f"outside the step {r['outside_step_ms_per_step']:.3f} (ms per step)")
    llm.llm_engine.shutdown()


if __name__ == "__main__":
    main()
