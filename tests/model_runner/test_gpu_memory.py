"""On CUDA an engine gives its memory back: five build / generate / shutdown cycles of the Qwen3-0.6B shape (bf16,
4 GiB KV cache, CUDA graphs) end where they started, within 100 MiB (torch's reserved memory and the device's
free memory); `del llm` alone does the same; a default-sized engine fits again afterwards; and
gpu_memory_utilization is the engine's share, whatever else holds the device."""

from __future__ import annotations

import pytest
import torch

from replayllm import LLM, SamplingParams
from replayllm.entrypoints.bench.workload import write_dummy_config

pytestmark = pytest.mark.gpu
MIB = 2**20
SLACK = 100 * MIB
OPTS = dict(load_format="dummy", dtype="bfloat16", kv_cache_memory_bytes=4 << 30, max_model_len=1024,
            max_num_seqs=32, skip_tokenizer_init=True)
PROMPTS = [{"prompt_token_ids": [100 + i, 200 + i, 300 + i]} for i in range(8)]


def _memory() -> tuple[int, int]:
    torch.cuda.synchronize()
    return torch.cuda.memory_reserved(), torch.cuda.mem_get_info()[0]


def _generate(llm: LLM) -> None:
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=16, ignore_eos=True, logprobs=2), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 16 for o in outs)


@pytest.fixture(scope="module")
def model_dir() -> str:
    return write_dummy_config()


def _baseline() -> tuple[int, int]:
    torch.zeros(1, device="cuda")  # the CUDA context exists before the first measurement
    return _memory()


def test_five_cycles_of_build_generate_shutdown_return_to_the_start(model_dir):
    """torch's reserved memory (everything the engine allocated) goes back to where it was before the first
    engine; the device's free memory goes back to where it was after the first cycle (the first engine also
    loads code that stays for the process: cuBLAS and the Triton kernels' modules), every cycle."""
    reserved0, free0 = _baseline()
    free1 = None
    for cycle in range(5):
        llm = LLM(model_dir, **OPTS)
        assert torch.cuda.memory_reserved() > reserved0 + (4 << 30)  # the engine holds its KV cache
        _generate(llm)
        llm.shutdown()
        reserved, free = _memory()
        print(f"\n[gpu memory] cycle {cycle}: reserved +{(reserved - reserved0) / MIB:.0f} MiB, device free "
              f"-{(free0 - free) / MIB:.0f} MiB against the start")
        assert reserved - reserved0 <= SLACK, f"cycle {cycle}: {(reserved - reserved0) / MIB:.0f} MiB still reserved"
        free1 = free if free1 is None else free1
        assert free1 - free <= SLACK, f"cycle {cycle}: {(free1 - free) / MIB:.0f} MiB of device memory not back"


def test_del_llm_alone_gives_the_memory_back(model_dir):
    reserved0, free0 = _baseline()
    for _ in range(2):
        llm = LLM(model_dir, **OPTS)
        _generate(llm)
        del llm  # no shutdown, no gc.collect, no empty_cache by the caller
        reserved, free = _memory()
        assert reserved - reserved0 <= SLACK, f"{(reserved - reserved0) / MIB:.0f} MiB still reserved"
        assert free0 - free <= SLACK, f"{(free0 - free) / MIB:.0f} MiB of device memory not back"


def test_context_manager_then_a_default_sized_engine(model_dir):
    with LLM(model_dir, **OPTS) as llm:
        _generate(llm)
    # A default-sized engine (gpu_memory_utilization's share, cut to what the device has free) right after a closed
    # one: it starts and serves (whether the first one's memory came back: test_del_llm_alone_gives_the_memory_back).
    opts = {k: v for k, v in OPTS.items() if k != "kv_cache_memory_bytes"}
    with LLM(model_dir, **opts) as llm:
        _generate(llm)


def test_gpu_memory_utilization_is_this_engines_share(model_dir):
    """As in vLLM, gpu_memory_utilization is this engine's share of the device: with another holder (a trainer,
    stood in for by one tensor) taking 60% of the free memory, an engine at 0.3 starts and its KV cache is about
    0.3 x total less its own weights and activation reserve. (Counting everything in use against the share, as
    before, left it no blocks at all: "the KV cache holds -N blocks".)"""
    from replayllm.model_runner_v2.kv_cache import kv_block_bytes

    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    hog = torch.empty(int(free * 0.6), dtype=torch.uint8, device="cuda")
    opts = {k: v for k, v in OPTS.items() if k not in ("kv_cache_memory_bytes", "max_num_seqs")}
    try:
        # 1,024 sequences of 1,024 tokens would need ~120 GB: the share, not that cap, sizes the cache
        with LLM(model_dir, gpu_memory_utilization=0.3, max_num_seqs=1024, **opts) as llm:
            kv = llm.llm_engine.runner.num_blocks * kv_block_bytes(llm.llm_engine.config)
            _generate(llm)
        share = 0.3 * total
        print(f"\n[gpu memory] share {share / 2**30:.1f} GiB, KV cache {kv / 2**30:.1f} GiB")
        assert share - 8 * 2**30 <= kv <= share, (kv, share)  # weights 1.2 GiB + reserve ~3 GiB + the context
    finally:
        del hog
        torch.cuda.empty_cache()
