"""`replayllm diff` at scale: two engine configs on a dummy Qwen3-0.6B-shaped model, N random traces x L tokens.

Usage: python bench/diff_bench.py [--a dtype=bfloat16] [--b dtype=float32] [--num-traces 64] [--trace-len 1024]
                                  [--prompt-len 32] [--batch-size 64] [--full-vocab] [--init hf] [--out DIR]
e.g. the issue's bf16 vs fp8 run: --a dtype=bfloat16 --b dtype=bfloat16,quantization=fp8
Both SPECs get load_format=dummy (seeded: the same weights on both sides) and max_model_len = prompt + trace.
--init hf: instead, transformers' own initialisation (normal, std 0.02; seed 0), saved as bf16 safetensors and
loaded by both sides: peaked distributions like a trained model's, where the dummy U(+-1e-3) weights give nearly
flat ones (so deltas and KL mean more, e.g. for enable_fp32_lm_head).
Prints one JSON line; with --out,
the full report (diff.json, summary.md, plots) is written there."""

from __future__ import annotations

import argparse
import json
import random
import time

from replayllm.entrypoints.bench.workload import write_dummy_config as write_config


def _spec(spec: str, max_model_len: int, dummy: bool) -> str:
    base = f"load_format=dummy,max_model_len={max_model_len}" if dummy else f"max_model_len={max_model_len}"
    return base if spec == "default" else f"{base},{spec}"


def _hf_initialised(path: str) -> str:
    """Save transformers' random initialisation of the config in `path` (bf16 safetensors, seed 0)."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.AutoConfig.from_pretrained(path)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--a", default="dtype=bfloat16")
    ap.add_argument("--b", default="dtype=float32")
    ap.add_argument("--num-traces", type=int, default=64)
    ap.add_argument("--trace-len", type=int, default=1024)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=20)
    ap.add_argument("--full-vocab", action="store_true")
    ap.add_argument("--init", choices=("dummy", "hf"), default="dummy")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from replayllm.entrypoints.diff import TraceRecord, compare, write_report

    model = write_config() if args.init == "dummy" else _hf_initialised(write_config())
    rng = random.Random(0)
    records = [TraceRecord(str(i), [rng.randrange(100, 150000) for _ in range(args.trace_len)],
                           prompt_token_ids=[rng.randrange(100, 150000) for _ in range(args.prompt_len)])
               for i in range(args.num_traces)]
    start = time.perf_counter()
    max_len = args.prompt_len + args.trace_len
    dummy = args.init == "dummy"
    result = compare(records, _spec(args.a, max_len, dummy), _spec(args.b, max_len, dummy), model=model,
                     full_vocab=args.full_vocab,
                     top_k=args.top_k, batch_size=args.batch_size, progress=False)
    elapsed = time.perf_counter() - start
    if args.out:
        write_report(result, args.out)
    o = result.overall
    print(json.dumps({"bench": "diff", "a": args.a, "b": args.b, "init": args.init, "num_traces": args.num_traces,
                      "trace_len": args.trace_len, "prompt_len": args.prompt_len, "full_vocab": args.full_vocab,
                      "elapsed_s": round(elapsed, 2), "seconds_a": round(result.seconds_a, 2),
                      "seconds_b": round(result.seconds_b, 2), "max_abs_delta": o.max_abs_delta,
                      "mean_abs_delta": o.mean_abs_delta, "argmax_agreement": o.argmax_agreement,
                      "mean_kl": o.mean_kl, "kl_method": result.kl_method}))


if __name__ == "__main__":
    main()
