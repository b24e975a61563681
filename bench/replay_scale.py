"""`replayllm replay` of W3 in a fresh process against Ray replicas: each kind's run time, engine share, ratio.

W3: 64 x 2,048-token traces after 64-token prompts, logprobs=5, the Qwen3-0.6B shape with dummy weights.
Prints one JSON line for the workload, then one per kind of run.

Usage (on a GPU machine):
    python bench/replay_scale.py --dp 1           # acceptance: 1 replica through Ray costs <= 5% vs in-process
    python bench/replay_scale.py --dp 1 2         # scaling on a 2-GPU machine (target >= 1.8x)
    python bench/replay_scale.py --tiny --num-prompts 32 --output-len 256 --threads 1   # the same on CPU
Options: --num-prompts 64 --input-len 64 --output-len 2048 --logprobs 5 --repeats 3 --output-json FILE.

What is compared: `ray_dpN` (a fresh driver process, a local Ray, N replica actors) against `in_process` (a
fresh process, one engine, no Ray), the median of --repeats runs each, after one untimed replay of the same
traces here has compiled every Triton kernel variant into Triton's disk cache. Both fresh: a process's first
replay pays first-use costs (kernels loaded from disk, allocator growth, lazy CUDA modules) that a process which
already replayed does not, so timing the baseline in the warm bench process (as this script first did) charged
them to Ray alone. `in_process_warm` (this process, already warm) is printed for reference. run_s: replaying and
writing (ReplayResult.run_seconds; engine start excluded); engine_s: of which the replicas' engines ran shards;
outside_s: the rest (reading traces, Ray's dispatch and transfers, merging, writing)."""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile

from replayllm.entrypoints.bench.workload import TOKEN_ID_RANGE, write_dummy_config
from replayllm.entrypoints.diff import TraceRecord, write_traces
from replayllm.entrypoints.distributed import replay

# --tiny: a 2-layer Qwen3 over 4,096 tokens (random weights) that replays W3's shapes on CPU in about a second.
TINY = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 4096, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False, "dtype": "float32",
        "bos_token_id": 1, "eos_token_id": 2}
TINY_TOKEN_ID_RANGE = (100, 4000)
RESULT = "REPLAY_SCALE_RESULT "  # a child's last stdout line: this prefix, then its run as JSON


def w3_traces(path: str, num_prompts: int, input_len: int, output_len: int, seed: int = 0,
              id_range: tuple[int, int] = TOKEN_ID_RANGE) -> None:
    lo, hi = id_range
    rng = random.Random(seed)
    write_traces(path, [TraceRecord(id=str(i), prompt_token_ids=[rng.randrange(lo, hi) for _ in range(input_len)],
                                    trace_token_ids=[rng.randrange(lo, hi) for _ in range(output_len)])
                        for i in range(num_prompts)])


def timed(traces: str, out: str, opts: dict, dp: int | None) -> dict:
    """One replay: through Ray with dp replicas (a local Ray started for it), or in this process (dp None)."""
    import torch

    ray = {} if dp is None else {"data_parallel_size": dp, "ray_address": "local"}
    r = replay(traces, out, **opts, **ray)
    return {"run_s": r.run_seconds, "engine_s": r.engine_seconds, "total_s": r.seconds, "tokens": r.num_tokens,
            "torch_threads": torch.get_num_threads() if dp is None else None}  # a replica's are its own


def in_child(traces: str, out: str, opts: dict, dp: int | None, threads: int | None) -> dict:
    """timed() in a fresh Python process (OMP_NUM_THREADS=threads there and in its replicas, when given)."""
    env = dict(os.environ)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    spec = json.dumps({"traces": traces, "out": out, "opts": opts, "dp": dp})
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", spec], env=env, text=True,
                          stdout=subprocess.PIPE)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    sys.stderr.write("".join(line + "\n" for line in done.stdout.splitlines() if not line.startswith(RESULT)))
    if done.returncode or not lines:
        raise RuntimeError(f"the timed run (dp={dp}) failed with exit status {done.returncode}")
    return json.loads(lines[-1][len(RESULT):])


def summary(runs: list[dict]) -> dict:
    """The median of each time over the repeats (outside_s: run_s - engine_s of the same run), every run_s."""
    for r in runs:
        r["outside_s"] = r["run_s"] - r["engine_s"]
    out = {key: statistics.median(r[key] for r in runs) for key in ("run_s", "engine_s", "outside_s", "total_s")}
    out.update(tokens=runs[0]["tokens"], torch_threads=runs[0]["torch_threads"],
               run_s_all=[round(r["run_s"], 4) for r in runs])
    out["tok_per_s"] = out["tokens"] / out["run_s"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dp", type=int, nargs="+", default=[1], help="replica counts to run through Ray")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=2048)
    parser.add_argument("--logprobs", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each kind (medians are reported)")
    parser.add_argument("--threads", type=int, default=None,
                        help="OMP_NUM_THREADS of the timed processes and their replicas (default: unset; Ray then "
                             "gives each replica 1 thread, the in-process engine torch's default)")
    parser.add_argument("--tiny", action="store_true", help="a tiny random model on CPU instead of Qwen3-0.6B dummy")
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: one timed run, JSON spec
    args = parser.parse_args()
    if args.child is not None:
        spec = json.loads(args.child)
        print(RESULT + json.dumps(timed(spec["traces"], spec["out"], spec["opts"], spec["dp"])), flush=True)
        return
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    tmp = tempfile.mkdtemp(prefix="replay-scale-")
    id_range = TINY_TOKEN_ID_RANGE if args.tiny else TOKEN_ID_RANGE
    if args.tiny:
        model = os.path.join(tmp, "model")
        os.makedirs(model)
        with open(os.path.join(model, "config.json"), "w") as f:
            json.dump(TINY, f)
    else:
        model = write_dummy_config(os.path.join(tmp, "model"))
    traces = os.path.join(tmp, "w3.jsonl")
    w3_traces(traces, args.num_prompts, args.input_len, args.output_len, id_range=id_range)
    opts = dict(model=model, logprobs=args.logprobs, load_format="dummy", skip_tokenizer_init=True,
                max_model_len=args.input_len + args.output_len)
    if args.tiny:
        opts.update(device="cpu", dtype="float32")
    out = os.path.join(tmp, "out.parquet")
    if args.threads is not None:  # in_process_warm runs here: the same threads as the timed processes
        import torch

        torch.set_num_threads(args.threads)
    timed(traces, out, opts, None)  # untimed: every kernel variant the timed runs meet lands in the disk cache
    raw: dict[str, list[dict]] = {f"ray_dp{dp}": [] for dp in args.dp}
    raw["in_process"] = []
    for _ in range(args.repeats):  # the kinds alternate, so a drift of the machine shows in all of them alike
        for dp in args.dp:  # Ray first: no in-process engine holds GPU memory then (each child frees its own)
            raw[f"ray_dp{dp}"].append(in_child(traces, out, opts, dp, args.threads))
        raw["in_process"].append(in_child(traces, out, opts, None, args.threads))
    raw["in_process_warm"] = [timed(traces, out, opts, None) for _ in range(args.repeats)]
    runs = {name: summary(r) for name, r in raw.items()}
    base = runs["in_process"]["run_s"]
    for run in runs.values():
        run["vs_in_process"] = run["run_s"] / base  # 1 replica: the Ray cost; N replicas: 1 / speed-up
    result = {"workload": {k: v for k, v in vars(args).items() if k != "child"}, "runs": runs}
    print(json.dumps(result["workload"]))
    for name, run in runs.items():  # one line each: gpu_check.sh keeps the output's tail
        print(json.dumps({name: {k: round(v, 4) if isinstance(v, float) else v for k, v in run.items()}}))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
