"""`replayllm replay` on W3 (64 x 2,048-token traces, logprobs=5, Qwen3-0.6B shape, dummy weights): one engine in
this process vs Ray replicas; prints JSON with each run's replay time and the ratios.

Usage (on a GPU machine, from outside the repository root):
    python bench/replay_scale.py --dp 1           # acceptance: 1 replica through Ray costs <= 5% vs in-process
    python bench/replay_scale.py --dp 1 2         # scaling on a 2-GPU machine (target >= 1.8x)
Options: --num-prompts 64 --input-len 64 --output-len 2048 --logprobs 5 --output-json FILE."""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile

from replayllm.diff import TraceRecord, write_traces
from replayllm.distributed import replay
from replayllm.entrypoints.bench.workload import TOKEN_ID_RANGE, write_dummy_config


def w3_traces(path: str, num_prompts: int, input_len: int, output_len: int, seed: int = 0) -> None:
    lo, hi = TOKEN_ID_RANGE
    rng = random.Random(seed)
    write_traces(path, [TraceRecord(id=str(i), prompt_token_ids=[rng.randrange(lo, hi) for _ in range(input_len)],
                                    trace_token_ids=[rng.randrange(lo, hi) for _ in range(output_len)])
                        for i in range(num_prompts)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dp", type=int, nargs="+", default=[1], help="replica counts to run through Ray")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=2048)
    parser.add_argument("--logprobs", type=int, default=5)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    tmp = tempfile.mkdtemp(prefix="replay-scale-")
    model = write_dummy_config(os.path.join(tmp, "model"))
    traces, warm = os.path.join(tmp, "w3.jsonl"), os.path.join(tmp, "warm.jsonl")
    w3_traces(traces, args.num_prompts, args.input_len, args.output_len)
    w3_traces(warm, args.num_prompts, args.input_len, min(8, args.output_len), seed=1)
    opts = dict(model=model, logprobs=args.logprobs, load_format="dummy", skip_tokenizer_init=True,
                max_model_len=args.input_len + args.output_len)
    out = os.path.join(tmp, "out.parquet")
    replay(warm, out, **opts)  # first-use costs (Triton compiles, written to its disk cache) out of the timed runs
    runs = {}
    for dp in args.dp:  # Ray first: the in-process engine of the baseline is not holding GPU memory then
        r = replay(traces, out, data_parallel_size=dp, ray_address="local", **opts)
        runs[f"ray_dp{dp}"] = {"run_s": r.run_seconds, "total_s": r.seconds, "tokens": r.num_tokens}
    r = replay(traces, out, **opts)
    runs["in_process"] = {"run_s": r.run_seconds, "total_s": r.seconds, "tokens": r.num_tokens}
    base = runs["in_process"]["run_s"]
    for run in runs.values():
        run["tok_per_s"] = run["tokens"] / run["run_s"]
        run["vs_in_process"] = run["run_s"] / base  # 1 replica: the Ray cost; N replicas: 1 / speed-up
    result = {"workload": vars(args), "runs": runs}
    print(json.dumps(result, indent=2))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
