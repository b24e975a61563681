"""`replayllm bench throughput`: offline throughput of one workload through `LLM.generate`, optionally beside
transformers' `generate` on the same weights in the same process, with the run's roofline fraction."""

from __future__ import annotations

import argparse
import json
import time

from ...kernels import jit_watch
from .roofline import ModelCost, ceilings_note, device_ceilings
from .workload import Workload, check_output_path


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, default=256, help="requests in the run (default: 256)")
    # vLLM's throughput takes --input-len and, with its random dataset, --random-input-len: both spellings here
    parser.add_argument("--input-len", "--random-input-len", type=int, default=256, dest="input_len",
                        help="prompt tokens per request")
    parser.add_argument("--output-len", "--random-output-len", type=int, default=256, dest="output_len",
                        help="generated (or replayed) tokens per request")
    parser.add_argument("--dataset-name", default="random", choices=["random"],
                        help="prompts: random token ids (vLLM's random dataset; the only one)")
    parser.add_argument("--trace", action="store_true", help="every request replays a random trace of "
                                                             "output-len tokens (needs --enable-trace-replay)")
    parser.add_argument("--logprobs", type=int, default=None, help="logprobs per token (default: 1 with --trace)")
    parser.add_argument("--seed-workload", type=int, default=0, help="seed of the random prompts and traces")
    parser.add_argument("--compare-hf", action="store_true",
                        help="also time transformers' generate (greedy, same prompts) on the same weights, first, "
                             "in this process; without a MODEL the dummy config gets random weights saved to a "
                             "temporary folder that both load")
    parser.add_argument("--output-json", default=None, help="write the result as JSON here")


WARM_UP_SEED_OFFSET = 1  # run_engine's warm-up draws its prompts from the workload's seed + this


def unseen_workload(workload: Workload) -> Workload:
    """The workload drawn from a seed neither run_engine's warm-up nor its timed run used: prompts that miss the
    prefix cache after run_engine (a later run of the seed + 1 prompts would find all but each prompt's last
    partial block cached and skip almost all of its prefill)."""
    import dataclasses

    return dataclasses.replace(workload, seed=workload.seed + WARM_UP_SEED_OFFSET + 1)


def run_engine(llm, workload: Workload, chunk_size: int | None = None) -> dict:
    """Warm up, then time one `generate` over the whole workload. The warm-up runs every request's shape (other
    random prompts, so the prefix cache stays cold; at most 4 output tokens, or with a trace one fast-replay
    chunk more, so the full-batch lookahead steps run too), so first-use costs (Triton compiles for new shape
    classes, allocator growth for [tokens, vocab] logits) stay out of the timed run. chunk_size: every trace
    request's own trace_replay_chunk_size (None: the engine's)."""
    vocab = llm.llm_engine.model_config.vocab_size
    prompts, params = _with_chunk(workload.requests(vocab), chunk_size)
    chunk = (chunk_size or llm.llm_engine.config.trace_replay_chunk_size) if workload.trace else 0
    warm = Workload(workload.num_prompts, workload.input_len, min(workload.output_len, 4 + chunk), workload.trace,
                    workload.logprobs, workload.seed + WARM_UP_SEED_OFFSET)
    llm.generate(*_with_chunk(warm.requests(vocab), chunk_size), use_tqdm=False)
    engine = llm.llm_engine
    steps0, late0 = engine.num_steps, len(jit_watch.late_variants())
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    late = jit_watch.late_variants()[late0:]  # Triton variants first met inside the timed run (kernels/jit_watch.py)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    if n_out != workload.num_prompts * workload.output_len:
        raise RuntimeError(f"the run produced {n_out} tokens, expected {workload.num_prompts * workload.output_len}")
    n_in = sum(len(p["prompt_token_ids"]) for p in prompts)
    return {"elapsed_s": elapsed, "output_tokens": n_out, "steps": engine.num_steps - steps0,
            "output_tok_per_s": n_out / elapsed, "late_kernel_variants": len(late), "late_kernels": late,
            # vLLM's `bench throughput --output-json` names, for scripts that parse its files
            "elapsed_time": elapsed, "num_requests": len(prompts), "total_num_tokens": n_in + n_out,
            "requests_per_second": len(prompts) / elapsed, "tokens_per_second": (n_in + n_out) / elapsed}


def _with_chunk(requests: tuple[list, list], chunk_size: int | None) -> tuple[list, list]:
    prompts, params = requests
    if chunk_size is None:
        return prompts, params
    out = []
    for p in params:
        p = p.clone()
        p.trace_replay_chunk_size = chunk_size
        out.append(p)
    return prompts, out


def other_replay_mode(engine_chunk_size: int) -> int:
    """The chunk size a trace run is also timed with: fast replay beside one-token replay and the reverse, so a
    trace figure always comes with both (one-token replay is the default: bitwise the sampling-time logprobs)."""
    from ...config import FAST_REPLAY_CHUNK_SIZE

    return FAST_REPLAY_CHUNK_SIZE if engine_chunk_size == 1 else 1


def run_hf(model_dir: str, workload: Workload, device: str) -> dict:
    """transformers' greedy `generate` over the same prompts, all in one batch (equal lengths: no padding),
    exactly output_len new tokens each."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto").to(device).eval()
    result = time_hf_generate(model, workload, device)
    del model
    _free_device_cache(device)  # the engine built next sizes its KV cache from the free memory
    return result


def time_hf_generate(model, workload: Workload, device: str) -> dict:
    """Time a built transformers model's greedy `generate` over the workload's prompts in one batch (equal lengths:
    no padding; exactly output_len new tokens each), after a small warm-up."""
    import torch

    prompts, _ = workload.requests(model.config.vocab_size)
    ids = torch.tensor([p["prompt_token_ids"] for p in prompts], device=device)

    def generate(x: torch.Tensor, n: int, model=model) -> torch.Tensor:
        return model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=0)

    with torch.inference_mode():
        generate(ids[:4], 4)  # warm-up
        _sync(device)
        start = time.perf_counter()
        out = generate(ids, workload.output_len)
        _sync(device)
        elapsed = time.perf_counter() - start
    n_out = (out.shape[1] - ids.shape[1]) * out.shape[0]
    return {"elapsed_s": elapsed, "output_tokens": n_out, "output_tok_per_s": n_out / elapsed}


def _free_device_cache(device: str) -> None:
    import gc

    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def save_random_weights(config_dir: str, dtype: str) -> None:
    """Random weights for a config-only folder (transformers' own init), saved as safetensors in place."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(config_dir)
    torch_dtype = getattr(torch, dtype) if dtype != "auto" else getattr(cfg, "dtype", None) or torch.float32
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch_dtype)
    model.save_pretrained(config_dir)
    del model


def build(args: argparse.Namespace, engine_kwargs: dict):
    """(LLM, Workload, transformers result or None) for parsed `bench throughput` arguments. With --compare-hf
    transformers runs first (then frees its memory), so the engine sizes its KV cache on a clean device."""
    from ..llm import LLM
    from .workload import write_dummy_config

    workload = Workload(args.num_prompts, args.input_len, args.output_len, args.trace, args.logprobs,
                        args.seed_workload)
    kwargs = dict(engine_kwargs)
    model = args.model
    kwargs["skip_tokenizer_init"] = True  # token-id prompts: no tokenizer needed
    if model is None:  # the Qwen3-0.6B shape
        model = write_dummy_config()
        if not args.compare_hf:
            kwargs["load_format"] = "dummy"
    if args.trace:
        kwargs["enable_trace_replay"] = True
    hf = None
    if args.compare_hf:
        if args.model is None:
            save_random_weights(model, kwargs.get("dtype", "auto"))
        import torch

        device = kwargs.get("device", "auto")
        device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
        hf = run_hf(model, workload, device)
    return LLM(model, **kwargs), workload, hf


def main(args: argparse.Namespace, engine_kwargs: dict) -> int:
    if args.output_json:
        check_output_path("--output-json", args.output_json)  # before the run: its numbers are not lost after
    llm, workload, hf = build(args, engine_kwargs)
    result: dict = {"bench": "throughput", "model": args.model or "qwen3-0.6b (dummy weights)",
                    "num_prompts": workload.num_prompts, "input_len": workload.input_len,
                    "output_len": workload.output_len, "trace": workload.trace, "logprobs": workload.num_logprobs}
    if hf is not None:
        result["hf"] = hf
    cfg = llm.llm_engine.config
    result.update(run_engine(llm, workload))
    if workload.trace:  # the same traces in the other replay mode, same process (cold prompts: new seed)
        other = other_replay_mode(cfg.trace_replay_chunk_size)
        again = Workload(workload.num_prompts, workload.input_len, workload.output_len, True, workload.logprobs,
                         workload.seed + 2)
        result["other_replay_mode"] = {"trace_replay_chunk_size": other, **run_engine(llm, again, other)}
    from ...kernels import append_sampled, gemv, layer_norm, pdl  # switches reported with the options
    from ...model_runner_v2 import attention

    result["options"] = {"dtype": str(cfg.model_config.dtype).replace("torch.", ""), "device": cfg.device,
                         "attention_backend": cfg.attention_backend, "cuda_graphs": cfg.use_cuda_graphs,
                         "cudagraph_mode": cfg.cudagraph_mode if cfg.use_cuda_graphs else "NONE",
                         "async_scheduling": cfg.async_scheduling, "max_model_len": cfg.max_model_len,
                         "max_num_batched_tokens": cfg.max_num_batched_tokens, "max_num_seqs": cfg.max_num_seqs,
                         "tensor_parallel_size": cfg.tensor_parallel_size, "quantization": cfg.quantization,
                         "kv_cache_dtype": cfg.kv_cache_dtype,
                         "trace_replay_chunk_size": cfg.trace_replay_chunk_size,
                         "batch_invariant": cfg.batch_invariant, "gemv": gemv.ENABLED,
                         "pdl": pdl.ENABLED,
                         "append_kernel": append_sampled.ENABLED, "layer_norm_kernel": layer_norm.ENABLED,
                         "split_mixed_attention": attention.SPLIT_MIXED}
    ceilings = device_ceilings(cfg.torch_device)  # the GPU's own: an H100's floor is not an H200's
    floor = ModelCost.of_engine(llm.llm_engine).run_seconds(workload.num_prompts, workload.input_len,
                                                           workload.output_len, ceilings)
    result["roofline_ceilings"] = ceilings.as_dict()
    result["roofline_output_tok_per_s"] = result["output_tokens"] / floor
    result["roofline_fraction"] = floor / result["elapsed_s"]
    if "hf" in result:
        result["speedup_vs_hf"] = result["output_tok_per_s"] / result["hf"]["output_tok_per_s"]
    print(format_summary(result))
    print(json.dumps(result))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    llm.llm_engine.shutdown()
    return 0


def format_summary(r: dict) -> str:
    what = f"{r['num_prompts']} x ({r['input_len']} in + {r['output_len']} out)"
    what += (f", trace (chunk {r['options']['trace_replay_chunk_size']}), logprobs={r['logprobs']}" if r["trace"] else
        f", greedy, logprobs={r['logprobs']}" if r["logprobs"] is not None else ", greedy")
    line = (f"throughput {what}: {r['output_tok_per_s']:,.0f} out tok/s in {r['elapsed_s']:.2f} s "
            f"({100 * r['roofline_fraction']:.0f}% of the {r['roofline_output_tok_per_s']:,.0f} tok/s roofline"
            f"{ceilings_note(r)})")
    if "other_replay_mode" in r:
        o = r["other_replay_mode"]
        line += (f"; chunk {o['trace_replay_chunk_size']}: {o['output_tok_per_s']:,.0f} out tok/s in "
                 f"{o['elapsed_s']:.2f} s")
    if "hf" in r:
        line += (f"; transformers generate {r['hf']['output_tok_per_s']:,.0f} out tok/s "
                 f"({r['speedup_vs_hf']:.1f}x)")
    late = r.get("late_kernel_variants", 0) + r.get("other_replay_mode", {}).get("late_kernel_variants", 0)
    if late:
        line += f"; WARNING: {late} Triton kernel variant(s) first met inside the timed run (compiled there)"
    return line
