"""Print `replayllm bench` JSON results (--output-json files) as one Markdown table with roofline fractions.

Usage: python bench/summarize.py RESULT.json [...]   (bench/gpu_check.sh calls it on its W1-W4 runs)"""

from __future__ import annotations

import json
import os
import sys


def row(name: str, r: dict) -> str:
    opts = r.get("options", {})
    graphs = {"FULL_DECODE_ONLY": "decode graphs", "PIECEWISE": "piecewise graphs"}.get(opts.get("cudagraph_mode"),
                                                                                       "graphs")
    mode = (graphs if opts.get("cuda_graphs") else "eager") + (" + async" if opts.get("async_scheduling") else "")
    mode += " + batch-invariant" if opts.get("batch_invariant") else ""
    mode += " + cuBLAS one-row steps (REPLAYLLM_GEMV=0)" if opts.get("gemv") is False else ""
    mode += " + no PDL (REPLAYLLM_PDL=0)" if opts.get("pdl") is False else ""
    mode += " + torch append (REPLAYLLM_APPEND_KERNEL=0)" if opts.get("append_kernel") is False else ""
    mode += " + torch LayerNorm (REPLAYLLM_LAYER_NORM_KERNEL=0)" if opts.get("layer_norm_kernel") is False else ""
    mode += " + mixed steps split (REPLAYLLM_SPLIT_MIXED_ATTENTION=1)" if opts.get("split_mixed_attention") else ""
    if r["bench"] == "latency":
        what = f"{r['batch_size']} x ({r['input_len']} in + {r['output_len']} out)"
        result = f"TPOT {r['median_tpot_ms']:.2f} ms, TTFT {r['median_ttft_ms']:.1f} ms"
        floor = f"{r['roofline_tpot_ms']:.2f} ms"
    else:
        what = f"{r['num_prompts']} x ({r['input_len']} in + {r['output_len']} out)"
        chunk = opts.get("trace_replay_chunk_size")
        what += (f", trace{f' (chunk {chunk})' if chunk else ''}, logprobs={r['logprobs']}") if r["trace"] else ""
        result = f"{r['output_tok_per_s']:,.0f} out tok/s ({r['elapsed_s']:.2f} s)"
        if "other_replay_mode" in r:  # a trace run timed in both replay modes
            o = r["other_replay_mode"]
            result += f"; chunk {o['trace_replay_chunk_size']}: {o['output_tok_per_s']:,.0f} ({o['elapsed_s']:.2f} s)"
        if "hf" in r:
            result += f"; transformers {r['hf']['output_tok_per_s']:,.0f} ({r['speedup_vs_hf']:.1f}x)"
        floor = f"{r['roofline_output_tok_per_s']:,.0f} tok/s"
    if "roofline_ceilings" in r:  # whose ceilings the floor used (entrypoints/bench/roofline.py)
        floor += f" ({r['roofline_ceilings']['device'].removeprefix('NVIDIA ')})"
    late = r.get("late_kernel_variants", 0) + r.get("other_replay_mode", {}).get("late_kernel_variants", 0)
    result += f"; **{late} Triton variant(s) compiled inside the timed run**" if late else ""
    return f"| {name} | {what} | {mode} | {result} | {floor} | {100 * r['roofline_fraction']:.0f}% |"


def invariant_ratio(results: dict[str, dict]) -> str | None:
    """`W1-inv` vs `W1` of the same call: the cost of batch_invariant=True (issue target: >= 0.6x)."""
    if "W1" not in results or "W1-inv" not in results:
        return None
    ratio = results["W1-inv"]["output_tok_per_s"] / results["W1"]["output_tok_per_s"]
    return f"batch_invariant=True / default on W1: {ratio:.2f}x"


def main(paths: list[str]) -> None:
    print("| run | workload | mode | result | roofline | fraction |")
    print("| --- | --- | --- | --- | --- | --- |")
    results = {}
    for path in paths:
        name = path.rsplit("/", 1)[-1].removesuffix(".json")
        if not os.path.exists(path):  # the row's run failed: its error is in the call's output, the table goes on
            print(f"| {name} | | | did not run (no {name}.json: see the log) | | |")
            continue
        with open(path) as f:
            r = json.load(f)
        results[name] = r
        print(row(name, r))
    ratio = invariant_ratio(results)
    if ratio:
        print(f"\n{ratio}")
    if "W1-json" in results:  # bench/structured_bench.py (issue target: >= 0.9x)
        r = results["W1-json"]
        print(f"\nJSON schema on every request / plain W1: {r['json_vs_plain_tok_per_s']:.2f}x out tok/s, "
              f"{r['json_vs_plain_ms_per_step']:.2f}x step rate")


if __name__ == "__main__":
    main(sys.argv[1:])
