"""CUDA graphs for speculative verify steps (`model_runner_v2/cuda_graph.py`, q = 1 + k tokens per row): sizes
and dispatch, the padded static-buffer path run eagerly (`replay=False`, Triton interpreter) against the eager
varlen forward with the sink isolating padded rows, and a speculative engine through that path against plain
decoding. Real capture/replay on the H200: the `gpu`-marked test at the end."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.tolerances import TEST_MODEL_HIDDEN, TEST_MODEL_LAYERS, rounding_tol

from replayllm import LLM, SamplingParams
from replayllm.config import EngineConfig
from replayllm.model_runner_v2.cuda_graph import CudaGraphRunner, verify_max_rows
from replayllm.model_runner_v2.forward_context import AttentionMetadata, ForwardContext, set_forward_context
from replayllm.model_runner_v2.input_batch import InputBatch

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
Q = 5  # 1 + k
BS = 8  # block size of these tests


def _verify_batch(ctx_lens: list[int], first_blocks: list[int], q: int = Q) -> InputBatch:
    """Rows of q query tokens each; row i has ctx_lens[i] cached tokens and owns blocks first_blocks[i] + j."""
    rows = len(ctx_lens)
    ctx = torch.tensor(ctx_lens, dtype=torch.int64)
    seq_lens = ctx + q
    max_blocks = -(-int(seq_lens.max()) // BS)
    tables = (torch.tensor(first_blocks, dtype=torch.int32)[:, None]
              + torch.arange(max_blocks, dtype=torch.int32)[None, :])  # [B, max_blocks]
    row = torch.arange(rows).repeat_interleave(q)  # [T]
    pos = ctx[row] + torch.arange(q).repeat(rows)
    md = AttentionMetadata(query_start_loc=torch.arange(0, rows * q + 1, q), seq_lens=seq_lens,
                           slot_mapping=tables[row, pos // BS].long() * BS + pos % BS, block_tables=tables,
                           token_req_idx=row, positions=pos, max_query_len=q, max_seq_len=int(seq_lens.max()))
    ids = (pos * 7 + row) % 16
    slots = np.arange(rows)
    qsl = np.arange(0, rows * q + 1, q)
    return InputBatch(ids, pos, md, torch.from_numpy(qsl[1:] - 1), torch.arange(rows), slots, slots, qsl,
                      ctx.numpy())


def test_verify_sizes_and_dispatch(tiny_models):
    cfg = EngineConfig(tiny_models["qwen3"], max_num_seqs=4, max_cudagraph_capture_size=20, speculative_config=SPEC)
    assert verify_max_rows(cfg) == 4  # 4 rows * 5 tokens = 20
    assert verify_max_rows(EngineConfig(tiny_models["qwen3"], max_num_seqs=256, speculative_config=SPEC)) == 51
    # Batch 1 (the benchmark's max_num_seqs=1: bound 1 token) still gets its one-row verify graph.
    assert verify_max_rows(EngineConfig(tiny_models["qwen3"], max_num_seqs=1, speculative_config=SPEC)) == 1
    llm = LLM(tiny_models["qwen3"], skip_tokenizer_init=True, dtype="float32", max_model_len=64, max_num_seqs=4,
              attention_backend="triton", block_size=BS, max_cudagraph_capture_size=20, speculative_config=SPEC)
    runner = llm.llm_engine.runner
    graphs = CudaGraphRunner(runner.model, runner.kv_caches, llm.llm_engine.config, sink_block=runner.num_blocks,
                             states=runner.req_states, replay=False)
    assert graphs.sizes == graphs.decode.sizes == [1, 2, 4]
    assert graphs.verify.q == Q and graphs.verify.sizes == [1, 2, 4]
    assert torch.equal(graphs.verify.query_start_loc, torch.arange(0, 21, Q))
    assert graphs.padded_size(_verify_batch([3, 9, 20], [0, 8, 16])) == 4
    assert graphs.padded_size(_verify_batch([3], [0])) == 1
    assert graphs.padded_size(_verify_batch([3] * 5, [0] * 5)) is None  # more rows than the largest graph
    assert graphs.padded_size(_verify_batch([3, 9], [0, 8], q=3)) is None  # a row drafted fewer than k
    ragged = _verify_batch([3, 9], [0, 8])
    ragged.input_ids = ragged.input_ids[:8]  # max_query_len 5 but 8 tokens: not uniform
    assert graphs.padded_size(ragged) is None
    no_spec = EngineConfig(tiny_models["qwen3"], max_num_seqs=4, max_cudagraph_capture_size=20)
    assert CudaGraphRunner(runner.model, runner.kv_caches, no_spec, sink_block=runner.num_blocks,
                           states=runner.req_states, replay=False).verify is None


def test_verify_static_buffers_match_eager(tiny_models):
    """A 3-row verify step padded to the 4-row graph right after a 4-row one (row 3's buffers still hold a live
    request's blocks): the hidden states equal the eager varlen forward's, live KV blocks are written exactly as
    eager writes them, the stale row's blocks are untouched and the padding wrote only the sink."""
    llm = LLM(tiny_models["llama"], skip_tokenizer_init=True, dtype="float32", max_model_len=64, max_num_seqs=4,
              attention_backend="triton", block_size=BS, max_cudagraph_capture_size=20, speculative_config=SPEC)
    runner = llm.llm_engine.runner
    sink = runner.num_blocks
    assert sink >= 32
    graphs = CudaGraphRunner(runner.model, runner.kv_caches, llm.llm_engine.config, sink_block=sink,
                             states=runner.req_states, replay=False)
    torch.manual_seed(0)
    for kv in runner.kv_caches:  # cached context: random K/V everywhere (the sink included)
        kv.copy_(torch.randn_like(kv))
    before = [kv.clone() for kv in runner.kv_caches]

    def restore():
        for kv, b in zip(runner.kv_caches, before):
            kv.copy_(b)

    batch = _verify_batch([6, 13, 21], [0, 8, 16])
    with torch.inference_mode():
        graphs.run(_verify_batch([6, 13, 21, 11], [0, 8, 16, 24]), 4)  # row 3 -> blocks 24..27
        restore()
        with set_forward_context(ForwardContext(batch.attn, runner.kv_caches, "triton")):
            eager = runner.model(batch.input_ids, batch.positions).clone()
        eager_kv = [kv.clone() for kv in runner.kv_caches]
        restore()
        assert graphs.padded_size(batch) == 4
        padded = graphs.run(batch, 4).clone()
    assert graphs.num_verify_replays == graphs.num_replays == 2
    assert padded.shape == eager.shape == (15, padded.shape[1])
    # Not bit-exact: GEMMs over 20 padded tokens may block their sums differently than over 15 (every layer's
    # length-hidden reductions, at the hidden states' own scale).
    tol = rounding_tol(eager, terms=TEST_MODEL_HIDDEN, steps=TEST_MODEL_LAYERS + 1)
    torch.testing.assert_close(padded, eager, rtol=0, atol=tol)
    v = graphs.verify
    assert torch.equal(v.slot_mapping[15:20] // BS, torch.full((5,), sink))
    assert torch.equal(v.positions[15:20], torch.arange(5)) and v.seq_lens[3].item() == Q
    assert bool((v.block_tables[3] == sink).all())
    for kv, e, b in zip(runner.kv_caches, eager_kv, before):
        kv_tol = rounding_tol(e[:, :24], terms=TEST_MODEL_HIDDEN, steps=TEST_MODEL_LAYERS)
        torch.testing.assert_close(kv[:, :24], e[:, :24], rtol=0, atol=kv_tol)  # the live rows' blocks
        assert torch.equal(kv[:, 24:sink], b[:, 24:sink])  # the stale row's blocks and every other block
        assert not torch.equal(kv[:, sink], b[:, sink])  # the padding row wrote its K/V into the sink
    logits_rows = padded[batch.logits_indices]
    assert torch.equal(logits_rows, padded[[4, 9, 14]])


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


PROMPTS = [[5, 9, 3, 5, 9, 3, 5], [7, 4, 12, 7, 4], [3, 3, 8, 11, 3, 8, 11, 3, 8], [13, 6, 13, 6, 13]]


def test_spec_engine_runs_verify_steps_through_graphs(tiny16):
    """A speculative engine whose runner takes the graph path (`replay=False`): verify steps go through the
    verify family and the greedy output equals the plain engine's."""
    opts = dict(skip_tokenizer_init=True, dtype="float32", max_model_len=128, max_num_seqs=4, block_size=BS,
                enable_prefix_caching=False, max_cudagraph_capture_size=20)
    plain = _greedy(LLM(tiny16, attention_backend="torch", **opts), PROMPTS)  # the plain-torch reference
    spec = LLM(tiny16, speculative_config=SPEC, attention_backend="triton", **opts)
    runner = spec.llm_engine.runner
    runner.graph_runner = graphs = CudaGraphRunner(runner.model, runner.kv_caches, spec.llm_engine.config,
                                                   sink_block=runner.num_blocks, states=runner.req_states,
                                                   replay=False)
    assert _greedy(spec, PROMPTS) == plain  # 4 rows: rarely uniform (some row drafts fewer than k)
    solo = [_greedy(spec, [p])[0] for p in PROMPTS[::3]]  # batch 1: each step where the row drafted k tokens
    assert solo == plain[::3]
    assert 0 < graphs.num_verify_replays < graphs.num_replays
    assert spec.llm_engine.scheduler.spec_stats.num_accepted_tokens > 0


# -- On the GPU (marker `gpu`; skipped on CPU): a speculative engine with real verify graphs against plain decoding
# (greedy tokens) and against the same engine with enforce_eager=True (tokens and logprobs), on the tiny 16-token
# Qwen3 in fp32 (conftest `tiny16`). ---------------------------------------------------------------------------
CUDA_OPTS = dict(device="cuda", skip_tokenizer_init=True, dtype="float32", max_model_len=128, max_num_seqs=4,
                 block_size=8, enable_prefix_caching=False, max_cudagraph_capture_size=20)


def _run(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    comps = [o.outputs[0] for o in outs]
    return ([list(c.token_ids) for c in comps],
            [[d[t].logprob for t, d in zip(c.token_ids, c.logprobs)] for c in comps])


@pytest.mark.gpu
def test_verify_graphs_match_eager_and_plain(tiny16):
    plain, _ = _run(LLM(tiny16, enforce_eager=True, **CUDA_OPTS), PROMPTS)
    eager = LLM(tiny16, speculative_config=SPEC, enforce_eager=True, **CUDA_OPTS)
    spec = LLM(tiny16, speculative_config=SPEC, **CUDA_OPTS)
    graphs = spec.llm_engine.runner.graph_runner
    assert graphs.verify.q == 5 and graphs.verify.sizes == [1, 2, 4] and set(graphs.verify.graphs) == {1, 2, 4}
    for prompts in (PROMPTS, PROMPTS[:1], PROMPTS[3:]):  # a batch of 4 (mostly ragged steps), then batch 1
        tokens, lps = _run(spec, prompts)
        eager_tokens, eager_lps = _run(eager, prompts)
        assert tokens == eager_tokens
        d = max(abs(a - b) for x, y in zip(lps, eager_lps) for a, b in zip(x, y))
        print(f"\n[verify graphs] {len(prompts)} prompts: graphs vs eager max |dlogprob| {d:.2e}")
        assert d <= 1e-4
    assert _run(spec, PROMPTS[:1])[0] == plain[:1] and _run(spec, PROMPTS[3:])[0] == plain[3:]
    assert graphs.num_verify_replays > 0
    print(f"[verify graphs] {graphs.num_verify_replays} verify replays of {graphs.num_replays}")
