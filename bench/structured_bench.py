"""W1 with a JSON schema on every request ("W1-json") beside plain W1 in one process: the cost of structured outputs.

Usage (device): python3 bench/structured_bench.py [--num-prompts 256 --input-len 256 --output-len 256]
                 [--repeats 3] [--fill-threads N] [--output-json OUT/W1-json.json]
                 (bench/gpu_check.sh: BENCH_ONLY="W1-json")
Plain and JSON runs alternate --repeats times (single runs on the device host varied by +-20%); the pair with
the median JSON step time is reported, with every pair's ratio.
The Qwen3-0.6B shape with dummy weights and the embedded model's Qwen tokenizer (xgrammar needs a tokenizer).
Both runs are greedy, max_tokens = output-len; the plain run ignores EOS. A grammar may end a request early (its
tokens are counted as produced), so the comparison is output tok/s and the mean step time of each run; the
issue's target is W1-json >= 0.9x W1."""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import shutil
import time
from pathlib import Path

from replayllm import LLM, SamplingParams, StructuredOutputsParams
from replayllm.embedded_model import materialize
from replayllm.entrypoints.bench.roofline import ModelCost, device_ceilings
from replayllm.entrypoints.bench.workload import Workload, write_dummy_config

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "score": {"type": "number"},
                   "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "score", "tags"],
}


def warm_up(llm: LLM, params, warm_prompts) -> None:
    """The timed batch's shapes on other prompts, at most 4 tokens each (Triton compiles, grammar compiles)."""
    warm = []
    for p in params:
        w = p.clone()
        w.max_tokens = min(w.max_tokens, 4)
        warm.append(w)
    llm.generate(warm_prompts, warm, use_tqdm=False)


def _timed(llm: LLM, prompts, params, warm_prompts) -> dict:
    """One timed `generate`. The warm-up runs the whole batch's shapes on other prompts (at most 4 tokens each:
    Triton compiles, the grammar's compile) and the timed prompts are new to the prefix cache, so plain and JSON
    runs both pay their prefill."""
    engine = llm.llm_engine
    warm_up(llm, params, warm_prompts)
    steps0, overlapped0 = engine.num_steps, engine.num_overlapped_steps
    host0 = dataclasses.replace(engine.structured.workers.stats)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = engine.num_steps - steps0
    host = engine.structured.workers.stats
    # grammar_host: the host's time inside the grammar calls (GrammarWorkers: accept + fill, threads included)
    grammar_host = {"threads": engine.structured.workers.num_threads,
                    "fill_thread_pool_size": engine.structured.workers.fill_thread_pool_size,
                    "fill_ms_per_step": 1e3 * (host.fill_seconds - host0.fill_seconds) / max(steps, 1),
                    "accept_ms_per_step": 1e3 * (host.accept_seconds - host0.accept_seconds) / max(steps, 1),
                    # the engine thread blocked on a fill running on the fill thread (the rest of it overlapped)
                    "fill_wait_ms_per_step": 1e3 * (host.fill_wait_seconds - host0.fill_wait_seconds) / max(steps, 1),
                    "rows_filled_per_step": (host.fill_rows - host0.fill_rows) / max(steps, 1)}
    # overlapped_steps: launched before the previous step's results were processed (async scheduling)
    return {"elapsed_s": elapsed, "output_tokens": n_out, "steps": steps, "output_tok_per_s": n_out / elapsed,
            "overlapped_steps": engine.num_overlapped_steps - overlapped0,
            "ms_per_step": 1e3 * elapsed / max(steps, 1), "grammar_host": grammar_host,
            "finished_stop": sum(o.outputs[0].finish_reason == "stop" for o in outs)}


def workload_args(ap: argparse.ArgumentParser) -> None:
    """W1's shape and the engine's dtype / max_model_len (bench/host_phases.py takes the same)."""
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=None, help="default: the model's (40960)")


def qwen_dummy_llm(args: argparse.Namespace) -> LLM:
    """The dummy Qwen3-0.6B with the embedded model's Qwen tokenizer beside its config (xgrammar needs one)."""
    model = write_dummy_config()
    for f in glob.glob(materialize("replayllm/tiny-qwen3") + "/tokenizer*"):
        shutil.copy(f, model)
    extra = {} if args.max_model_len is None else {"max_model_len": args.max_model_len}
    return LLM(model, load_format="dummy", dtype=args.dtype, **extra)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    workload_args(ap)
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--repeats", type=int, default=3, help="plain/JSON pairs timed; the median pair is reported")
    ap.add_argument("--fill-threads", type=int, default=None,
                    help="xgrammar threads filling bitmasks beside the engine thread (async); default: the engine's")
    args = ap.parse_args()
    llm = qwen_dummy_llm(args)
    vocab = llm.llm_engine.model_config.vocab_size
    spec = StructuredOutputsParams(json=SCHEMA)
    if args.fill_threads is not None:
        from replayllm.engine.grammar_workers import GrammarWorkers

        workers = llm.llm_engine.structured.workers
        llm.llm_engine.structured.workers = GrammarWorkers(workers.num_threads, args.fill_threads)
    pairs = []
    for r in range(args.repeats):  # plain and JSON alternate, so a drift of the host shows in both alike
        # Four prompt sets a pair, from their own seeds: every timed run and warm-up meets a cold prefix cache.
        sets = [Workload(args.num_prompts, args.input_len, args.output_len, seed=4 * r + i).requests(vocab)
                for i in range(4)]
        (prompts, plain), (js_prompts, _), (warm1, _), (warm2, _) = sets
        structured = [SamplingParams(temperature=0, max_tokens=args.output_len, structured_outputs=spec)
                      for _ in js_prompts]
        pairs.append((_timed(llm, prompts, plain, warm1), _timed(llm, js_prompts, structured, warm2)))
    # The pair whose JSON run has the median step time (its own plain run beside it); every pair's ratio listed.
    base, js = sorted(pairs, key=lambda pair: pair[1]["ms_per_step"])[len(pairs) // 2]
    js["ratios_all"] = [round(b["ms_per_step"] / j["ms_per_step"], 3) for b, j in pairs]
    cfg = llm.llm_engine.config
    mean_out = max(1, round(js["output_tokens"] / args.num_prompts))
    ceilings = device_ceilings(cfg.torch_device)
    floor = ModelCost.of_engine(llm.llm_engine).run_seconds(args.num_prompts, args.input_len, mean_out, ceilings)
    result = {"bench": "throughput", "model": "qwen3-0.6b (dummy weights)", "num_prompts": args.num_prompts,
              "input_len": args.input_len, "output_len": mean_out, "trace": False, "logprobs": None,
              **js, "plain": base, "json_vs_plain_tok_per_s": js["output_tok_per_s"] / base["output_tok_per_s"],
              "json_vs_plain_ms_per_step": base["ms_per_step"] / js["ms_per_step"],
              "roofline_output_tok_per_s": js["output_tokens"] / floor, "roofline_fraction": floor / js["elapsed_s"],
              "roofline_ceilings": ceilings.as_dict(),
              "options": {"dtype": args.dtype, "device": cfg.device, "cuda_graphs": cfg.use_cuda_graphs,
                          "async_scheduling": cfg.async_scheduling, "structured_outputs": "json schema"}}
    print(f"W1 plain: {base['output_tok_per_s']:,.0f} out tok/s, {base['ms_per_step']:.2f} ms/step; "
          f"W1-json: {js['output_tok_per_s']:,.0f} out tok/s, {js['ms_per_step']:.2f} ms/step "
          f"({js['finished_stop']} of {args.num_prompts} grammars ended, {js['overlapped_steps']} of {js['steps']} "
          f"steps overlapped; grammar host work {js['grammar_host']['fill_ms_per_step']:.2f} ms fill + "
          f"{js['grammar_host']['accept_ms_per_step']:.2f} ms accept per step on "
          f"{js['grammar_host']['threads']} threads, the engine thread waiting "
          f"{js['grammar_host']['fill_wait_ms_per_step']:.2f} ms of the fill); "
          f"json/plain {result['json_vs_plain_tok_per_s']:.2f}x tok/s, {result['json_vs_plain_ms_per_step']:.2f}x "
          f"step rate (median of {args.repeats} pairs; every pair's step-rate ratio: {js['ratios_all']})")
    print(json.dumps(result))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2))
    llm.llm_engine.shutdown()


if __name__ == "__main__":
    main()
