"""The engine's host bookkeeping per step without a model: schedule, update, outputs (the part a GPU cannot hide).

Usage: python bench/host_step_cost.py [--num-prompts 256 --output-len 128 --logprobs 1 --trace --detokenize
                                       --profile 25]
The engine is the real one (scheduler, block manager, output processor, async scheduling loop); its runner is
replaced by one that "samples" token 7 for every sampling row at once (fast-replay rows: their trace's next
tokens), so what is timed is the Python around a step: ms per step and µs per row over the decode steps of one
`LLM.generate`. On the H200, W1's decode step is ~4.3 ms of GPU work (docs/benchmarks.md): host bookkeeping
near that bound keeps the GPU waiting. `--profile N` prints the top N functions by own time (cProfile)."""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import time

import numpy as np

from replayllm import LLM, SamplingParams
from replayllm.embedded_model import materialize
from replayllm.model_runner_v2.runner_interface import RunnerInterface
from replayllm.step_io import ModelRunnerOutput, SchedulerOutput


class _Done:
    """An already finished step (the engine's AsyncModelRunnerOutput protocol: `.get()`)."""

    def __init__(self, out: ModelRunnerOutput):
        self.out = out

    def get(self) -> ModelRunnerOutput:
        return self.out


class FakeRunner(RunnerInterface):
    """Returns every sampling row's tokens at once: token 7, or a replaying row's next trace tokens; logprobs of
    the requested width when asked (constant numbers)."""

    def __init__(self, real: RunnerInterface, engine, logprobs: int | None):
        self.num_blocks, self.model = real.num_blocks, real.model
        self.engine, self.logprobs = engine, logprobs

    def execute_model(self, sched: SchedulerOutput) -> None:
        self.sched = sched

    def sample_tokens(self, grammar) -> _Done:
        sched, self.sched = self.sched, None
        requests = self.engine.scheduler.requests
        req_ids, tokens, counts = [], [], []
        for row in sched.rows:
            if not row.samples:
                continue
            req_ids.append(row.request_id)
            n = row.num_sampled_tokens
            req = requests.get(row.request_id)
            trace_token_ids = req.params.trace_decode_token_ids if req is not None else None
            if trace_token_ids:
                done = row.num_computed_tokens + row.num_scheduled_tokens - n + 1 - req.num_prompt_tokens
                tokens.extend(trace_token_ids[done : done + n])
            else:
                tokens.extend([7] * n)
            counts.append(n)
        s = len(tokens)
        out = ModelRunnerOutput(req_ids, np.array(tokens, dtype=np.int64),
                                num_sampled=None if all(c == 1 for c in counts) else np.array(counts))
        if self.logprobs is not None:
            out.logprob = np.full(s, -1.0, dtype=np.float32)
            out.rank = np.ones(s, dtype=np.int64)
            out.topk_ids = np.full((s, self.logprobs), 7, dtype=np.int64)
            out.topk_logprobs = np.full((s, self.logprobs), -1.0, dtype=np.float32)
        return _Done(out)

    def free_requests(self, request_ids: list[str]) -> None:
        pass

    def load_weights(self, weights) -> None:
        raise NotImplementedError("the host-cost runner has no weights")

    def sleep(self, level: int) -> None:
        raise NotImplementedError("the host-cost runner does not sleep")

    def wake_up(self, tags: list[str]) -> None:
        raise NotImplementedError("the host-cost runner does not sleep")

    def shutdown(self) -> None:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--logprobs", type=int, default=None)
    ap.add_argument("--trace", action="store_true", help="every request replays a trace (fast replay, chunk 64)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", type=int, default=0, help="print the top N functions by own time")
    ap.add_argument("--detokenize", action="store_true",
                    help="the embedded model's Qwen tokenizer on: every token is detokenized (LLM.generate's text)")
    args = ap.parse_args()
    llm = LLM(materialize("replayllm/tiny-qwen3"), skip_tokenizer_init=not args.detokenize, max_model_len=4096,
              enable_trace_replay=args.trace, async_scheduling=True, max_num_seqs=max(256, args.num_prompts))
    engine = llm.llm_engine
    engine.runner = FakeRunner(engine.runner, engine, args.logprobs)
    rng = random.Random(0)

    def requests():
        prompts = [{"prompt_token_ids": [rng.randrange(100, 20000) for _ in range(args.input_len)]}
                   for _ in range(args.num_prompts)]
        if args.trace:
            params = [SamplingParams(trace_decode_token_ids=[rng.randrange(100, 20000) for _ in range(args.output_len)],
                                     logprobs=args.logprobs) for _ in prompts]
        else:
            plain = SamplingParams(max_tokens=args.output_len, ignore_eos=True, logprobs=args.logprobs,
                                   detokenize=args.detokenize)
            params = [plain] * len(prompts)
        return prompts, params

    llm.generate(*requests(), use_tqdm=False)  # warm-up
    times = []
    for _ in range(args.repeats):
        prompts, params = requests()
        s0 = engine.num_steps
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        times.append((time.perf_counter() - start) / (engine.num_steps - s0))
    best = min(times)
    print(f"host bookkeeping: {1e3 * best:.3f} ms/step, {1e6 * best / args.num_prompts:.2f} us/row "
          f"(best of {args.repeats}; {args.num_prompts} rows, {engine.num_steps - s0} steps a run)")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        llm.generate(*requests(), use_tqdm=False)
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(args.profile)
        print(buf.getvalue())


if __name__ == "__main__":
    main()
