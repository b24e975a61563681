"""Where a step's time goes: the throughput workload (bench/throughput.py's model and shapes) under cProfile.

Usage: python bench/profile_step.py [--num-prompts 256 --input-len 256 --output-len 256 --trace --top 25]
With CUDA graphs the GPU runs asynchronously; the step waits for it in the runner's one device->host copy
(`Tensor.cpu` in the table), so that row is GPU time the host could not hide."""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from qwen3_0_6b import write_config  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--trace", action="store_true")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()

    from replayllm import LLM, SamplingParams

    llm = LLM(write_config(), load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
              max_model_len=args.input_len + args.output_len + 16, max_num_seqs=args.num_prompts,
              enable_trace_replay=args.trace, enforce_eager=args.enforce_eager)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 150000) for _ in range(args.input_len)]}
               for _ in range(args.num_prompts)]
    if args.trace:
        params = [SamplingParams(trace_decode_token_ids=[rng.randrange(100, 150000) for _ in range(args.output_len)],
                                 logprobs=1) for _ in prompts]
    else:
        params = [SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)] * len(prompts)
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
