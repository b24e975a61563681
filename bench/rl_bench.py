"""The RL loop's costs on one GPU (issue 29): load_weights, sleep/wake, and a trainer colocated with the engine.

Model: the Qwen3-0.6B shape (dummy weights), engine in bf16. Three parts, one JSON line each (and all in
--output-json):
  load   LLM.load_weights of the whole model (1.2 GB bf16) from a CUDA module and from pinned CPU tensors:
         median of --repeats, with the bytes moved and the bandwidth that implies (the roofline: one read and one
         write of each byte on the device, one PCIe/C2C transfer from the host).
  sleep  sleep(1) / wake_up() of an engine with default memory settings (gpu_memory_utilization 0.9): the share
         of the engine's GPU memory given back (cudaMemGetInfo), each call's time, and W1 (256 x (256+256)
         greedy) before and after, side by side in this process. Then sleep(2) + wake_up(weights) +
         load_weights + wake_up(kv_cache), the RL order.
  colo   a trainer (transformers Qwen3 0.6B shape, fp32, AdamW) and an engine (gpu_memory_utilization 0.9 less what
         the trainer holds) on one GPU through --steps loop steps: sample (n rollouts per prompt, logprobs), sleep
         (level 2), a policy-gradient step on the rollouts, wake the weights, load_weights, wake the KV cache.
         Per step: GPU memory in use at the same point, each phase's time, the trainer-vs-sampler mismatch.

Usage (device): python bench/rl_bench.py [--parts load,sleep,colo] [--steps 10] [--output-json F]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch


def _used_gib() -> float:
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**30


def _timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def _trainer(path: str, dtype: torch.dtype):
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(path)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).cuda().eval()


def part_load(path: str, repeats: int) -> dict:
    from replayllm import LLM

    llm = LLM(path, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True,
              kv_cache_memory_bytes=4 << 30, max_model_len=4096)
    src = _trainer(path, torch.bfloat16)
    nbytes = sum(t.numel() * t.element_size() for t in src.state_dict().values())
    cuda_s = [_timed(lambda: llm.load_weights(src)) for _ in range(repeats)]
    pinned = [(k, v.detach().cpu().pin_memory()) for k, v in src.state_dict().items()]
    host_s = [_timed(lambda: llm.load_weights(pinned)) for _ in range(repeats)]
    llm.shutdown()
    src = pinned = None  # noqa: F841 (the CUDA copy goes back before the next part)
    gc.collect()
    med_cuda, med_host = statistics.median(cuda_s), statistics.median(host_s)
    return {"part": "load", "bytes": nbytes, "from_cuda_ms": med_cuda * 1e3, "from_pinned_cpu_ms": med_host * 1e3,
            "from_cuda_GBps": nbytes / med_cuda / 1e9, "from_pinned_cpu_GBps": nbytes / med_host / 1e9,
            "all_cuda_ms": [round(s * 1e3, 2) for s in cuda_s], "all_pinned_ms": [round(s * 1e3, 2) for s in host_s]}


def _w1(llm, seed: int) -> float:
    from replayllm.entrypoints.bench.workload import Workload

    prompts, params = Workload(256, 256, 256, seed=seed).requests(llm.llm_engine.model_config.vocab_size)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    took = time.perf_counter() - start
    assert sum(len(o.outputs[0].token_ids) for o in outs) == 256 * 256
    return 256 * 256 / took


def part_sleep(path: str) -> dict:
    from replayllm import LLM

    base = _used_gib()
    llm = LLM(path, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True, enable_sleep_mode=True)
    awake = _used_gib()
    before = [_w1(llm, seed) for seed in (1, 2)]
    result = {"part": "sleep", "engine_gib": awake - base}
    result["sleep1_s"] = _timed(lambda: llm.sleep(1))
    asleep = _used_gib()
    result["asleep_gib"] = asleep - base
    result["freed_share"] = (awake - asleep) / (awake - base)
    result["wake_s"] = _timed(lambda: llm.wake_up())
    result["awake_again_gib"] = _used_gib() - base
    after = [_w1(llm, seed) for seed in (1, 2)]
    result["w1_tok_s_before"], result["w1_tok_s_after"] = before, after
    result["w1_after_over_before"] = max(after) / max(before)
    src = _trainer(path, torch.bfloat16)
    result["sleep2_s"] = _timed(lambda: llm.sleep(2))
    result["asleep2_gib"] = _used_gib() - base
    result["wake_weights_s"] = _timed(lambda: llm.wake_up(["weights"]))
    result["load_weights_s"] = _timed(lambda: llm.load_weights(src))
    result["wake_kv_s"] = _timed(lambda: llm.wake_up(["kv_cache"]))
    result["w1_after_level2"] = _w1(llm, 3)
    llm.shutdown()
    src = None  # noqa: F841
    gc.collect()
    torch.cuda.empty_cache()
    return result


def part_colo(path: str, steps: int, prompts_per_step: int, n: int, max_tokens: int) -> dict:
    import random

    from replayllm import LLM, SamplingParams
    from replayllm.rl import mismatch_stats

    base = _used_gib()
    trainer = _trainer(path, torch.float32).train()
    opt = torch.optim.AdamW(trainer.parameters(), lr=1e-6)
    # The optimizer's state exists before the engine sizes its KV cache (AdamW creates it on its first step): one
    # step with zero gradients and lr 0 changes no weight.
    for p in trainer.parameters():
        p.grad = torch.zeros_like(p)
    opt.param_groups[0]["lr"] = 0.0
    opt.step()
    opt.zero_grad(set_to_none=True)
    opt.param_groups[0]["lr"] = 1e-6
    # gpu_memory_utilization is the engine's share of the device (vLLM's meaning): 0.9 less what the trainer holds.
    free, total = torch.cuda.mem_get_info()
    share = round(0.9 - (total - free) / total, 3)
    llm = LLM(path, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True, enable_sleep_mode=True,
              gpu_memory_utilization=share)
    llm.load_weights(trainer)
    rng = random.Random(0)
    vocab = llm.llm_engine.model_config.vocab_size
    rows = []
    for step in range(steps):
        used_at_start = _used_gib() - base
        t0 = time.perf_counter()
        prompts = [[rng.randrange(100, vocab) for _ in range(64)] for _ in range(prompts_per_step)]
        params = SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, logprobs=0, ignore_eos=True,
                                seed=step)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        t_sample = time.perf_counter() - t0
        t0 = time.perf_counter()
        llm.sleep(2)
        t_sleep = time.perf_counter() - t0
        used_asleep = _used_gib() - base
        t0 = time.perf_counter()
        trainer_lps, sampler_lps, loss_total = [], [], 0.0  # one [T] row per rollout
        torch.cuda.reset_peak_memory_stats()
        for out, prompt in zip(outs, prompts):
            rewards = torch.tensor([sum(t % 2 == 0 for t in c.token_ids) / len(c.token_ids) for c in out.outputs])
            adv = ((rewards - rewards.mean()) / (rewards.std() + 1e-6)).cuda()
            ids = torch.tensor([prompt + list(c.token_ids) for c in out.outputs], device="cuda")
            logits = trainer(ids).logits[:, len(prompt) - 1 : -1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, ids[:, len(prompt):, None])[..., 0]  # [n, T]
            sampler = torch.tensor([[d[t].logprob for d, t in zip(c.logprobs, c.token_ids)] for c in out.outputs],
                                   device="cuda")
            trainer_lps.extend(lp.detach())  # [n] rows of [T]
            sampler_lps.extend(sampler)
            loss = -(torch.exp(lp - sampler) * adv[:, None]).mean() / len(outs)
            loss.backward()
            loss_total += loss.item()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        t_train = time.perf_counter() - t0
        peak_train = torch.cuda.max_memory_allocated() / 2**30
        t0 = time.perf_counter()
        llm.wake_up(["weights"])
        llm.load_weights(trainer)
        llm.wake_up(["kv_cache"])
        t_update = time.perf_counter() - t0
        mm = mismatch_stats(sampler_lps, trainer_lps)  # replayllm.rl: |Δ| and KL(sampler ‖ trainer) per token
        rows.append({"step": step, "used_gib_at_start": round(used_at_start, 3),
                     "used_gib_asleep": round(used_asleep, 3),
                     "trainer_peak_alloc_gib": round(peak_train, 3), "sample_s": round(t_sample, 3),
                     "sleep_s": round(t_sleep, 3), "train_s": round(t_train, 3), "wake_load_s": round(t_update, 3),
                     "loss": loss_total, "mean_abs_delta": mm.mean_abs, "max_abs_delta": mm.max_abs, "kl": mm.kl,
                     "share_above_0.1": mm.share_above})
        print(json.dumps(rows[-1]), flush=True)
    llm.shutdown()
    starts = [r["used_gib_at_start"] for r in rows]
    return {"part": "colo", "steps": rows, "growth_gib_first_to_last": starts[-1] - starts[0] if rows else 0.0,
            "growth_gib_step1_to_last": starts[-1] - starts[1] if len(rows) > 1 else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="load,sleep,colo")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--prompts-per-step", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    from replayllm.entrypoints.bench.workload import write_dummy_config

    path = write_dummy_config()
    results = []
    for part in args.parts.split(","):
        if part == "load":
            results.append(part_load(path, args.repeats))
        elif part == "sleep":
            results.append(part_sleep(path))
        elif part == "colo":
            results.append(part_colo(path, args.steps, args.prompts_per_step, args.n, args.max_tokens))
        else:
            raise SystemExit(f"unknown part {part!r}")
        print(json.dumps({k: v for k, v in results[-1].items() if k != "steps"}), flush=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
