"""`replayllm bench latency`: time to first token and time per output token of a small batch (default: one
request, 128 in / 512 out), stepping the engine directly so every token's arrival is seen."""

from __future__ import annotations

import argparse
import json
import statistics
import time

from ...kernels import jit_watch
from .roofline import ModelCost, ceilings_note, device_ceilings
from .workload import Workload, check_output_path


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-size", type=int, default=1, help="requests sent together")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens per request (default: 128)")
    parser.add_argument("--output-len", type=int, default=512, help="tokens generated per request (default: 512)")
    parser.add_argument("--num-iters", type=int, default=5, help="timed runs (medians are reported)")
    parser.add_argument("--num-iters-warmup", type=int, default=1, help="untimed runs first (default: 1)")
    parser.add_argument("--output-json", default=None, help="write the result as JSON here")


def vllm_percentiles(values: list[float]) -> dict[str, float]:
    """vLLM's latency percentiles (10, 25, 50, 75, 90, 99; numpy's linear interpolation), keyed as strings."""
    ordered = sorted(values)

    def at(q: float) -> float:
        pos = (len(ordered) - 1) * q / 100
        lo = int(pos)
        hi = min(lo + 1, len(ordered) - 1)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)

    return {str(q): at(q) for q in (10, 25, 50, 75, 90, 99)}


def time_one_batch(engine, prompts, params, tag: str) -> tuple[float, float, float]:
    """(seconds to the first token, mean seconds per later token, total seconds) for one batch, from token
    arrival times seen after each engine step (DELTA outputs)."""
    from ...sampling_params import RequestOutputKind

    start = time.perf_counter()
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        p = p.clone()
        p.output_kind = RequestOutputKind.DELTA
        engine.add_request(f"{tag}-{i}", prompt, p)
    first, arrivals = None, 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        new = sum(len(o.outputs[0].token_ids) for o in outs)
        if new and first is None:
            first = time.perf_counter()
        arrivals += new
    end = time.perf_counter()
    per_token_steps = max(1, arrivals // len(prompts) - 1)
    return first - start, (end - first) / per_token_steps, end - start


def main(args: argparse.Namespace, engine_kwargs: dict) -> int:
    from ..llm import LLM
    from .workload import write_dummy_config

    for flag, value, least in (("--batch-size", args.batch_size, 1), ("--input-len", args.input_len, 1),
                               ("--output-len", args.output_len, 1), ("--num-iters", args.num_iters, 1),
                               ("--num-iters-warmup", args.num_iters_warmup, 0)):
        if value < least:  # checked before the engine is built, naming the flag
            raise ValueError(f"{flag} must be >= {least}, got {value}")
    if args.output_json:
        check_output_path("--output-json", args.output_json)
    kwargs = dict(engine_kwargs)
    model = args.model
    kwargs["skip_tokenizer_init"] = True  # token-id prompts: no tokenizer needed
    if model is None:  # the Qwen3-0.6B shape with dummy weights
        model, kwargs["load_format"] = write_dummy_config(), "dummy"
    llm = LLM(model, **kwargs)
    engine = llm.llm_engine
    workload = Workload(args.batch_size, args.input_len, args.output_len)
    prompts, params = workload.requests(engine.model_config.vocab_size)
    for i in range(args.num_iters_warmup):
        time_one_batch(engine, prompts, params, f"warm{i}")
    late0 = len(jit_watch.late_variants())
    runs = [time_one_batch(engine, prompts, params, f"run{i}") for i in range(args.num_iters)]
    late = jit_watch.late_variants()[late0:]  # Triton variants first met inside the timed runs
    ttft = statistics.median(r[0] for r in runs)
    tpot = statistics.median(r[1] for r in runs)
    total = statistics.median(r[2] for r in runs)
    cost = ModelCost.of_engine(engine)
    context = args.batch_size * (args.input_len + args.output_len // 2)  # mean context over the decode steps
    ceilings = device_ceilings(engine.config.torch_device)  # the GPU's own: an H100's floor is not an H200's
    floor_tpot = cost.step_seconds(context, ceilings, batch=args.batch_size)
    from ...kernels import append_sampled, gemv, layer_norm, pdl  # switches reported with the options

    cfg = engine.config
    result = {"bench": "latency", "model": args.model or "qwen3-0.6b (dummy weights)", "batch_size": args.batch_size,
              "input_len": args.input_len, "output_len": args.output_len, "num_iters": args.num_iters,
              "median_ttft_ms": 1000 * ttft, "median_tpot_ms": 1000 * tpot, "median_latency_s": total,
              # vLLM's `bench latency --output-json` names: each timed run's whole-batch seconds
              "avg_latency": statistics.mean(r[2] for r in runs), "latencies": [r[2] for r in runs],
              "percentiles": vllm_percentiles([r[2] for r in runs]),
              "roofline_tpot_ms": 1000 * floor_tpot, "roofline_fraction": floor_tpot / tpot,
              "roofline_ceilings": ceilings.as_dict(),
              "late_kernel_variants": len(late), "late_kernels": late,
              "options": {"cuda_graphs": cfg.use_cuda_graphs,
                          "cudagraph_mode": cfg.cudagraph_mode if cfg.use_cuda_graphs else "NONE",
                          "async_scheduling": cfg.async_scheduling,
                          "attention_backend": cfg.attention_backend, "max_model_len": cfg.max_model_len,
                          "batch_invariant": cfg.batch_invariant, "gemv": gemv.ENABLED,
                          "pdl": pdl.ENABLED,
                          "append_kernel": append_sampled.ENABLED, "layer_norm_kernel": layer_norm.ENABLED}}
    print(f"latency {args.batch_size} x ({args.input_len} in + {args.output_len} out): TPOT "
          f"{result['median_tpot_ms']:.2f} ms ({100 * result['roofline_fraction']:.0f}% of the "
          f"{result['roofline_tpot_ms']:.2f} ms roofline{ceilings_note(result)}), "
          f"TTFT {result['median_ttft_ms']:.1f} ms, "
          f"whole request {total:.2f} s (medians of {args.num_iters})"
          + (f"; WARNING: {len(late)} Triton kernel variant(s) first met inside the timed runs" if late else ""))
    print(json.dumps(result))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    engine.shutdown()
    return 0
