"""Offline throughput: N prompts x (input + output) tokens on a dummy Qwen3-0.6B-shaped model.

Usage: python bench/throughput.py [--num-prompts 256 --input-len 256 --output-len 256 --trace]
                                  [--attention-backend auto|torch|triton] [--enforce-eager]
                                  [--async-scheduling]
Prints one JSON line. With --trace every request replays a random trace of output-len tokens (the trace
kernel on the hot path) and asks for logprobs=1."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workload import add_workload_args, build_workload  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    add_workload_args(ap)
    args = ap.parse_args()
    llm, prompts, params = build_workload(args)
    llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm-up
    steps0 = llm.llm_engine.num_steps
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    print(json.dumps({"bench": "throughput", "trace": args.trace, "dtype": args.dtype,
                      "attention_backend": llm.llm_engine.config.attention_backend,
                      "cuda_graphs": llm.llm_engine.config.use_cuda_graphs,
                      "async_scheduling": args.async_scheduling,
                      "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
                      "elapsed_s": round(elapsed, 3), "output_tok_per_s": round(n_out / elapsed, 1),
                      "total_tok_per_s": round((n_out + args.num_prompts * args.input_len) / elapsed, 1),
                      "steps": llm.llm_engine.num_steps - steps0}))  # this run's, not the warm-up's


if __name__ == "__main__":
    main()
