"""CUDA-graph decode (`model_runner_v2/cuda_graph.py`) without a GPU: capture sizes, the config switches, and the
padded static-buffer path run eagerly (`replay=False`) under the Triton interpreter — the exact inputs a graph
would replay, so padding, stale rows and the sink block are checked here. Real capture/replay on the H200:
tests/test_cuda_graph_gpu.py."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hf_reference import VOCAB
from tolerances import LOGPROB_TOL
from trace_replay_common import tokens_and_logprobs as _run

from replayllm import LLM, SamplingParams
from replayllm.config import EngineConfig
from replayllm.model_runner_v2.cuda_graph import CudaGraphRunner, capture_sizes
from replayllm.model_runner_v2.forward_context import AttentionMetadata
from replayllm.model_runner_v2.input_batch import InputBatch


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


def test_padded_static_buffer_path_matches_eager(tiny_models):
    """Ragged prompts, requests finishing at different steps (the batch shrinks 7 -> 1, so padded rows held live
    slots a step earlier), greedy and trace rows: the padded path gives the eager tokens and logprobs."""
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
                             replay=False)
    assert graphs.sizes == [1, 2, 4, 8]
    runner.graph_runner = graphs
    sink = [kv[:, runner.num_blocks].clone() for kv in runner.kv_caches]
    padded_tokens, padded_lps = _run(llm, prompts, params)

    assert graphs.num_replays > 0
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


def _decode_batch(rows: int, block_size: int, first_block: int) -> InputBatch:
    """A decode step of `rows` requests, request i at position 10 + i in block first_block + i."""
    pos = torch.arange(rows, dtype=torch.int64) + 10
    blocks = torch.arange(rows, dtype=torch.int32)[:, None] + first_block + torch.zeros(1, 2, dtype=torch.int32)
    md = AttentionMetadata(query_start_loc=torch.arange(rows + 1), seq_lens=pos + 1,
                           slot_mapping=blocks[:, 1].long() * block_size + pos % block_size, block_tables=blocks,
                           token_req_idx=torch.arange(rows), positions=pos, max_query_len=1,
                           max_seq_len=int(pos[-1]) + 1)
    slots = np.arange(rows)
    return InputBatch(torch.arange(rows) + 7, pos, md, torch.arange(rows), torch.arange(rows), slots, slots,
                      np.arange(rows + 1), pos.numpy())


def test_stale_rows_are_reset_to_the_sink(tiny_models):
    """A smaller batch after a larger one on the same graph size: the rows past the new batch held live
    requests' slots a step ago; they must point at the sink before the replay."""
    llm = LLM(tiny_models["qwen3"], skip_tokenizer_init=True, dtype="float32", max_model_len=64, max_num_seqs=4,
              attention_backend="triton", block_size=8, max_cudagraph_capture_size=4)
    runner = llm.llm_engine.runner
    graphs = CudaGraphRunner(runner.model, runner.kv_caches, llm.llm_engine.config, sink_block=runner.num_blocks,
                             replay=False)
    with torch.inference_mode():
        big = _decode_batch(4, 8, first_block=0)
        assert graphs.padded_size(big) == 4
        graphs.run(big, 4)
        assert torch.equal(graphs.decode.slot_mapping[:4], big.attn.slot_mapping)
        small = _decode_batch(3, 8, first_block=5)
        assert graphs.padded_size(small) == 4
        hidden = graphs.run(small, 4)
    assert hidden.shape[0] == 3
    assert graphs.decode.slot_mapping[3].item() == graphs.sink_slot == runner.num_blocks * 8
    assert graphs.decode.seq_lens[3].item() == 1 and graphs.decode.block_tables[3, 0].item() == graphs.sink_block
    assert graphs.decode.input_ids[3].item() == 0 and graphs.decode.positions[3].item() == 0
    assert torch.equal(graphs.decode.slot_mapping[:3], small.attn.slot_mapping)
    # Steps the graphs cannot serve run eagerly: prefill rows, or more rows than the largest graph.
    prefill = _decode_batch(2, 8, first_block=0)
    prefill.attn.max_query_len = 5
    assert graphs.padded_size(prefill) is None
    assert graphs.padded_size(_decode_batch(5, 8, first_block=0)) is None
