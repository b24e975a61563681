"""Triton paged attention (`kernels/paged_attention.py`) against the torch backend, under the Triton interpreter
on tiny shapes; end to end, `attention_backend="triton"` against "torch" on tiny models (greedy tokens, logprobs,
chunked prefill, prefix hits, trace replay). The compiled kernels on CUDA: the `gpu`-marked tests at the end."""

from __future__ import annotations

import dataclasses
import random
from functools import partial

import pytest
import torch
from helpers.hf_reference import VOCAB
from helpers.tolerances import LOGPROB_TOL, rounding_tol

from replayllm import LLM, SamplingParams
from replayllm.config import EngineConfig
from replayllm.entrypoints.bench.workload import cuda_ms, dummy_trace_case
from replayllm.kernels import decode_launch as dl
from replayllm.kernels import paged_attention as pa
from replayllm.kernels.paged_attention import paged_decode_attention_triton, paged_prefill_attention_triton
from replayllm.model_runner_v2 import attention
from replayllm.model_runner_v2.attention import paged_attention_torch
from replayllm.model_runner_v2.forward_context import AttentionMetadata

SCALE = 0.3


def paged_case(block_size: int, num_heads: int, num_kv_heads: int, head_dim: int, q_lens: list[int],
               ctx_lens: list[int], dtype: torch.dtype = torch.float32, seed: int = 0):
    """A random paged KV cache and the step's metadata: request b has ctx_lens[b] tokens cached before this
    step and q_lens[b] scheduled now. Physical blocks are a random permutation (scrambled block tables); the
    table's unused tail points at random valid blocks, which the kernels must never read."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 3
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    max_blocks = max(blocks_per_req) + 2
    block_tables = torch.randint(0, num_blocks, (len(seq_lens), max_blocks), generator=g, dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks_per_req):
        block_tables[b, :n] = perm[used : used + n]
        used += n
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=g).to(dtype)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int64)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    token_req = torch.repeat_interleave(torch.arange(len(q_lens)), torch.tensor(q_lens))
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(ctx_lens, q_lens)])
    slots = block_tables[token_req, positions // block_size].long() * block_size + positions % block_size
    md = AttentionMetadata(query_start_loc=qsl, seq_lens=torch.tensor(seq_lens), slot_mapping=slots,
                           block_tables=block_tables, token_req_idx=token_req, positions=positions,
                           max_query_len=max(q_lens), max_seq_len=max(seq_lens))
    return q, kv_cache, md


def prefill(q, kv_cache, md):
    return paged_prefill_attention_triton(q, kv_cache, md.query_start_loc, md.seq_lens, md.block_tables, SCALE,
                                          md.max_query_len)


def decode(q, kv_cache, md, num_splits=None):
    return paged_decode_attention_triton(q, kv_cache, md.seq_lens, md.block_tables, SCALE, md.max_seq_len, num_splits)


# (block_size, num_heads, num_kv_heads, head_dim): block sizes 4/16, GQA 1/2/4 and a padded group of 3,
# head dims 16/32/64.
def _shape_id(s) -> str:
    return "bs{}-h{}-kv{}-d{}".format(*s)


SHAPES = [(4, 2, 2, 16), (16, 4, 2, 32), (4, 4, 1, 64), (16, 6, 2, 16)]
# Ragged batch: a fresh prompt, a Q=1 row (a decode inside a mixed batch), chunks after cached context
# (prefix hits / earlier chunks: 37 and 90 tokens already in the cache), up to 24 blocks of 4.
Q_LENS = [1, 7, 20, 3, 1]
CTX_LENS = [0, 0, 37, 90, 60]
DECODE_SEQ_LENS = [1, 9, 100, 300]


def _attention_tol(ref: torch.Tensor, md: AttentionMetadata) -> float:
    """Two fp32 attentions of the same inputs, summed in other orders: q.k over head_dim, then the softmax and its
    weighted sum over up to max_seq_len keys (the longer of the two reductions, counted for both)."""
    return rounding_tol(ref, terms=md.max_seq_len, steps=2)


@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
def test_prefill_kernel_matches_torch_fp32(shape):
    q, kv, md = paged_case(*shape, Q_LENS, CTX_LENS)
    ref = paged_attention_torch(q, kv, md, SCALE)
    torch.testing.assert_close(prefill(q, kv, md), ref, atol=_attention_tol(ref, md), rtol=0)


@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
@pytest.mark.parametrize("num_splits", [1, None, 5])  # None: auto (2 splits for 300 keys on CPU)
def test_decode_kernel_matches_torch_fp32(shape, num_splits):
    q, kv, md = paged_case(*shape, [1] * len(DECODE_SEQ_LENS), [s - 1 for s in DECODE_SEQ_LENS], seed=1)
    ref = paged_attention_torch(q, kv, md, SCALE)
    torch.testing.assert_close(decode(q, kv, md, num_splits), ref, atol=_attention_tol(ref, md), rtol=0)


def test_kernels_are_as_accurate_as_torch_against_fp64():
    # Larger q/k (peaky softmax) and long contexts: the two backends differ by rounding order only, and both are
    # within fp32 rounding of an fp64 evaluation. (Not "no worse than torch by a factor": which of two rounding
    # orders lands closer depends on the CPU's torch kernels -- 5.4e-6 vs torch's 4.5e-6 on one machine.)
    for kind, q_lens, ctx in (("prefill", [40, 300, 1], [0, 10, 290]), ("decode", [1, 1, 1], [300, 10, 299])):
        q, kv, md = paged_case(16, 4, 1, 16, q_lens, ctx, seed=5)
        q, kv = 4 * q, 4 * kv
        out = prefill(q, kv, md) if kind == "prefill" else decode(q, kv, md, num_splits=3)
        exact = paged_attention_torch(q.double(), kv.double(), md, SCALE)
        err_torch = (paged_attention_torch(q, kv, md, SCALE).double() - exact).abs().max()
        err_triton = (out.double() - exact).abs().max()
        bound = _attention_tol(exact, md)
        assert err_triton <= bound and err_torch <= bound, (kind, err_triton, err_torch, bound)


@pytest.mark.parametrize("dtype, tol", [(torch.float16, 1e-3), (torch.bfloat16, 8e-3)])
def test_half_precision_inputs(dtype, tol):
    # The kernels load fp16/bf16 and compute in fp32 here; the reference runs in fp32 on the same (rounded)
    # inputs, so the outputs differ by the final rounding only (half an ulp: at most 2^-8 relative for bf16,
    # 2^-11 for fp16): tol is 2x that (unchanged).
    q, kv, md = paged_case(16, 4, 2, 32, Q_LENS, CTX_LENS, dtype=dtype)
    out = prefill(q, kv, md)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), paged_attention_torch(q.float(), kv.float(), md, SCALE),
                               atol=tol, rtol=tol)
    q, kv, md = paged_case(4, 4, 1, 16, [1] * 4, [s - 1 for s in DECODE_SEQ_LENS], dtype=dtype, seed=2)
    out = decode(q, kv, md, num_splits=3)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), paged_attention_torch(q.float(), kv.float(), md, SCALE),
                               atol=tol, rtol=tol)


def test_chunked_prefill_over_the_cache_equals_one_shot():
    # The same 45-token sequence attended in one chunk, or as 30 cached tokens + a 15-token chunk, gives the
    # same outputs for the last 15 queries: earlier context is read through the block table.
    q, kv, md = paged_case(4, 4, 2, 16, [45], [0], seed=3)
    full = prefill(q, kv, md)
    md2 = AttentionMetadata(query_start_loc=torch.tensor([0, 15]), seq_lens=md.seq_lens,
                            slot_mapping=md.slot_mapping[30:], block_tables=md.block_tables,
                            token_req_idx=md.token_req_idx[30:], positions=md.positions[30:],
                            max_query_len=15, max_seq_len=45)
    # Other query tiles (other tl.dot shapes under the interpreter): equal up to rounding, not bit for bit.
    torch.testing.assert_close(prefill(q[30:], kv, md2), full[30:], atol=_attention_tol(full, md), rtol=0)


def test_launchers_reject_bad_inputs():
    q, kv, md = paged_case(4, 4, 2, 16, [3], [0])
    with pytest.raises(ValueError, match="dtype"):
        prefill(q.half(), kv, md)
    with pytest.raises(ValueError, match="multiple"):
        prefill(q[:, :3], kv, md)
    with pytest.raises(ValueError, match="one query per sequence"):
        decode(q, kv, md)


def test_config_resolves_and_validates_the_backend(tiny_models, monkeypatch):
    cfg = EngineConfig(model=tiny_models["qwen3"], device="cpu", max_model_len=64)
    assert cfg.attention_backend == "torch"  # "auto" on CPU, resolved once
    assert EngineConfig(model=tiny_models["qwen3"], device="cpu", max_model_len=64,
                        attention_backend="triton").attention_backend == "triton"  # the interpreter is on here
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(model=tiny_models["qwen3"], device="cpu", attention_backend="flash")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="needs CUDA, or TRITON_INTERPRET=1"):
        EngineConfig(model=tiny_models["qwen3"], device="cpu", attention_backend="triton")


# -- end to end -------------------------------------------------------------------------------------------------


def _generate(path: str, backend: str, prompts, params, **opts):
    llm = LLM(path, device="cpu", dtype="float32", max_model_len=512, block_size=16, skip_tokenizer_init=True,
              attention_backend=backend, **opts)
    assert llm.llm_engine.config.attention_backend == backend
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, [o.outputs[0] for o in outs]


def _assert_same(a, b, tol: float = LOGPROB_TOL) -> float:  # two attention backends: another summation order
    worst = 0.0
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        for lx, ly, t in zip(x.logprobs, y.logprobs, x.token_ids):
            assert lx[t].rank == ly[t].rank
            worst = max(worst, abs(lx[t].logprob - ly[t].logprob))
    assert worst <= tol, worst
    return worst


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
def test_triton_backend_matches_torch_end_to_end(tiny_models, arch, kernel_calls):
    # A 32-token budget chunks the longer prompts, so steps mix prefill chunks (over cached context) and decodes.
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 5, 17, 40)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    runs = {}
    for backend in ("torch", "triton"):
        runs[backend] = _generate(tiny_models[arch], backend, prompts, params, max_num_batched_tokens=32)[1]
        # torch: no Triton launch; triton: both kernels run (prefill/mixed steps, then all-decode steps).
        assert (len(kernel_calls["prefill"]) > 0) == (len(kernel_calls["decode"]) > 0) == (backend == "triton")
    _assert_same(runs["torch"], runs["triton"])


def test_triton_backend_prefix_hits_and_trace_replay(tiny_models, kernel_calls):
    rng = random.Random(1)
    prefix = [rng.randrange(3, VOCAB) for _ in range(40)]
    # The long prompt makes decode split its 300+ key context (auto: 2 splits on CPU).
    prompts = [prefix + [rng.randrange(3, VOCAB) for _ in range(k)] for k in (3, 11)]
    long_prompt = [rng.randrange(3, VOCAB) for _ in range(300)]
    traces = [[rng.randrange(3, VOCAB) for _ in range(6)] for _ in range(3)]
    runs = {}
    for backend in ("torch", "triton"):
        llm, first = _generate(tiny_models["qwen3"], backend, prompts[:1],
                               SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1),
                               enable_trace_replay=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts[1:] + [long_prompt, prefix]],
                            # One token per step: the replays must run the decode kernel on the long context.
                            [SamplingParams(trace_decode_token_ids=t, logprobs=1, trace_replay_chunk_size=1,
                                            skip_reading_prefix_cache=False)
                             for t in traces], use_tqdm=False)
        assert [o.num_cached_tokens for o in outs] == [32, 0, 32]  # two full blocks of the prefix hit
        comps = [o.outputs[0] for o in outs]
        assert [c.token_ids for c in comps] == traces
        runs[backend] = first + comps
    assert max(kernel_calls["splits"]) == 2  # the 300-token context was decoded in two splits
    _assert_same(runs["torch"], runs["triton"])


@pytest.mark.parametrize("max_seq_len", [None, 4096])  # None: the context itself; 4096: a graph's max_model_len
def test_decode_many_splits_at_batch_one(monkeypatch, max_seq_len):
    """W4's case in small: one sequence on a (mocked) 132-SM GPU with 32-key minimum chunks: its 300 keys go to
    10 splits (or 32 splits fixed for a long max_seq_len, of which the kernel fills 10 and leaves the rest empty),
    and the result still matches the torch reference."""
    monkeypatch.setattr(pa, "sm_count", lambda device: 132)
    monkeypatch.setenv(dl._SMALL_SPLIT_ENV, "32")
    splits = []
    monkeypatch.setattr(pa, "decode_num_splits", lambda *a: splits.append(dl.decode_num_splits(*a)) or splits[-1])
    q, kv, md = paged_case(16, 4, 2, 32, [1], [299], seed=4)
    ref = paged_attention_torch(q, kv, md, SCALE)
    out = paged_decode_attention_triton(q, kv, md.seq_lens, md.block_tables, SCALE, max_seq_len or md.max_seq_len)
    assert splits == [10 if max_seq_len is None else 32]
    torch.testing.assert_close(out, ref, atol=_attention_tol(ref, md), rtol=0)


def test_reduce_rows_combine_each_row_as_one_row_programs_do(monkeypatch):
    """Several q heads per reduce program (decode_launch.reduce_rows: 8 from 8,192 (sequence, q head) rows; forced
    here): every row combined as a one-row program combines it, bit for bit, including a last program whose rows run
    past the head count (19 heads in programs of 8), and still the torch reference."""
    q, kv, md = paged_case(4, 19, 1, 16, [1] * 3, [40, 299, 7], seed=5)
    outs = {}
    for rows in ("1", "8"):
        monkeypatch.setenv(dl._REDUCE_ROWS_ENV, rows)
        outs[rows] = decode(q, kv, md, num_splits=4)
    assert torch.equal(outs["1"], outs["8"])
    ref = paged_attention_torch(q, kv, md, SCALE)
    torch.testing.assert_close(outs["8"], ref, atol=_attention_tol(ref, md), rtol=0)


# -- The compiled kernels on CUDA (marker `gpu`, skipped on CPU; bench/gpu_check.sh runs them on the lent H200): on
# Qwen3-0.6B attention shapes, and whole engines. --------------------------------------------------------------
def _to_cuda(q, kv, md):
    for name in ("query_start_loc", "seq_lens", "slot_mapping", "block_tables", "token_req_idx", "positions"):
        setattr(md, name, getattr(md, name).cuda())
    return q.cuda(), kv.cuda(), md


def _cases():
    rng = random.Random(0)
    q_lens = [1, 1] + [rng.randrange(2, 512) for _ in range(6)]  # decode rows inside a mixed batch
    ctx = [rng.randrange(0, 1024) for _ in q_lens]
    yield "prefill", prefill, [q_lens, ctx], {}
    for num_seqs, max_len in ((64, 2048), (4, 4096)):  # many sequences: 1 split; few long ones: ~9 splits
        seq_lens = [rng.randrange(1, max_len) for _ in range(num_seqs - 1)] + [max_len]
        yield f"decode{num_seqs}", decode, [[1] * num_seqs, [s - 1 for s in seq_lens]], {}
    yield "decode-7splits", decode, [[1] * 4, [4000, 17, 1, 2500]], {"num_splits": 7}
    # A mixed step, 40 decode rows first, then prompt chunks: the prefill kernel's flat numbering (the default
    # path), and REPLAYLLM_SPLIT_MIXED_ATTENTION's routing of the same step.
    q_lens = [1] * 40 + [rng.randrange(2, 512) for _ in range(6)]
    ctx = [rng.randrange(0, 1024) for _ in q_lens]
    yield "mixed", prefill, [q_lens, ctx], {}
    yield "mixed-split", split_mixed, [q_lens, ctx], {}


def split_mixed(q, kv, md):
    md = dataclasses.replace(md, host_query_start_loc=md.query_start_loc.cpu().numpy(),
                             host_seq_lens=md.seq_lens.cpu().numpy())
    return attention._split_mixed(q, kv, md, SCALE, attention.leading_decode_rows(md))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kernels_vs_torch_on_cuda(dtype):
    # Qwen3-0.6B attention: 16 q heads, 8 kv heads, head_dim 128, 16-token blocks.
    for name, fn, lens, kw in _cases():
        q, kv, md = _to_cuda(*paged_case(16, 16, 8, 128, *lens, dtype=dtype))
        out = fn(q, kv, md, **kw)
        ref = paged_attention_torch(q, kv, md, SCALE)
        exact = paged_attention_torch(q.float(), kv.float(), md, SCALE)  # fp32 on the same (rounded) inputs
        d_torch = (out.float() - ref.float()).abs().max().item()
        e_triton = (out.float() - exact).abs().max().item()
        e_torch = (ref.float() - exact).abs().max().item()
        t_triton = cuda_ms(partial(fn, q, kv, md, **kw))
        t_torch = cuda_ms(partial(paged_attention_torch, q, kv, md, SCALE))
        print(f"\n[paged attention cuda] {name} {dtype}: max|triton-torch| {d_torch:.2e}; vs fp32: triton "
              f"{e_triton:.2e}, torch {e_torch:.2e}; {t_triton:.3f} ms vs torch {t_torch:.3f} ms")
        if dtype == torch.float32:
            assert d_torch <= 1e-4
        else:
            assert e_triton <= 0.05


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(71, 1, 64), (16, 16, 256), (8, 4, 256)], ids=["falcon7b", "gptj", "gemma2"])
def test_decode_wide_groups_and_heads_on_cuda(heads):
    """The decode launch rules' other branches on the GPU, bf16: Falcon-7B's 71 q heads on one kv head (the 4-warp
    tile; at 128 sequences 3 splits and 8 heads per reduce program) and 256-wide heads (their own tile), against
    fp32 attention on the same rounded inputs, at 128 sequences, 64 (one split for GPT-J's 16 KV heads) and 4 long
    ones (several splits)."""
    num_heads, num_kv_heads, head_dim = heads
    for num_seqs, ctx in ((128, [300] * 128), (64, [300] * 63 + [1500]), (4, [4000, 17, 1, 2500])):
        q, kv, md = _to_cuda(*paged_case(16, num_heads, num_kv_heads, head_dim, [1] * num_seqs, ctx,
                                         dtype=torch.bfloat16, seed=6))
        out = decode(q, kv, md)
        exact = paged_attention_torch(q.float(), kv.float(), md, SCALE)
        assert (out.float() - exact).abs().max().item() <= 0.05


def _generate_cuda(path, backend, dtype, prompts, params, **kw):
    llm = LLM(path, device="cuda", dtype=dtype, max_model_len=512, skip_tokenizer_init=True,
              attention_backend=backend, **kw)
    assert llm.llm_engine.config.attention_backend == backend
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def _deltas(a, b) -> torch.Tensor:
    return torch.tensor([abs(x[t].logprob - y[t].logprob) for ca, cb in zip(a, b)
                         for x, y, t in zip(ca.logprobs, cb.logprobs, ca.token_ids)])


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
def test_engine_triton_vs_torch_on_cuda(tiny_models, arch):
    rng = random.Random(1)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 5, 16, 17, 33, 64, 90, 300)]
    traces = [[rng.randrange(3, VOCAB) for _ in range(24)] for _ in prompts]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    replay = [SamplingParams(trace_decode_token_ids=t, logprobs=1) for t in traces]

    def run(backend, dtype):  # (greedy completions under chunked prefill, trace-replay completions)
        out = (_generate_cuda(tiny_models[arch], backend, dtype, prompts, greedy, max_num_batched_tokens=128),
               _generate_cuda(tiny_models[arch], backend, dtype, prompts, replay, enable_trace_replay=True))
        assert [c.token_ids for c in out[1]] == traces
        return out

    fp32 = {b: run(b, "float32") for b in ("torch", "triton")}
    d32 = torch.cat([_deltas(fp32["torch"][i], fp32["triton"][i]) for i in (0, 1)])
    same_greedy = [c.token_ids for c in fp32["torch"][0]] == [c.token_ids for c in fp32["triton"][0]]
    bf16 = {b: run(b, "bfloat16") for b in ("torch", "triton")}
    d16 = _deltas(bf16["torch"][1], bf16["triton"][1])
    err = {b: _deltas(bf16[b][1], fp32["torch"][1]) for b in bf16}  # bf16 engines vs the fp32 one, same traces
    print(f"\n[attention backend cuda] {arch}: fp32 triton vs torch |dlogprob| mean {d32.mean():.2e} max "
          f"{d32.max():.2e}, same greedy tokens {same_greedy}; bf16 triton vs torch mean {d16.mean():.2e} max "
          f"{d16.max():.2e}; bf16 vs fp32: torch mean {err['torch'].mean():.2e} max {err['torch'].max():.2e}, "
          f"triton mean {err['triton'].mean():.2e} max {err['triton'].max():.2e}")
    assert same_greedy and d32.max() <= 1e-4
    # bf16: the Triton kernels are no less accurate than torch's bf16 attention, measured against fp32.
    assert err["triton"].mean() <= 1.5 * err["torch"].mean() + 1e-3


@pytest.mark.gpu
def test_qwen3_0_6b_dummy_bf16_triton_vs_torch():
    path, prompts, traces = dummy_trace_case(2, (7, 64, 200, 511, 700, 900))
    params = [SamplingParams(trace_decode_token_ids=t, logprobs=1) for t in traces]
    runs = {}
    for backend in ("torch", "triton"):
        llm = LLM(path, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True, device="cuda",
                  max_model_len=1024, max_num_seqs=8, enable_trace_replay=True, attention_backend=backend)
        runs[backend] = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                            use_tqdm=False)]
        assert [c.token_ids for c in runs[backend]] == traces
        del llm
    d = _deltas(runs["torch"], runs["triton"])
    print(f"\n[attention backend cuda] qwen3-0.6B dummy bf16: trace |dlogprob| triton vs torch mean {d.mean():.2e} "
          f"max {d.max():.2e} over {d.numel()} tokens")
    assert torch.isfinite(d).all() and d.max() < 0.5
    auto = LLM(path, load_format="dummy", dtype="bfloat16", skip_tokenizer_init=True, device="cuda",
               max_model_len=64, max_num_seqs=8)
    assert auto.llm_engine.config.attention_backend == "triton"  # "auto" on CUDA
