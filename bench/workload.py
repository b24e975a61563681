"""The throughput workload shared by bench/throughput.py and bench/profile_step.py: N random prompts of
input-len tokens, each generating output-len tokens (greedy, or replaying a random trace with logprobs=1), on
the Qwen3-0.6B-shaped dummy model; plus a CUDA-event timer for kernel benches and GPU tests."""

from __future__ import annotations

import argparse
import random

from qwen3_0_6b import write_config


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--trace", action="store_true", help="replay a random trace per request, logprobs=1")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps")
    ap.add_argument("--async-scheduling", action="store_true", help="launch step N+1 before processing step N")


def build_workload(args: argparse.Namespace):
    """(LLM, prompts, per-prompt SamplingParams) for parsed `add_workload_args` arguments; fixed seed."""
    from replayllm import LLM, SamplingParams

    llm = LLM(write_config(), load_format="dummy", dtype=args.dtype, skip_tokenizer_init=True, device=args.device,
              max_model_len=args.input_len + args.output_len + 16, max_num_seqs=args.num_prompts,
              enable_trace_replay=args.trace, attention_backend=args.attention_backend,
              enforce_eager=args.enforce_eager, async_scheduling=args.async_scheduling)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 150000) for _ in range(args.input_len)]}
               for _ in range(args.num_prompts)]
    if args.trace:
        params = [SamplingParams(trace_decode_token_ids=[rng.randrange(100, 150000) for _ in range(args.output_len)],
                                 logprobs=1) for _ in prompts]
    else:
        params = [SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)] * len(prompts)
    return llm, prompts, params


def dummy_trace_case(seed: int, prompt_lens, trace_len: int = 32, low: int = 100, high: int = 150_000):
    """(model dir, prompts, traces) for the Qwen3-0.6B dummy model: one random prompt per length, then one random
    trace of trace_len tokens per prompt, ids in [low, high), drawn from random.Random(seed) in that order."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(low, high) for _ in range(n)] for n in prompt_lens]
    traces = [[rng.randrange(low, high) for _ in range(trace_len)] for _ in prompts]
    return write_config(), prompts, traces


def cuda_ms(fn, reps: int = 20) -> float:
    """Mean milliseconds of fn() on the current CUDA stream (one warm-up call first)."""
    import torch

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps
