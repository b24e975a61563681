"""Qwen3-30B-A3B-shaped MoE on one GPU (issue 30): throughput, per-token latency, the routed-experts capture's cost,
and transformers' generate, in one process (dummy bf16 weights: the public config's shapes, no checkpoint).

Parts, one JSON line each (and all in --output-json), in this order:
  hf      the engine on --hf-prompts x (--input-len in, --hf-output-len out) greedy, and at the very end
          transformers' Qwen3MoeForCausalLM (random init on the GPU, bf16) `generate` of the same prompts;
  W1      the engine, --num-prompts x (--input-len + --output-len) greedy (W1's shape), routes off;
  W4      one request, 128 in / 512 out: median time per output token (TPOT) over 3 runs;
  routes  W1 on four fresh engines, enable_return_routed_experts off, on, off, on (the capture's cost as the ratio of
          the means; the two runs of each show the spread between engines).
Each engine figure comes with its roofline (entrypoints/bench/roofline.py: a decode step reads the dense weights and
the share of the experts its tokens hit; a prefill token costs its k experts' FLOPs).

Usage (device): python bench/moe_bench.py [--parts hf,W1,W4,routes] [--num-layers 48] [--output-json F]
(--num-layers 2 --device cpu --dtype float32 --num-prompts 2 --input-len 8 --output-len 4 checks it on a CPU.)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time

import torch

from replayllm import LLM
from replayllm.entrypoints.bench.latency import time_one_batch
from replayllm.entrypoints.bench.roofline import ModelCost, device_ceilings
from replayllm.entrypoints.bench.throughput import run_engine, time_hf_generate
from replayllm.entrypoints.bench.workload import Workload

# Qwen3-30B-A3B's config.json (public; the fields the engine and transformers read).
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
    "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
    "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
    "tie_word_embeddings": False, "attention_bias": False, "bos_token_id": 151643, "eos_token_id": 151645,
    "torch_dtype": "bfloat16", "dtype": "bfloat16",
}


def write_config(num_layers: int) -> str:
    path = tempfile.mkdtemp(prefix="qwen3-30b-a3b-dummy-")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**QWEN3_30B_A3B, "num_hidden_layers": num_layers}, f)
    return path


def run_hf(path: str, workload: Workload, device: str, dtype: torch.dtype) -> dict:
    """transformers' greedy generate over the workload's prompts in one batch (random init on the device)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(path)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    experts = getattr(cfg, "_experts_implementation", None) or getattr(cfg, "experts_implementation", None)
    result = time_hf_generate(model, workload, device)
    del model
    gc.collect()
    return {"part": "hf", "prompts": workload.num_prompts, "input_len": workload.input_len,
            "output_len": workload.output_len, **result, "experts_implementation": experts}


def engine(path: str, args: argparse.Namespace, routes: bool) -> LLM:
    start = time.perf_counter()
    llm = LLM(path, load_format="dummy", dtype=args.dtype, device=args.device, skip_tokenizer_init=True,
              max_model_len=args.max_model_len, enable_return_routed_experts=routes)
    cfg = llm.llm_engine.config
    print(json.dumps({"part": "start-up", "routes": routes, "seconds": time.perf_counter() - start,
                      "cudagraph_mode": cfg.cudagraph_mode if cfg.use_cuda_graphs else "NONE"}), flush=True)
    return llm


def throughput(llm: LLM, workload: Workload, name: str) -> dict:
    result = run_engine(llm, workload)
    cost = ModelCost.of_engine(llm.llm_engine)
    ceilings = device_ceilings(llm.llm_engine.config.torch_device)
    floor = cost.run_seconds(workload.num_prompts, workload.input_len, workload.output_len, ceilings)
    return {"part": name, "prompts": workload.num_prompts, "input_len": workload.input_len,
            "output_len": workload.output_len, **result, "roofline_output_tok_per_s": result["output_tokens"] / floor,
            "roofline_fraction": floor / result["elapsed_s"], "roofline_ceilings": ceilings.as_dict()}


def latency(llm: LLM, input_len: int, output_len: int) -> dict:
    eng = llm.llm_engine
    prompts, params = Workload(1, input_len, output_len).requests(eng.model_config.vocab_size)
    time_one_batch(eng, prompts, params, "warm")
    runs = [time_one_batch(eng, prompts, params, f"run{i}") for i in range(3)]
    tpot = statistics.median(r[1] for r in runs)
    ceilings = device_ceilings(eng.config.torch_device)
    floor = ModelCost.of_engine(eng).step_seconds(input_len + output_len // 2, ceilings, batch=1)
    return {"part": "W4", "input_len": input_len, "output_len": output_len, "median_tpot_ms": 1000 * tpot,
            "median_ttft_ms": 1000 * statistics.median(r[0] for r in runs), "roofline_tpot_ms": 1000 * floor,
            "roofline_fraction": floor / tpot, "roofline_ceilings": ceilings.as_dict()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="hf,W1,W4,routes")
    ap.add_argument("--num-layers", type=int, default=48)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--hf-prompts", type=int, default=64)
    ap.add_argument("--hf-output-len", type=int, default=64)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    parts = args.parts.split(",")
    path = write_config(args.num_layers)
    results = []

    def emit(r: dict) -> None:
        results.append(r)
        print(json.dumps(r), flush=True)
        if args.output_json:  # after every part: a run cut short keeps what it measured
            with open(args.output_json, "w") as f:
                json.dump(results, f, indent=2)

    w1 = Workload(args.num_prompts, args.input_len, args.output_len)
    hf_shape = Workload(args.hf_prompts, args.input_len, args.hf_output_len)
    # The engine parts first (the figures that matter most), transformers last; each result is written as it comes.
    if {"hf", "W1", "W4"} & set(parts):
        llm = engine(path, args, routes=False)
        if "hf" in parts:
            emit(throughput(llm, hf_shape, "engine-on-hf-shape"))
        if "W1" in parts:
            emit(throughput(llm, w1, "W1"))
        if "W4" in parts:
            emit(latency(llm, 128, 512))
        llm.shutdown()
        del llm
        gc.collect()
    if "routes" in parts:  # off, on, off, on: engine-to-engine spread shows beside the capture's cost
        runs: dict[bool, list[float]] = {False: [], True: []}
        for routes in (False, True, False, True):
            llm = engine(path, args, routes=routes)
            r = throughput(llm, w1, "W1-routes" if routes else "W1-routes-off")
            runs[routes].append(r["output_tok_per_s"])
            emit(r)
            llm.shutdown()
            del llm
            gc.collect()
        emit({"part": "routes-cost", "tok_per_s_off": runs[False], "tok_per_s_on": runs[True],
              "throughput_ratio": statistics.mean(runs[True]) / statistics.mean(runs[False])})
    if "hf" in parts:
        hf = run_hf(path, hf_shape, args.device, getattr(torch, args.dtype))
        mine = next(r for r in results if r["part"] == "engine-on-hf-shape")
        emit({**hf, "engine_speedup": mine["output_tok_per_s"] / hf["output_tok_per_s"]})

if __name__ == "__main__":
    main()
