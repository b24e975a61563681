"""n-gram speculative decoding at batch 1 on a copying workload: decode tokens/s with and without
speculation, greedy outputs compared, acceptance reported. Prints (and optionally writes) one JSON object.

The workload: a prompt that quotes a passage and then starts it again, so the continuation copies it. With
dummy weights no passage of text means anything to the model, so the passage is the model's own greedy
continuation of a random seed prompt: prompt = seed + passage + seed, whose greedy continuation is the passage
again (as a real model copies a quoted passage). Both engines are built with the same options and run alone.

Usage (GPU machine, outside the repository root):
    python bench/spec_bench.py                         # Qwen3-0.6B shape, dummy bf16 weights, k = 4
    python bench/spec_bench.py --dtype float32          # exact greedy identity (bf16 near-ties may flip)
Target (issue 17): speedup >= 1.5 with identical greedy output."""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
from pathlib import Path


def _engine(args, speculative: dict | None):
    from replayllm import LLM

    return LLM(args.model, load_format=args.load_format, dtype=args.dtype, max_model_len=args.max_model_len,
               kv_cache_memory_bytes=args.kv_cache_gib << 30, enable_prefix_caching=False, max_num_seqs=1,
               seed=0, skip_tokenizer_init=True, speculative_config=speculative)


def _timed(llm, prompt: list[int], max_tokens: int) -> tuple[list[int], float]:
    from replayllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)  # warm-up (compiles, graphs)
    start = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
    return out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint dir (default: the Qwen3-0.6B config, dummy)")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seed-len", type=int, default=64, help="random seed prompt tokens")
    parser.add_argument("--passage-len", type=int, default=512, help="tokens of the quoted passage")
    parser.add_argument("--output-len", type=int, default=512, help="tokens generated in the timed runs")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--prompt-lookup-max", type=int, default=5)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--kv-cache-gib", type=int, default=4)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    if args.model is None:
        from replayllm.entrypoints.bench.workload import write_dummy_config

        args.model = write_dummy_config()
    import torch

    from replayllm import SamplingParams
    from replayllm.entrypoints.bench.workload import TOKEN_ID_RANGE

    spec_cfg = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
                "prompt_lookup_min": args.prompt_lookup_min, "prompt_lookup_max": args.prompt_lookup_max}
    plain = _engine(args, None)
    vocab = plain.llm_engine.model_config.vocab_size
    lo, hi = TOKEN_ID_RANGE if vocab > TOKEN_ID_RANGE[1] else (0, vocab)  # a tiny test vocabulary: all of it
    rng = random.Random(0)
    seed = [rng.randrange(lo, hi) for _ in range(args.seed_len)]
    passage = plain.generate([{"prompt_token_ids": seed}], SamplingParams(
        temperature=0, max_tokens=args.passage_len, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    prompt = seed + passage + seed
    plain_out, plain_s = _timed(plain, prompt, args.output_len)
    del plain
    gc.collect()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None

    spec = _engine(args, spec_cfg)
    spec_out, spec_s = _timed(spec, prompt, args.output_len)
    stats = spec.llm_engine.scheduler.spec_stats
    first_diff = next((i for i, (a, b) in enumerate(zip(plain_out, spec_out)) if a != b), None)
    result = {
        "model": args.model, "dtype": args.dtype, "speculative_config": spec_cfg,
        "prompt_len": len(prompt), "output_len": args.output_len,
        "plain_tok_per_s": round(args.output_len / plain_s, 1), "spec_tok_per_s": round(args.output_len / spec_s, 1),
        "speedup": round(plain_s / spec_s, 3),
        "greedy_identical": plain_out == spec_out, "first_difference_at": first_diff,
        # cumulative over the warm-up and timed runs (same prompt, same outputs)
        "acceptance_rate": round(stats.acceptance_rate, 4), "mean_acceptance_length": round(
            stats.mean_acceptance_length, 3), "accepted_per_pos": stats.num_accepted_tokens_per_pos,
        "passage_copied": plain_out[: len(passage)] == passage[: args.output_len],
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.output_json:
        Path(args.output_json).write_text(text + "\n")


if __name__ == "__main__":
    main()
