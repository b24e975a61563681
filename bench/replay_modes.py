"""What fast replay changes: sample a batch with logprobs, replay it on the same engine one token a step (the
default) and in fast-replay chunks, and compare each replay's logprobs with the sampling-time ones.

Usage (device): python bench/replay_modes.py [--dtype bfloat16] [--num-prompts 64] [--input-len 64]
  [--output-len 64] [--batch-invariant] [--output-json F]
Model: the Qwen3-0.6B shape with dummy weights (seeded). Prints one JSON line: per mode the tokens compared, the
share of them bit-identical, mean and max |delta|, and the share of ranks that changed.
"""

from __future__ import annotations

import argparse
import json
import random


def compare(sampled, replayed) -> dict:
    deltas, ranks_changed, n = [], 0, 0
    for a, b in zip(sampled, replayed):
        ca, cb = a.outputs[0], b.outputs[0]
        assert ca.token_ids == cb.token_ids
        for t, la, lb in zip(ca.token_ids, ca.logprobs, cb.logprobs):
            deltas.append(abs(la[t].logprob - lb[t].logprob))
            ranks_changed += la[t].rank != lb[t].rank
            n += 1
    return {"tokens": n, "bitwise_share": sum(d == 0 for d in deltas) / n, "mean_abs_delta": sum(deltas) / n,
            "max_abs_delta": max(deltas), "rank_changed_share": ranks_changed / n}


def main() -> None:
    from replayllm import LLM, SamplingParams
    from replayllm.config import FAST_REPLAY_CHUNK_SIZE
    from replayllm.entrypoints.bench.workload import write_dummy_config

    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--batch-invariant", action="store_true")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    llm = LLM(write_dummy_config(), load_format="dummy", dtype=args.dtype, enable_trace_replay=True,
              skip_tokenizer_init=True, batch_invariant=args.batch_invariant, max_model_len=4096)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 150_000) for _ in range(args.input_len)]}
               for _ in range(args.num_prompts)]
    params = [SamplingParams(max_tokens=args.output_len, ignore_eos=True, logprobs=1, temperature=1.0, seed=i)
              for i in range(args.num_prompts)]
    sampled = llm.generate(prompts, params, use_tqdm=False)
    result = {"dtype": args.dtype, "batch_invariant": args.batch_invariant,
              "default_chunk": llm.llm_engine.config.trace_replay_chunk_size}
    for name, chunk in (("one-token", 1), (f"fast:{FAST_REPLAY_CHUNK_SIZE}", FAST_REPLAY_CHUNK_SIZE)):
        traces = [SamplingParams(trace_decode_token_ids=list(o.outputs[0].token_ids), logprobs=1,
                                 trace_replay_chunk_size=chunk) for o in sampled]
        result[name] = compare(sampled, llm.generate(prompts, traces, use_tqdm=False))
    llm.shutdown()
    print(json.dumps(result))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
