"""`replayllm bench throughput|latency` on a tiny model (CPU): the runs complete, count what they promise, and
the roofline model adds up; plus the workload's determinism."""

import json

import pytest

from replayllm import LLM
from replayllm.entrypoints.bench.roofline import (
    H200_COPY_BYTES_PER_S,
    MEASURED_CEILINGS,
    ModelCost,
    ceilings_for,
    device_ceilings,
)
from replayllm.entrypoints.bench.workload import Workload
from replayllm.entrypoints.cli.main import main
from replayllm.kernels import append_sampled, gemv, layer_norm, pdl

COMMON = ["--device", "cpu", "--dtype", "float32", "--max-model-len", "64", "--enforce-eager"]


def test_throughput_with_traces_and_hf_comparison(tiny_models, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = main(["bench", "throughput", tiny_models["qwen3"], "--num-prompts", "3", "--random-input-len", "5",
               "--output-len", "4", "--dataset-name", "random", "--trace", "--logprobs", "2", "--compare-hf",
               "--output-json", str(out), *COMMON])  # vLLM's --random-input-len / --dataset-name spellings too
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["output_tokens"] == 12 and r["trace"] and r["logprobs"] == 2
    # vLLM's names beside ours (scripts written for its files): 3 x (5 + 4) tokens
    assert (r["num_requests"], r["total_num_tokens"], r["elapsed_time"]) == (3, 27, r["elapsed_s"])
    assert r["tokens_per_second"] == 27 / r["elapsed_s"] and r["requests_per_second"] == 3 / r["elapsed_s"]
    assert r["hf"]["output_tokens"] == 12  # transformers generated exactly output_len tokens per prompt
    assert r["speedup_vs_hf"] == r["output_tok_per_s"] / r["hf"]["output_tok_per_s"]  # the same division, exactly
    assert 0 < r["roofline_fraction"] < 1
    assert r["options"]["async_scheduling"] is False  # CPU default
    assert r["options"]["max_num_batched_tokens"] == 8192 and r["options"]["max_num_seqs"] == 256  # CPU defaults
    # A trace run is timed in both replay modes: one token a step (the default) and fast replay.
    assert r["options"]["trace_replay_chunk_size"] == 1
    assert r["options"]["gemv"] is gemv.ENABLED  # the small-step GEMV's switch (REPLAYLLM_GEMV) is reported
    assert r["options"]["split_mixed_attention"] is False  # REPLAYLLM_SPLIT_MIXED_ATTENTION: opt-in
    other = r["other_replay_mode"]
    assert other["trace_replay_chunk_size"] == 64 and other["output_tokens"] == 12
    assert other["steps"] < r["steps"]  # fast replay: the 4-token traces in one step after the prefill
    assert r["late_kernel_variants"] == other["late_kernel_variants"] == 0 and r["late_kernels"] == []
    printed = capsys.readouterr().out
    assert "out tok/s" in printed and "chunk 64:" in printed
    # Off a measured GPU the floor is the H200's, and the result and its summary line say it was assumed.
    assert r["roofline_ceilings"]["device"].startswith("NVIDIA H200 (assumed: none measured on no CUDA device)")
    assert r["roofline_ceilings"]["copy_bytes_per_s"] == H200_COPY_BYTES_PER_S
    assert "on NVIDIA H200 (assumed" in printed


def test_latency_reports_medians(tiny_models, tmp_path):
    out = tmp_path / "l.json"
    # vLLM's spelling: --model instead of the positional
    rc = main(["bench", "latency", "--model", tiny_models["llama"], "--input-len", "6", "--output-len", "5",
               "--num-iters", "2", "--num-iters-warmup", "0", "--output-json", str(out), *COMMON])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["median_tpot_ms"] > 0 and r["median_ttft_ms"] > 0 and r["num_iters"] == 2
    lat = r["latencies"]  # vLLM's names: each timed run's seconds, their mean and percentiles
    # (a + b) / 2 three ways: equal up to an ulp, so compared within 1e-12 relative
    assert len(lat) == 2 and r["avg_latency"] == pytest.approx(sum(lat) / 2, rel=1e-12)
    assert r["median_latency_s"] == pytest.approx(r["percentiles"]["50"], rel=1e-12)
    assert r["percentiles"]["10"] == min(lat) + (max(lat) - min(lat)) * 0.1 and r["percentiles"]["99"] <= max(lat)
    assert r["late_kernel_variants"] == 0  # no Triton compile inside the timed runs (kernels/jit_watch.py)
    assert 0 < r["roofline_fraction"] < 1
    assert r["model"] == tiny_models["llama"]
    assert r["options"]["gemv"] is gemv.ENABLED
    assert r["options"]["pdl"] is pdl.ENABLED
    assert r["options"]["append_kernel"] is append_sampled.ENABLED
    assert r["options"]["layer_norm_kernel"] is layer_norm.ENABLED


def test_summarize_names_the_gemv_switch():
    """bench/summarize.py's mode column says when a row ran with REPLAYLLM_GEMV=0 (gpu_check.sh's W4-cublas) or
    REPLAYLLM_PDL=0 (W4-nopdl) or REPLAYLLM_APPEND_KERNEL=0 (W4-noappend), and says nothing for the default or for
    results from before the option existed."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "summarize.py"
    spec = importlib.util.spec_from_file_location("summarize", path)
    summarize = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(summarize)
    r = {"bench": "latency", "batch_size": 1, "input_len": 128, "output_len": 512, "median_tpot_ms": 1.06,
         "median_ttft_ms": 4.9, "roofline_tpot_ms": 0.29, "roofline_fraction": 0.27,
         "options": {"cuda_graphs": True, "async_scheduling": True, "gemv": False}}
    assert "REPLAYLLM_GEMV=0" in summarize.row("W4-cublas", r)
    nopdl = summarize.row("W4-nopdl", {**r, "options": {"cuda_graphs": True, "gemv": True, "pdl": False}})
    assert "REPLAYLLM_PDL=0" in nopdl and "REPLAYLLM_GEMV=0" not in nopdl
    torch_append = summarize.row("W4-noappend", {**r, "options": {"cuda_graphs": True, "gemv": True,
                                                                  "append_kernel": False}})
    assert "REPLAYLLM_APPEND_KERNEL=0" in torch_append and "PDL" not in torch_append
    torch_ln = summarize.row("W1-starcoderbase-1b-torchln", {**r, "options": {"cuda_graphs": True,
                                                                              "layer_norm_kernel": False}})
    assert "REPLAYLLM_LAYER_NORM_KERNEL=0" in torch_ln and "APPEND" not in torch_ln
    split = summarize.row("S1-engine-split", {**r, "options": {"cuda_graphs": True, "split_mixed_attention": True}})
    assert "REPLAYLLM_SPLIT_MIXED_ATTENTION=1" in split
    for options in ({"cuda_graphs": True, "gemv": True}, {"cuda_graphs": True},
                    {"cuda_graphs": True, "gemv": True, "pdl": True, "append_kernel": True,
                     "layer_norm_kernel": True, "split_mixed_attention": False}):
        row = summarize.row("W4", {**r, "options": options})
        assert "GEMV" not in row and "APPEND" not in row and "SPLIT" not in row and "compiled inside" not in row
        assert "LAYER_NORM" not in row
    # A run that met Triton variants inside its timing (kernels/jit_watch.py) says so in its result column.
    late = summarize.row("W4", {**r, "late_kernel_variants": 2})
    assert "**2 Triton variant(s) compiled inside the timed run**" in late
    # The roofline column names whose ceilings its floor used (an H100's run against the H100's).
    h100 = summarize.row("W4", {**r, "roofline_ceilings": MEASURED_CEILINGS["NVIDIA H100 80GB HBM3"].as_dict()})
    assert "| 0.29 ms (H100 80GB HBM3) | 27% |" in h100


def test_summarize_keeps_a_row_whose_run_failed(tmp_path, capsys):
    """A row whose run wrote no JSON (session 36: W1-deepseek-v2-lite refused to start) is a line of the table,
    and the rows after it are still printed (it used to end the table with a traceback)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "summarize.py"
    spec = importlib.util.spec_from_file_location("summarize", path)
    summarize = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(summarize)
    ok = tmp_path / "W4.json"
    ok.write_text(json.dumps({"bench": "latency", "batch_size": 1, "input_len": 128, "output_len": 512,
                              "median_tpot_ms": 1.06, "median_ttft_ms": 4.9, "roofline_tpot_ms": 0.29,
                              "roofline_fraction": 0.27, "options": {}}))
    summarize.main([str(tmp_path / "W1-x.json"), str(ok)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[2] == "| W1-x | | | did not run (no W1-x.json: see the log) | | |"
    assert lines[3].startswith("| W4 | 1 x (128 in + 512 out) |")


def test_roofline_uses_the_gpus_own_ceilings():
    """A run's floor comes from the ceilings measured on its GPU: on the H100 SXM its lower copy bandwidth (a
    W1 on the H100 read against the H200's floor showed 54% where it was 75%); other GPUs, and the H100's PCIe
    and NVL cards (other bandwidths), get the H200's, named as assumed."""
    h100 = ceilings_for("NVIDIA H100 80GB HBM3")
    assert h100 is MEASURED_CEILINGS["NVIDIA H100 80GB HBM3"] and h100.copy_bytes_per_s < H200_COPY_BYTES_PER_S
    assert ceilings_for("NVIDIA H200") is MEASURED_CEILINGS["NVIDIA H200"]
    for other in ("NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA A100-SXM4-80GB"):
        c = ceilings_for(other)
        assert c.device == f"NVIDIA H200 (assumed: none measured on {other})"
        assert c.copy_bytes_per_s == H200_COPY_BYTES_PER_S
    assert device_ceilings("cpu").device.startswith("NVIDIA H200 (assumed")
    # A decode-only cost: the floor scales with the bandwidth alone.
    cost = ModelCost(weight_bytes=1000, kv_bytes_per_token=10, flops_per_token=0, head_flops=0)
    assert cost.run_seconds(2, 3, 4, h100) == (3 * 1000 + 30 * 10) / h100.copy_bytes_per_s
    assert cost.step_seconds(5, h100) == 1050 / h100.copy_bytes_per_s


def test_bad_workload_is_a_clean_error(tiny_models):
    # A bad workload is a clean error (exit 2), not a traceback.
    assert main(["bench", "throughput", tiny_models["qwen3"], "--num-prompts", "0", *COMMON]) == 2
    # --model and a different positional MODEL: refused before an engine is built
    assert main(["bench", "throughput", tiny_models["qwen3"], "--model", tiny_models["llama"], *COMMON]) == 2
    # a result file that cannot be written, and latency's counts: refused before an engine is built, naming the flag
    assert main(["bench", "throughput", tiny_models["qwen3"], *COMMON, "--output-json", "/nonexistent/t.json"]) == 2
    for flag, value in (("--num-iters", "0"), ("--num-iters-warmup", "-1"), ("--batch-size", "0")):
        assert main(["bench", "latency", "--model", tiny_models["qwen3"], flag, value]) == 2


def test_bench_scripts_read_the_model_option():
    """bench/profile_gpu.py and the other scripts that build the throughput workload themselves parse its flags
    through bench_throughput_args: --model names the model there as in `replayllm bench` (session 36's DeepSeek
    profile silently ran the default Qwen3 shape: the scripts parsed --model into an option nothing read)."""
    from replayllm.entrypoints.cli.main import bench_throughput_args

    args = bench_throughput_args(["--model", "/m/x", "--max-model-len", "4096"])
    assert (args.model, args.max_model_len) == ("/m/x", 4096)
    assert bench_throughput_args(["/m/y"]).model == "/m/y"
    assert bench_throughput_args([]).model is None  # the embedded default
    with pytest.raises(ValueError, match="differ"):
        bench_throughput_args(["/m/y", "--model", "/m/x"])


def test_workload_is_deterministic_and_in_range():
    w = Workload(4, 7, 3, trace=True, logprobs=None, seed=1)
    p1, s1 = w.requests(vocab_size=1000)
    p2, s2 = w.requests(vocab_size=1000)
    assert p1 == p2 and [s.trace_decode_token_ids for s in s1] == [s.trace_decode_token_ids for s in s2]
    assert all(100 <= t < 1000 for p in p1 for t in p["prompt_token_ids"])
    assert all(len(s.trace_decode_token_ids) == 3 and s.logprobs == 1 for s in s1)
    greedy = Workload(2, 3, 5).requests(1000)[1]
    assert all(s.temperature == 0 and s.max_tokens == 5 and s.ignore_eos and s.logprobs is None for s in greedy)


def test_unseen_workload_misses_what_run_engine_cached():
    """bench/profile_gpu.py --whole-run and bench/step_timeline.py time a run after run_engine: its prompts must be
    new (seed + 1, run_engine's warm-up prompts, left them almost all cached: no prefill in the profile)."""
    from types import SimpleNamespace

    from replayllm.entrypoints.bench.throughput import run_engine, unseen_workload

    seen: list[list[int]] = []

    def generate(prompts, params, use_tqdm=False):
        seen.extend(p["prompt_token_ids"] for p in prompts)
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[0] * sp.max_tokens)]) for sp in params]

    engine = SimpleNamespace(model_config=SimpleNamespace(vocab_size=1000), num_steps=0,
                             config=SimpleNamespace(trace_replay_chunk_size=1))
    w = Workload(3, 32, 4, seed=5)
    run_engine(SimpleNamespace(llm_engine=engine, generate=generate), w)
    assert len(seen) == 6  # the warm-up's prompts, then the timed run's
    fresh = unseen_workload(w)
    assert (fresh.num_prompts, fresh.input_len, fresh.output_len) == (3, 32, 4)
    blocks = {tuple(p[:16]) for p in seen}
    assert not blocks & {tuple(p["prompt_token_ids"][:16]) for p in fresh.requests(1000)[0]}


def test_roofline_adds_up():
    # 2 prompts x (3 in + 4 out): 3 decode steps reading 2 * (3+1 + 3+2 + 3+3) = 30 context tokens.
    cost = ModelCost(weight_bytes=1000, kv_bytes_per_token=10, flops_per_token=0, head_flops=0)
    # approx: the same numbers summed in another order (plain IEEE scalar arithmetic, the same on every CPU).
    assert cost.run_seconds(2, 3, 4) == pytest.approx((3 * 1000 + 30 * 10) / H200_COPY_BYTES_PER_S)
    assert cost.step_seconds(5) == pytest.approx(1050 / H200_COPY_BYTES_PER_S)
    # MoE: top-2 of 8 experts; one token reads a quarter of the experts' bytes, many tokens all of them.
    moe = ModelCost(weight_bytes=1000, kv_bytes_per_token=10, flops_per_token=0, head_flops=0, expert_bytes=800,
                    expert_hit_rate=0.25)
    assert moe.step_seconds(0) == pytest.approx(1200 / H200_COPY_BYTES_PER_S)
    assert moe.step_seconds(0, batch=2) == pytest.approx((1000 + 800 * (1 - 0.75**2)) / H200_COPY_BYTES_PER_S)
    assert moe.weight_bytes_read(10_000) == pytest.approx(1800)


def test_roofline_of_a_moe_engine_counts_the_experts_apart(tmp_path):
    """ModelCost.of_engine on a tiny Qwen3-MoE: the stacked experts are expert_bytes, not weight_bytes, and a
    prefill token's FLOPs count top_k of num_experts of them."""
    import transformers

    cfg = transformers.Qwen3MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_hidden_layers=2,
                                      num_experts=8, num_experts_per_tok=2, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, dtype="float32", max_model_len=32)
    cost = ModelCost.of_engine(llm.llm_engine)
    experts = 2 * 8 * 3 * 16 * 32  # layers x experts x (gate, up, down) x I x H
    assert cost.expert_bytes == 4 * experts and cost.expert_hit_rate == 0.25
    total = sum(p.numel() for p in llm.llm_engine.runner.model.parameters())
    assert cost.weight_bytes == 4 * (total - experts)
    layer_dense = sum(p.numel() for n, p in llm.llm_engine.runner.model.named_parameters()
                      if ".layers." in n and ".experts." not in n)
    assert cost.flops_per_token == 2 * layer_dense + 2 * experts // 4


def test_profile_gpu_counts_overlapping_kernels_once():
    """bench/profile_gpu.py's busy time is the union of the kernels' intervals: under PDL (kernels/pdl.py) a
    kernel's span starts while the one before it still runs, and the summed durations exceed the busy time."""
    import importlib.util
    from pathlib import Path
    from types import SimpleNamespace

    path = Path(__file__).resolve().parents[2] / "bench" / "profile_gpu.py"
    spec = importlib.util.spec_from_file_location("profile_gpu", path)
    profile_gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(profile_gpu)
    import torch

    def event(start, end, device=torch.autograd.DeviceType.CUDA):
        return SimpleNamespace(device_type=device, time_range=SimpleNamespace(start=start, end=end))

    events = [event(0, 10), event(5, 12), event(20, 25), event(21, 22), event(30, 31),
              event(0, 100, torch.autograd.DeviceType.CPU)]  # host events are not GPU time
    assert profile_gpu._busy_us(SimpleNamespace(events=lambda: events)) == 12 + 5 + 1
