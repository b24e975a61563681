"""Cold start: start-up time and the user's first run against the second, with every Triton compile counted.

One process: build the engine (the Qwen3-0.6B shape, dummy bf16 weights), then run W1 (256 x (256 in + 256 out),
greedy) twice with other random prompts, with no benchmark warm-up in between. Triton's jit_cache_hook records
each kernel variant a phase needed for the first time in this process (compiled, or loaded from the on-disk
cache). Run it with TRITON_CACHE_DIR pointing at an empty folder to see what a fresh machine meets, then again
with the same folder for a later process.

Usage (device): python bench/cold_start.py [--no-warm-up] [--batch-invariant] [--output-json F]
  --no-warm-up: skip the engine's start-up warm-up (engine/warm_up.py): the "before" of issue 28 item 4.
  --batch-invariant: the engine in batch-invariant mode (its own kernels: docs/batch_invariance.md).
Prints one JSON line: startup_s and its parts (startup_phases_s), run1_s, run2_s, run1_over_run2, new kernel
variants per phase (names for run1; the 25 kernels with the most start-up variants).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import Counter

import triton

PHASE = ["import"]
VARIANTS: list[tuple[str, str]] = []  # (phase, kernel name)
MISSED: list[str] = []  # run1's variants, in full


def _record(**hook_args) -> bool:
    """Triton's jit_cache_hook: called once per new kernel variant of this process, before it compiles."""
    VARIANTS.append((PHASE[0], hook_args["fn"].name))
    if PHASE[0] == "run1":  # what start-up missed: the variant's constants and specialisations
        MISSED.append(str(hook_args.get("repr", ""))[:400])
    return False  # go on compiling


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-warm-up", action="store_true")
    ap.add_argument("--batch-invariant", action="store_true")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    triton.knobs.runtime.jit_cache_hook = _record

    import torch

    from replayllm import LLM
    from replayllm.engine import llm_engine
    from replayllm.entrypoints.bench.workload import Workload, write_dummy_config

    if args.no_warm_up:
        llm_engine.warm_up = lambda engine: None
    phases = _time_phases()
    PHASE[0] = "startup"
    start = time.perf_counter()
    llm = LLM(write_dummy_config(), load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
              batch_invariant=args.batch_invariant)
    torch.cuda.synchronize()
    result = {"warm_up": not args.no_warm_up, "batch_invariant": args.batch_invariant,
              "triton_cache_dir": os.environ.get("TRITON_CACHE_DIR"),
              "startup_s": time.perf_counter() - start, "startup_phases_s": dict(phases)}
    vocab = llm.llm_engine.model_config.vocab_size
    for run in (1, 2):
        PHASE[0] = f"run{run}"
        prompts, params = Workload(args.num_prompts, args.input_len, args.output_len, seed=run).requests(vocab)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        result[f"run{run}_s"] = time.perf_counter() - start
        assert sum(len(o.outputs[0].token_ids) for o in outs) == args.num_prompts * args.output_len
    result["run1_over_run2"] = result["run1_s"] / result["run2_s"]
    result["output_tok_per_s"] = {f"run{r}": args.num_prompts * args.output_len / result[f"run{r}_s"]
                                  for r in (1, 2)}
    for phase in ("startup", "run1", "run2"):
        result[f"new_variants_{phase}"] = sum(p == phase for p, _ in VARIANTS)
    by_kernel = Counter(name for p, name in VARIANTS if p == "startup")
    result["startup_variants_by_kernel"] = dict(by_kernel.most_common(25))  # where start-up's compiles go
    result["run1_variants"] = sorted({name for p, name in VARIANTS if p == "run1"})
    result["run1_variant_reprs"] = MISSED
    llm.shutdown()
    print(json.dumps(result))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)


def _time_phases() -> dict[str, float]:
    """Wall seconds of start-up's parts (filled as they run): the weights, compile-ahead of the eager steps,
    the two graph captures (each with its own compile-ahead), the warm-up."""
    from replayllm.engine import llm_engine
    from replayllm.model_runner_v2 import cuda_graph, model_runner, piecewise_graph

    times: dict[str, float] = {}

    def timed(owner, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                times[label] = times.get(label, 0.0) + time.perf_counter() - start

        setattr(owner, name, wrapper)

    timed(model_runner, "load_model", "load_model")
    timed(model_runner, "compile_eager_steps", "compile_eager_steps")
    timed(cuda_graph.CudaGraphRunner, "_capture_all", "decode_graphs")
    timed(piecewise_graph.PiecewiseGraphRunner, "_capture_all", "piecewise_graphs")
    timed(llm_engine, "warm_up", "warm_up")
    return times


if __name__ == "__main__":
    main()
