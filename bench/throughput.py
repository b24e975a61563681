"""Offline throughput: N prompts x (input + output) tokens on a dummy Qwen3-0.6B-shaped model.

Usage: python bench/throughput.py [--num-prompts 256 --input-len 256 --output-len 256 --trace]
                                  [--attention-backend auto|torch|triton] [--enforce-eager]
Prints one JSON line. With --trace every request replays a random trace of output-len tokens (the trace
kernel on the hot path) and asks for logprobs=1."""

from __future__ import annotations

import argparse
import json
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
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--trace", action="store_true")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps")
    args = ap.parse_args()

    from replayllm import LLM, SamplingParams

    model = write_config()
    llm = LLM(model, load_format="dummy", dtype=args.dtype, skip_tokenizer_init=True, device=args.device,
              max_model_len=args.input_len + args.output_len + 16, max_num_seqs=args.num_prompts,
              enable_trace_replay=args.trace, attention_backend=args.attention_backend,
              enforce_eager=args.enforce_eager)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 150000) for _ in range(args.input_len)]}
               for _ in range(args.num_prompts)]
    if args.trace:
        params = [SamplingParams(trace_decode_token_ids=[rng.randrange(100, 150000) for _ in range(args.output_len)],
                                 logprobs=1) for _ in prompts]
    else:
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:4], params[:4] if isinstance(params, list) else params, use_tqdm=False)  # warm-up
    steps0 = llm.llm_engine.num_steps
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    print(json.dumps({"bench": "throughput", "trace": args.trace, "dtype": args.dtype,
                      "attention_backend": llm.llm_engine.config.attention_backend,
                      "cuda_graphs": llm.llm_engine.config.use_cuda_graphs,
                      "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
                      "elapsed_s": round(elapsed, 3), "output_tok_per_s": round(n_out / elapsed, 1),
                      "total_tok_per_s": round((n_out + args.num_prompts * args.input_len) / elapsed, 1),
                      "steps": llm.llm_engine.num_steps - steps0}))  # this run's, not the warm-up's


if __name__ == "__main__":
    main()
