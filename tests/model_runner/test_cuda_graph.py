"""CUDA-graph decode (`model_runner_v2/cuda_graph.py`) without a GPU: capture sizes, the config switches, and the
padded static-buffer path run eagerly (`replay=False`) under the Triton interpreter — the exact inputs a graph
would replay, so padding, stale rows and the sink block are checked here. Real capture/replay on the H200:
the `gpu`-marked tests at the end."""

from __future__ import annotations

import gc
import random
import time

import numpy as np
import pytest
import torch
from helpers.hf_reference import VOCAB
from helpers.tolerances import LOGPROB_TOL
from helpers.trace_replay_common import tokens_and_logprobs as _run

from replayllm import LLM, SamplingParams
from replayllm.config import EngineConfig
from replayllm.model_runner_v2.cuda_graph import CudaGraphRunner, capture_sizes


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = capture_sizes(512)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 512 and 256 in sizes and 272 in sizes and 264 not in sizes
    assert sizes == sorted(set(sizes))


def test_config_switches(tiny_models):
    cfg = EngineConfig(tiny_models["qwen3"], max_num_seqs=40)
    assert cfg.max_cudagraph_capture_size == 40 and cfg.enforce_eager is False
    assert not cfg.use_cuda_graphs  # CPU: never
    assert EngineConfig(tiny_models["qwen3"], max_num_seqs=1000).max_cudagraph_capture_size == 512
    with pytest.raises(ValueError, match="enforce_eager"):
        EngineConfig(tiny_models["qwen3"], enforce_eager="yes")
    with pytest.raises(ValueError, match="max_cudagraph_capture_size"):
        EngineConfig(tiny_models["qwen3"], max_cudagraph_capture_size=0)
    llm = LLM(tiny_models["qwen3"], skip_tokenizer_init=True, max_model_len=64)
    assert llm.llm_engine.runner.graph_runner is None
    # The KV cache holds one block more than the BlockManager hands out: the graph runner's sink.
    assert llm.llm_engine.runner.kv_caches[0].shape[1] == llm.llm_engine.block_manager.num_blocks + 1


def test_padded_static_buffer_path_matches_eager(tiny_models, monkeypatch):
    """Ragged prompts, requests finishing at different steps (the batch shrinks 7 -> 1, so padded rows held live
    slots a step earlier), greedy and trace rows: the padded path gives the eager tokens and logprobs. Every decode
    step goes through DecodeInputs (its inputs straight into the graph's buffers), none through prepare_inputs."""
    from replayllm.model_runner_v2 import model_runner

    general = []
    prepare_inputs = model_runner.prepare_inputs
    monkeypatch.setattr(model_runner, "prepare_inputs",
                        lambda *a, **k: general.append(int(a[3].max())) or prepare_inputs(*a, **k))
    llm = LLM(tiny_models["llama"], skip_tokenizer_init=True, dtype="float32", max_model_len=96, max_num_seqs=8,
              attention_backend="triton", enable_trace_replay=True, block_size=8, max_cudagraph_capture_size=8,
              enable_prefix_caching=False)
    runner = llm.llm_engine.runner
    rng = random.Random(1)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (3, 9, 17, 30, 5, 12, 40)]
    params = []
    for i in range(len(prompts)):
        if i % 3 == 2:
            params.append(SamplingParams(trace_decode_token_ids=[rng.randrange(VOCAB) for _ in range(4 + 2 * i)],
                                         logprobs=2))
        else:
            params.append(SamplingParams(temperature=0, max_tokens=3 + 2 * i, logprobs=2, ignore_eos=True))
    eager_tokens, eager_lps = _run(llm, prompts, params)

    graphs = CudaGraphRunner(runner.model, runner.kv_caches, llm.llm_engine.config, sink_block=runner.num_blocks,
                             states=runner.req_states, replay=False)
    assert graphs.sizes == [1, 2, 4, 8]
    runner.graph_runner = graphs
    sink = [kv[:, runner.num_blocks].clone() for kv in runner.kv_caches]
    general.clear()
    padded_tokens, padded_lps = _run(llm, prompts, params)

    assert graphs.num_replays > 0
    assert general and min(general) > 1  # only steps with a longer row (prefills) took the general input path
    assert padded_tokens == eager_tokens
    for p, traced in zip(params, padded_tokens):
        if p.trace_decode_token_ids is not None:
            assert traced == p.trace_decode_token_ids
    diff = max(abs(a - b) for x, y in zip(padded_lps, eager_lps) for a, b in zip(x, y))
    # Not bit-exact: a GEMM over 8 padded rows may block its sums differently than over 5 (seen: 1.7e-5 on
    # the tiny llama, whose logits are large): another summation order.
    assert diff <= LOGPROB_TOL, diff
    # Padded rows wrote their K/V into the sink block and nowhere else.
    assert any(not torch.equal(kv[:, runner.num_blocks], s) for kv, s in zip(runner.kv_caches, sink))


def _token(base: int, row: int, position: int) -> int:
    return (base + 17 * row + position) % VOCAB


def _add_requests(states, block_size: int, first_block: int, count: int, first_slot_token: int) -> np.ndarray:
    """`count` requests of 14 known tokens (`_token(first_slot_token, i, position)`) in two blocks each, from
    first_block on; returns their slots."""
    slots = []
    for i in range(count):
        tokens = [_token(first_slot_token, i, p) for p in range(14)]
        blocks = [first_block + 2 * i, first_block + 2 * i + 1]
        slots.append(states.add_request(f"r{first_block}-{i}", tokens, 14, blocks))
    states.apply_staged_writes()
    return np.array(slots, dtype=np.int64)


def test_decode_inputs_go_straight_to_the_graph_buffers(tiny_models):
    """A decode step's inputs written by the host into its graph's buffer (decode_inputs.py), the input ids and
    block tables gathered by the graph itself; then a smaller batch on the same graph size: the rows past it
    held live requests a step ago and must point at the sink (pad slot, sink KV slot, length 1)."""
    from replayllm.model_runner_v2.decode_inputs import FLAT_TOKEN, POSITIONS, SEQ_LENS, SLOT_MAPPING, SLOTS

    llm = LLM(tiny_models["qwen3"], skip_tokenizer_init=True, dtype="float32", max_model_len=64, max_num_seqs=8,
              attention_backend="triton", block_size=8, max_cudagraph_capture_size=4)
    runner = llm.llm_engine.runner
    states = runner.req_states
    graphs = CudaGraphRunner(runner.model, runner.kv_caches, llm.llm_engine.config, sink_block=runner.num_blocks,
                             states=states, replay=False)
    assert graphs.decode_size(3) == 4 and graphs.decode_size(4) == 4 and graphs.decode_size(5) is None
    for size, packed in graphs.decode.inputs.packed.items():  # each field 16-byte aligned, size 1 too
        assert packed.shape == (7, size) and all(row.is_contiguous() and row.data_ptr() % 16 == 0 for row in packed)
    assert states.block_table[states.pad_slot].eq(runner.num_blocks).all()  # the padding rows' table: the sink
    ones = np.ones(4, dtype=np.int64)
    with torch.inference_mode():
        big_slots = _add_requests(states, 8, first_block=0, count=4, first_slot_token=7)
        pos = np.array([13, 12, 10, 9], dtype=np.int64)  # each row's last known token: position 13 or less
        big = graphs.prepare_decode(big_slots, pos, ones, 4)
        assert big.graph_size == 4 and big.every_token_sampled
        graphs.run(big, 4)
        packed, inputs = graphs.decode.inputs.packed[4], graphs.decode.inputs
        blocks = np.array([[2 * i, 2 * i + 1] for i in range(4)])
        want_slots = blocks[np.arange(4), pos // 8] * 8 + pos % 8
        assert packed[SLOT_MAPPING].tolist() == want_slots.tolist()
        assert packed[SEQ_LENS].tolist() == (pos + 1).tolist() and packed[POSITIONS].tolist() == pos.tolist()
        # The graph's own gathers: each row's token at its position, each row's block table.
        assert inputs.input_ids[:4].tolist() == [_token(7, i, p) for i, p in enumerate(pos.tolist())]
        assert torch.equal(inputs.block_tables[:4], states.block_table[torch.from_numpy(big_slots)])
        for rid in list(states.req_id_to_slot):
            states.remove_request(rid)
        small_slots = _add_requests(states, 8, first_block=10, count=3, first_slot_token=50)
        sampled = np.array([1, 0, 1], dtype=np.int64)  # row 1 samples nothing (a one-token prompt chunk)
        small = graphs.prepare_decode(small_slots, pos[:3], sampled, 4)
        hidden = graphs.run(small, 4)
    assert hidden.shape[0] == 3 and not small.every_token_sampled
    assert small.host_sample_rows.tolist() == [0, 2] and small.logits_indices.tolist() == [0, 2]
    assert small.sample_slots.tolist() == small_slots[[0, 2]].tolist()
    assert packed[SLOTS, 3].item() == states.pad_slot and packed[SLOT_MAPPING, 3].item() == graphs.sink_slot
    assert packed[SEQ_LENS, 3].item() == 1 and packed[POSITIONS, 3].item() == 0 and packed[FLAT_TOKEN, 3] == 0
    assert inputs.block_tables[3].eq(graphs.sink_block).all()
    assert inputs.input_ids[:3].tolist() == [_token(50, i, p) for i, p in enumerate(pos[:3].tolist())]


# -- On the GPU (marker `gpu`; skipped on CPU): graphs (decode whole, every other step piecewise) vs enforce_eager=True
# on the tiny fp32 models (ragged prompts, a shrinking batch, traces) and on the Qwen3-0.6B-shaped dummy model in bf16;
# the cudagraph_mode values against each other. Numbers printed, bounds asserted. Every other CUDA test (parity with
# HF, the trace-replay e2e suite) also runs with graphs, the default on CUDA. ------------------------------------
def _max_diff(a, b) -> float:
    return max(abs(x - y) for u, v in zip(a, b) for x, y in zip(u, v))


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_tiny_fp32_graphs_match_eager(tiny_models, arch):
    rng = random.Random(0)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (1, 5, 17, 33, 64, 90, 128, 3, 40, 7, 11)]
    params = [SamplingParams(trace_decode_token_ids=[rng.randrange(VOCAB) for _ in range(5 + 3 * i)], logprobs=1)
              if i % 3 == 1 else SamplingParams(temperature=0, max_tokens=4 + 3 * i, logprobs=1, ignore_eos=True)
              for i in range(len(prompts))]
    runs = {}
    for eager in (True, False):
        llm = LLM(tiny_models[arch], device="cuda", dtype="float32", max_model_len=256, skip_tokenizer_init=True,
                  enable_trace_replay=True, enforce_eager=eager, max_num_seqs=16, enable_prefix_caching=False,
                  trace_replay_chunk_size=1)  # one token a step: the replay below must equal the run bit for bit
        runs[eager] = _run(llm, prompts, params)
        graphs = llm.llm_engine.runner.graph_runner
        if eager:
            assert graphs is None
        else:
            assert graphs.sizes == [1, 2, 4, 8, 16] and graphs.num_replays > 0
            pieces = llm.llm_engine.runner.piecewise  # the prefill and mixed steps: piecewise graphs
            assert pieces is not None and pieces.graphs and pieces.num_replays > 0
            # Replaying every row's output as a trace (same schedule: same lengths, same batches, same graphs)
            # gives the logprobs back bit for bit.
            replay = [SamplingParams(trace_decode_token_ids=tokens, logprobs=1) for tokens in runs[False][0]]
            assert _run(llm, prompts, replay) == runs[False]
        del llm
        gc.collect()
    assert runs[True][0] == runs[False][0]
    d = _max_diff(runs[True][1], runs[False][1])
    print(f"\n[cuda graphs] tiny {arch} fp32: graphs vs eager max |dlogprob| {d:.2e}")
    assert d <= 1e-4


@pytest.mark.gpu
def test_dummy_qwen3_0_6b_bf16_graphs_vs_eager():
    from replayllm.entrypoints.bench.workload import write_dummy_config as write_config

    rng = random.Random(0)
    prompts = [[rng.randrange(100, 150_000) for _ in range(rng.randrange(1, 400))] for _ in range(37)]
    params = [SamplingParams(trace_decode_token_ids=[rng.randrange(100, 150_000) for _ in range(48)], logprobs=0)
              for _ in prompts]
    runs, start_s = {}, {}
    for eager in (True, False):
        t = time.perf_counter()
        llm = LLM(write_config(), load_format="dummy", dtype="bfloat16", device="cuda", skip_tokenizer_init=True,
                  max_model_len=1024, enable_trace_replay=True, enforce_eager=eager, max_num_seqs=64)
        start_s[eager] = time.perf_counter() - t
        runs[eager] = _run(llm, prompts, params)
        assert runs[eager][0] == [p.trace_decode_token_ids for p in params]
        if not eager:
            assert llm.llm_engine.runner.piecewise.num_replays > 0
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    d = torch.tensor([abs(x - y) for u, v in zip(runs[True][1], runs[False][1]) for x, y in zip(u, v)])
    print(f"\n[cuda graphs] 0.6B dummy bf16: graphs vs eager mean |dlogprob| {d.mean():.2e}, max {d.max():.2e} "
          f"over {d.numel()} tokens; engine start-up eager {start_s[True]:.1f} s, with capture {start_s[False]:.1f} s")
    assert d.mean() <= 5e-3 and d.max() <= 5e-2


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_cudagraph_modes_agree(tiny_models, arch):
    """FULL_DECODE_ONLY (eager prefill), PIECEWISE (every step piecewise) and FULL_AND_PIECEWISE on the tiny fp32
    models: the same tokens, logprobs within fp32 noise; each mode's runners served the steps it names."""
    rng = random.Random(3)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (2, 7, 19, 40, 77, 130, 9, 300)]
    params = [SamplingParams(trace_decode_token_ids=[rng.randrange(VOCAB) for _ in range(6 + 2 * i)], logprobs=1)
              if i % 2 else SamplingParams(temperature=0, max_tokens=5 + 2 * i, logprobs=1, ignore_eos=True)
              for i in range(len(prompts))]
    runs = {}
    for mode in ("FULL_DECODE_ONLY", "PIECEWISE", "FULL_AND_PIECEWISE"):
        llm = LLM(tiny_models[arch], device="cuda", dtype="float32", max_model_len=512, skip_tokenizer_init=True,
                  enable_trace_replay=True, cudagraph_mode=mode, max_num_seqs=8, max_num_batched_tokens=256,
                  enable_prefix_caching=False, trace_replay_chunk_size=4)
        runs[mode] = _run(llm, prompts, params)
        runner = llm.llm_engine.runner
        assert (runner.graph_runner is not None) == (mode != "PIECEWISE")
        assert (runner.piecewise is not None) == (mode != "FULL_DECODE_ONLY")
        if runner.piecewise is not None:
            assert runner.piecewise.sizes[-1] == 256 and runner.piecewise.num_replays > 0
        del llm
        gc.collect()
    base_tokens, base_lps = runs["FULL_DECODE_ONLY"]
    for mode in ("PIECEWISE", "FULL_AND_PIECEWISE"):
        assert runs[mode][0] == base_tokens, mode
        d = _max_diff(runs[mode][1], base_lps)
        print(f"\n[cuda graphs] tiny {arch} fp32: {mode} vs FULL_DECODE_ONLY max |dlogprob| {d:.2e}")
        assert d <= 1e-4
