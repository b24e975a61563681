"""enable_fp32_lm_head: final norm, lm_head and log-softmax in fp32 for a bf16 model. Checked against a plain-torch
fp32 head on the model's own last-layer output, against an fp32 reference model (closer with the option), as a
no-op on an fp32 model, as a diff SPEC option and a CLI flag; with CUDA graphs on the GPU (marker gpu)."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
from helpers.tolerances import rounding_tol

from replayllm import LLM, SamplingParams
from replayllm.config import FAST_REPLAY_CHUNK_SIZE, EngineConfig
from replayllm.entrypoints.cli.engine_args import engine_kwargs as cli_engine_kwargs
from replayllm.entrypoints.cli.main import build_parser
from replayllm.entrypoints.diff import parse_spec
from replayllm.entrypoints.diff.resolved import engine_resolved
from replayllm.entrypoints.diff.spec import engine_kwargs

PROMPTS = [[12522, 5193, 264, 882], [785, 6722, 315, 9625, 374]]  # "Once upon a time", "The capital of France is"
# Greedy fp32 completions of PROMPTS (16 tokens each; test_closer_... checks they still are): traces a model
# writes itself, where the head's rounding matters most (the likely tokens have the largest logits).
TRACES = [[14387, 46467, 37168, 144661, 130520, 33455, 149568, 7068, 145839, 80204, 36486, 16378, 25214, 129896,
           62118, 112784],
          [140688, 122303, 31631, 87648, 151721, 29270, 56591, 118963, 48005, 84662, 29275, 148626, 67916, 138226,
           54618, 92822]]


def _replay(llm: LLM, requests: slice = slice(None), chunk: int = FAST_REPLAY_CHUNK_SIZE) -> np.ndarray:
    """The trace tokens' logprobs of PROMPTS[requests] (one batch), concatenated [n] float64. chunk: the
    requests' trace_replay_chunk_size (fast replay unless told)."""
    params = [SamplingParams(trace_decode_token_ids=t, logprobs=1, detokenize=False, trace_replay_chunk_size=chunk)
              for t in TRACES[requests]]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[requests]], params, use_tqdm=False)
    return np.array([d[t].logprob for o in outs for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])


def _engine(device: str = "cpu", **options) -> LLM:
    # 32 KV blocks of 16 tokens: plenty for two short requests, and no 1 GiB CPU cache to allocate.
    return LLM(device=device, max_model_len=128, enable_trace_replay=True, skip_tokenizer_init=True,
               num_gpu_blocks_override=32, **options)


@pytest.fixture(scope="module")
def head_engine() -> LLM:
    return _engine(dtype="bfloat16", enable_fp32_lm_head=True)


def test_the_head_is_fp32_from_the_upcast_last_layer_output_to_the_logits(head_engine):
    llm = head_engine
    lm = llm.llm_engine.runner.model
    assert lm.lm_head.weight.dtype == torch.float32 and lm.model.embed_tokens.weight.dtype == torch.bfloat16
    assert lm.lm_head.weight is not lm.model.embed_tokens.weight  # the tied head got its own fp32 copy
    assert torch.equal(lm.lm_head.weight, lm.model.embed_tokens.weight.float())
    last, heads = [], []
    hooks = [lm.model.layers[-1].register_forward_hook(lambda m, a, out: last.append(out)),
             lm.lm_head.register_forward_hook(lambda m, a, out: heads.append((a[0], out)))]
    try:
        _replay(llm, slice(0, 1), chunk=1)  # one request, one token per step: each step scores its last row
    finally:
        for h in hooks:
            h.remove()
    assert len(last) == len(heads) > 2
    norm = lm.model.norm
    for (mlp_out, residual), (hidden, logits) in zip(last, heads):
        assert mlp_out.dtype == torch.bfloat16 and hidden.dtype == logits.dtype == torch.float32
        # A plain-torch fp32 head on the last layer's bf16 outputs, upcast before the residual add.
        h = mlp_out.float() + residual.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.float()
        ref = h[-1:] @ lm.lm_head.weight.T
        # Another implementation of the norm (a mean over hidden) and the head (dots over hidden): fp32 rounding.
        torch.testing.assert_close(logits, ref, rtol=0, atol=rounding_tol(ref, terms=h.shape[-1], steps=2))


def test_closer_to_the_fp32_reference_and_a_no_op_on_an_fp32_model(head_engine):
    runs = {"bf16+head": _replay(head_engine)}
    for name, options in (("fp32", dict(dtype="float32")),
                          ("fp32+head", dict(dtype="float32", enable_fp32_lm_head=True)),
                          ("bf16", dict(dtype="bfloat16"))):
        llm = _engine(**options)
        runs[name] = _replay(llm)
        if name == "fp32":
            greedy = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                  SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
            assert [list(o.outputs[0].token_ids) for o in greedy] == TRACES
        del llm
        gc.collect()
    assert np.array_equal(runs["fp32"], runs["fp32+head"])  # bit for bit: nothing changes in fp32
    without = np.abs(runs["bf16"] - runs["fp32"]).mean()
    with_head = np.abs(runs["bf16+head"] - runs["fp32"]).mean()
    print(f"\n[fp32 head] embedded model, bf16 vs fp32 mean |dlogprob|: {without:.4f} without, {with_head:.4f} with")
    assert with_head < 0.8 * without  # measured here: 0.0434 -> 0.0270 on four prompts


def test_diff_spec_cli_flag_and_resolved_facts():
    spec = parse_spec("dtype=bfloat16,enable_fp32_lm_head=true")
    assert spec.options == {"dtype": "bfloat16", "enable_fp32_lm_head": True}
    facts = engine_resolved(EngineConfig(**engine_kwargs(spec, None, 5)))
    assert facts["enable_fp32_lm_head"] is True and facts["dtype"] == "bfloat16"
    assert engine_resolved(EngineConfig(skip_tokenizer_init=True))["enable_fp32_lm_head"] is False
    args = build_parser().parse_args(["generate", "--enable-fp32-lm-head"])
    assert cli_engine_kwargs(args)["enable_fp32_lm_head"] is True
    with pytest.raises(ValueError, match="enable_fp32_lm_head must be a bool"):
        EngineConfig(enable_fp32_lm_head="yes")


@pytest.mark.gpu
def test_gpu_cuda_graphs_match_eager_and_the_head_helps():
    """The embedded model in bf16 on the GPU (triton attention, steps replayed from CUDA graphs): the fp32
    head gives eager's logprobs and is closer to the fp32 model than plain bf16."""
    runs = {}
    for name, options in (("fp32", dict(dtype="float32")), ("bf16", dict(dtype="bfloat16")),
                          ("head", dict(dtype="bfloat16", enable_fp32_lm_head=True)),
                          ("head-eager", dict(dtype="bfloat16", enable_fp32_lm_head=True, enforce_eager=True))):
        llm = _engine("cuda", **options)
        runs[name] = _replay(llm)
        runner = llm.llm_engine.runner
        if name == "head-eager":
            assert runner.graph_runner is None and runner.piecewise is None
        else:  # the fast-replay chunks (and prefills) through piecewise graphs, any uniform decode step whole
            assert runner.piecewise.num_replays + runner.graph_runner.num_replays > 0
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    graphs_vs_eager = np.abs(runs["head"] - runs["head-eager"]).max()
    without = np.abs(runs["bf16"] - runs["fp32"]).mean()
    with_head = np.abs(runs["head"] - runs["fp32"]).mean()
    print(f"\n[fp32 head] embedded model on the GPU, bf16 vs fp32 mean |dlogprob|: {without:.4f} without, "
          f"{with_head:.4f} with; graphs vs eager max {graphs_vs_eager:.1e}")
    assert graphs_vs_eager <= 1e-3  # bf16 layers: graph and eager decode may round differently
    assert with_head < 0.8 * without
