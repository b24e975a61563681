"""Sliding-window attention past the window: a max_model_len longer than the model's `sliding_window` runs the
window in the layers that have one (model_config.layer_sliding_windows; Attention.fit_context), in every attention
path: the torch backend, the Triton prefill and split-decode kernels (the interpreter here; compiled in
bench/compile_sm90.py and on the GPU by bench/gpu_check.sh), chunked prefill, prefix-cache hits and batch-invariant
mode; with Gemma 2's soft-capped scores too. Against transformers' teacher-forced log_softmax, which applies the
same windows. bench/gpu_check.sh runs this
file with the engine and the kernels on CUDA (REPLAYLLM_TEST_DEVICE=cuda, transformers on the CPU)."""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers.hf_reference import teacher_forced
from helpers.tolerances import LOGPROB_TOL, rounding_tol
from helpers.trace_replay_common import DEVICE

from replayllm import LLM, SamplingParams
from replayllm.config import EngineConfig
from replayllm.kernels.batch_invariant_attention import paged_attention_invariant_torch
from replayllm.kernels.paged_attention import paged_decode_attention_triton, paged_prefill_attention_triton
from replayllm.model_runner_v2.attention import Attention

SMALL = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, rms_norm_eps=1e-6, initializer_range=0.5, max_position_embeddings=128,
             pad_token_id=0, bos_token_id=1, eos_token_id=2)
WINDOW = 8
MODELS = {
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=WINDOW)),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, dict(sliding_window=WINDOW)),
    # the second of two layers slides (max_window_layers 1)
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
              dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    # the first of two layers slides (layer_types' default), attention scores and logits soft-capped
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM,
               dict(sliding_window=WINDOW, head_dim=16, attn_logit_softcapping=1.5, final_logit_softcapping=2.0,
                    attn_implementation="eager")),  # the reference: transformers' SDPA path has no soft cap
}


@pytest.fixture(scope="module")
def windowed(tmp_path_factory) -> dict:
    out = {}
    for name, (config_cls, model_cls, extra) in MODELS.items():
        torch.manual_seed(0)
        hf = model_cls(config_cls(**SMALL, **extra)).to(torch.float32).eval()
        path = str(tmp_path_factory.mktemp(name))
        hf.save_pretrained(path)
        out[name] = (path, hf)
    return out


def _case(seed: int = 3) -> tuple[list[list[int]], list[list[int]]]:
    """Three prompts (5, 20 and 30 tokens: within, past and far past the window) and a 14-token trace each."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 20, 30)]
    return prompts, [torch.randint(3, 300, (14,), generator=g).tolist() for _ in prompts]


def _assert_matches_transformers(llm: LLM, hf, prompts, traces) -> None:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(trace_decode_token_ids=t, logprobs=0) for t in traces], use_tqdm=False)
    for prompt, trace, out in zip(prompts, traces, outs):
        comp = out.outputs[0]
        assert comp.token_ids == trace
        lp, tokens = teacher_forced(hf, prompt, trace)
        engine = torch.tensor([d[t].logprob for t, d in zip(trace, comp.logprobs)])
        assert (engine - lp[torch.arange(len(tokens)), tokens]).abs().max().item() <= LOGPROB_TOL


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("arch", list(MODELS))
def test_past_the_window_the_engine_scores_what_transformers_scores(windowed, arch, backend):
    """Chunked prefill (16-token steps cut the 30-token prompt) and decode, 44 tokens with a window of 8."""
    path, hf = windowed[arch]
    llm = LLM(path, device=DEVICE, dtype="float32", skip_tokenizer_init=True, enable_trace_replay=True,
              max_model_len=64, max_num_batched_tokens=16, attention_backend=backend)
    windows = llm.apply_model(lambda m: [a.window for a in m.modules() if isinstance(a, Attention)])[0]
    assert windows == {"qwen2": [0, WINDOW], "gemma2": [WINDOW, 0]}.get(arch, [WINDOW, WINDOW])
    prompts, traces = _case()
    _assert_matches_transformers(llm, hf, prompts, traces)
    # a prefix-cache hit: the same 20-token prompt again, its cached blocks past the window read through the window
    _assert_matches_transformers(llm, hf, prompts[1:2], traces[1:2])


def test_the_window_runs_by_default_and_disable_sliding_window_caps_at_it(windowed):
    """As vLLM: max_model_len defaults to max_position_embeddings and the window runs past W;
    disable_sliding_window caps max_model_len at W (a longer one is refused) and runs the full-causal kernels, the
    same computation there; a model without a window keeps its position limit either way."""
    path = windowed["mistral"][0]
    assert EngineConfig(model=path, device="cpu").max_model_len == SMALL["max_position_embeddings"]
    assert EngineConfig(model=path, device="cpu", disable_sliding_window=True, max_model_len=5).max_model_len == 5
    with pytest.raises(ValueError, match=f"max_model_len=9 exceeds the model's sliding_window={WINDOW}"):
        EngineConfig(model=path, device="cpu", disable_sliding_window=True, max_model_len=WINDOW + 1)
    with pytest.raises(ValueError, match="disable_sliding_window must be a bool"):
        EngineConfig(model=path, device="cpu", disable_sliding_window="yes")
    llm = LLM(path, device=DEVICE, dtype="float32", skip_tokenizer_init=True)
    assert llm.apply_model(lambda m: {a.window for a in m.modules() if isinstance(a, Attention)}) == [{WINDOW}]
    capped = LLM(path, device=DEVICE, dtype="float32", skip_tokenizer_init=True, disable_sliding_window=True)
    assert capped.llm_engine.config.max_model_len == WINDOW
    assert capped.apply_model(lambda m: {a.window for a in m.modules() if isinstance(a, Attention)}) == [{0}]
    torch.manual_seed(0)
    transformers.MistralForCausalLM(transformers.MistralConfig(**SMALL, sliding_window=None)).save_pretrained(
        plain := path + "-no-window")
    assert EngineConfig(model=plain, device="cpu", disable_sliding_window=True).max_model_len == 128


def test_the_window_matters(windowed):
    """An engine made to ignore the window scores a 30-token prompt differently from transformers."""
    path, hf = windowed["mistral"]
    wide = LLM(path, device=DEVICE, dtype="float32", skip_tokenizer_init=True, enable_trace_replay=True,
               max_model_len=64)
    wide.apply_model(lambda m: [a.set_window(None) for a in m.modules() if isinstance(a, Attention)])
    prompts, traces = _case()
    with pytest.raises(AssertionError):
        _assert_matches_transformers(wide, hf, prompts[2:], traces[2:])


def test_batch_invariant_rows_equal_solo_runs_past_the_window(windowed):
    path, _ = windowed["mistral"]
    llm = LLM(path, device=DEVICE, dtype="float32", skip_tokenizer_init=True, max_model_len=64, batch_invariant=True)
    prompts, _ = _case()
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=10, logprobs=3, ignore_eos=True)

    def run(batch):
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
                for o in outs]

    together = run(prompts)
    assert [run([p])[0] for p in prompts] == together


@pytest.mark.parametrize("softcap", [0.0, 1.5], ids=["plain", "softcap"])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_the_kernels_window_equals_a_dense_reference(num_splits, softcap):
    """The Triton prefill and decode kernels (interpreter) against dense attention with the window's mask: a decode
    split wholly before the window stays empty and drops out of the combine. With Gemma 2's soft-capping (a cap low
    enough to change every score) too, and the batch-invariant torch path's."""
    g = torch.Generator().manual_seed(0)
    hq, hkv, d, bs, window = 4, 2, 16, 4, 5
    seq_lens = [3, 9, 23]
    blocks = [-(-n // bs) for n in seq_lens]
    kv = torch.randn(2, sum(blocks) + 1, bs, hkv, d, generator=g)
    perm = torch.randperm(sum(blocks), generator=g)
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    at = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = perm[at:at + n].int()
        at += n

    def dense(i: int, positions: list[int], q: torch.Tensor) -> torch.Tensor:  # q [len(positions), Hq, D]
        slots = [int(tables[i, j // bs]) * bs + j % bs for j in range(seq_lens[i])]
        k, v = (kv[c].reshape(-1, hkv, d)[slots].repeat_interleave(hq // hkv, 1) for c in (0, 1))  # [L, Hq, D]
        s = torch.einsum("qhd,khd->hqk", q, k) * d**-0.5
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        kj, qp = torch.arange(seq_lens[i]), torch.tensor(positions)
        s = s.masked_fill(~((kj[None] <= qp[:, None]) & (kj[None] > qp[:, None] - window)), float("-inf"))
        return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)

    q = torch.randn(len(seq_lens), hq, d, generator=g)
    lens = torch.tensor(seq_lens)
    on = {"device": DEVICE}  # CUDA: the compiled kernels; CPU: the interpreter
    tol = rounding_tol(1, terms=d * max(seq_lens), steps=3)  # fp32 sums over D and the keys in another order
    out = paged_decode_attention_triton(q.to(**on), kv.to(**on), lens.to(**on), tables.to(**on), d**-0.5,
                                        max(seq_lens), num_splits=num_splits, window=window, softcap=softcap).cpu()
    for i, n in enumerate(seq_lens):
        torch.testing.assert_close(out[i], dense(i, [n - 1], q[i:i + 1])[0], rtol=tol, atol=tol)
    q_lens = [2, 5, 11]  # the last q_lens[i] positions of each sequence
    qp = torch.randn(sum(q_lens), hq, d, generator=g)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    out = paged_prefill_attention_triton(qp.to(**on), kv.to(**on), qsl.to(**on), lens.to(**on), tables.to(**on),
                                         d**-0.5, max(q_lens), window=window, softcap=softcap).cpu()
    for i, (n, m) in enumerate(zip(seq_lens, q_lens)):
        ref = dense(i, list(range(n - m, n)), qp[qsl[i]:qsl[i + 1]])
        torch.testing.assert_close(out[qsl[i]:qsl[i + 1]], ref, rtol=tol, atol=tol)
    token_req = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(q_lens))
    positions = torch.cat([torch.arange(n - m, n) for n, m in zip(seq_lens, q_lens)])
    inv = paged_attention_invariant_torch(qp, kv, token_req, positions, tables, d**-0.5, max(seq_lens), window,
                                          softcap)
    for i, (n, m) in enumerate(zip(seq_lens, q_lens)):
        ref = dense(i, list(range(n - m, n)), qp[qsl[i]:qsl[i + 1]])
        torch.testing.assert_close(inv[qsl[i]:qsl[i + 1]], ref, rtol=tol, atol=tol)
