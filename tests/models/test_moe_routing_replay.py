"""Routing replay (issue 30, docs/moe.md): SamplingParams.trace_routed_experts forces a request's experts at its
first P positions. A sampled run's routes replayed with its tokens give its logprobs bit for bit; other routes
change them and are what the capture reports; bad routes are ValueErrors at admission; prefix caching, chunked
prefill, fast replay and preemption change nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_moe import _llm, _prompt, moe  # noqa: F401  (moe: the module's checkpoints fixture)

from replayllm import LLM, SamplingParams
from replayllm.model_runner_v2.models.moe import route, route_forced


def _run(llm: LLM, prompt: list[int], **params):
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(**params), use_tqdm=False)[0]
    return out.outputs[0], out.num_cached_tokens


def _logprobs(comp) -> list[float]:
    return [d[t].logprob for t, d in zip(comp.token_ids, comp.logprobs)]


def _shifted(routes: np.ndarray, moe_layers, num_experts: int) -> np.ndarray:
    """Other routes of the same shape: every sparse layer's ids moved to the next expert (still distinct)."""
    other = routes.copy()
    layers = list(moe_layers)
    other[:, layers] = (other[:, layers] + 1) % num_experts
    return other


def test_route_forced_rows_of_minus_one_route_as_usual():
    logits = torch.randn(6, 8)
    forced = torch.full((6, 2), -1, dtype=torch.int16)
    forced[2] = torch.tensor([5, 1])
    for norm in (True, False):
        w, ids = route(logits, 2, norm)
        fw, fids = route_forced(logits, forced, 2, norm)
        free = [0, 1, 3, 4, 5]
        assert torch.equal(fw[free], w[free]) and torch.equal(fids[free], ids[free])
        assert fids[2].tolist() == [5, 1]
        probs = logits[2].softmax(-1)[[5, 1]]
        assert torch.allclose(fw[2], probs / probs.sum() if norm else probs)


@pytest.mark.parametrize("name", ["norm", "plain"])
def test_replayed_routes_give_the_sampled_logprobs_bitwise(moe, name):  # noqa: F811
    path, _ = moe[name]
    llm = _llm(path, enable_return_routed_experts=True)
    prompt = _prompt(14, 8)
    sampled, _ = _run(llm, prompt, temperature=1.0, seed=3, max_tokens=10, ignore_eos=True, logprobs=1)
    routes = sampled.routed_experts
    assert routes.shape[0] == len(prompt) + 9
    replay, _ = _run(llm, prompt, trace_decode_token_ids=sampled.token_ids, trace_replay_chunk_size=1, logprobs=1,
                     trace_routed_experts=routes)
    assert replay.token_ids == sampled.token_ids
    assert _logprobs(replay) == _logprobs(sampled)  # the same computation, the same bits
    assert np.array_equal(replay.routed_experts, routes)
    # Nested lists (what JSON gives) are the same routes.
    again, _ = _run(llm, prompt, trace_decode_token_ids=sampled.token_ids, trace_replay_chunk_size=1, logprobs=1,
                    trace_routed_experts=routes.tolist())
    assert _logprobs(again) == _logprobs(sampled)


def test_other_routes_change_logprobs_and_are_captured(moe):  # noqa: F811
    path, _ = moe["norm"]
    llm = _llm(path, enable_return_routed_experts=True)
    mc = llm.llm_engine.model_config
    prompt = _prompt(14, 8)
    plain, _ = _run(llm, prompt, temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
    forced = _shifted(plain.routed_experts[: len(prompt)], mc.moe_layers, mc.num_experts)  # the prompt's only
    # The router logits of every position, recorded from the sparse layers' gates (one request: steps in order).
    gates = {i: [] for i in mc.moe_layers}
    model = llm.llm_engine.runner.model
    hooks = [model.model.layers[i].mlp.gate.register_forward_hook(
        lambda _m, _x, y, i=i: gates[i].append(y.detach().clone())) for i in mc.moe_layers]
    try:
        out, _ = _run(llm, prompt, trace_decode_token_ids=plain.token_ids, trace_replay_chunk_size=1, logprobs=1,
                      trace_routed_experts=forced)
    finally:
        for h in hooks:
            h.remove()
    diff = np.abs(np.array(_logprobs(out)) - _logprobs(plain))
    assert diff.max() > 1e-3  # other experts on the prompt: other K/V, other logprobs
    routes = out.routed_experts
    assert np.array_equal(routes[: len(prompt)], forced)
    # After P: the model's own top-k of its router, given the forced prefix.
    for layer in mc.moe_layers:
        probs = torch.cat(gates[layer])[: routes.shape[0]].float().softmax(-1)
        top = probs.topk(3, dim=-1)
        clear = (top.values[:, 1] - top.values[:, 2]) > 1e-4
        own = top.indices[:, :2].numpy()
        tail = np.arange(routes.shape[0]) >= len(prompt)
        assert (routes[:, layer] == own)[clear.numpy() & tail].all()
        assert (clear.numpy() & tail).sum() >= 6


def test_bad_routes_are_value_errors(moe, tiny_models):  # noqa: F811
    for bad, match in [([[1, 2]], "must be a non-empty integer array"), ([[[0], [1, 2]]], "rectangular"),
                       (np.zeros((2, 3, 2)) + 0.5, "integer expert ids"), (np.full((1, 3, 2), -2), "got values"),
                       ([[[True, False], [-1, -1], [2, 3]]], "integer expert ids, got a bool"),  # numpy: 1 and 0
                       (np.full((1, 3, 2), 65543), r"from 0 to 32767 .* got values in \[65543, 65543\]"),
                       (np.array([[[1, 1], [-1, -1], [0, 3]]]), r"trace_routed_experts\[0\]\[0\] names one expert "
                                                               "twice")]:
        with pytest.raises(ValueError, match=match):
            SamplingParams(trace_routed_experts=bad)
    path, _ = moe["norm"]  # 3 layers (1 dense), 8 experts, top 2
    llm = _llm(path, enable_trace_replay=False)  # no trace needed: routes alone are fine
    prompt = _prompt(6, 1)
    ok = np.array([[[0, 1], [-1, -1], [2, 3]]] * 8)
    cases = [(ok[:, :2], r"must be \[positions, 3, 2\]"), (ok[..., :1], r"must be \[positions, 3, 2\]"),
             (np.where(ok == 3, 8, ok), "expert 8, past num_experts=8"),
             (np.concatenate([ok[:, :1], ok[:, 2:] + 2, ok[:, 2:]], axis=1), "layer 1 is dense"),
             (np.where(ok == 2, -1, ok), r"\[0\]\[2\] has a negative id on a sparse layer"),
             (np.concatenate([ok, ok[:1]]), r"9 positions, more than this request can run \(8")]
    for routes, match in cases:
        with pytest.raises(ValueError, match=match):
            _run(llm, prompt, max_tokens=3, trace_routed_experts=routes)
    out, _ = _run(llm, prompt, max_tokens=3, temperature=0, trace_routed_experts=ok)  # 6 + 3 - 1 = 8 positions
    assert len(out.token_ids) == 3
    dense = LLM(tiny_models["qwen3"], device="cpu", dtype="float32", skip_tokenizer_init=True, max_model_len=64)
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        _run(dense, prompt, trace_routed_experts=ok)


def test_prefix_cache_chunking_fast_replay_and_preemption_change_nothing(moe):  # noqa: F811
    path, _ = moe["norm"]
    # Fast replay (8 a step) and a prefill chunked over 5-token steps, no prefix caching (batch-invariant: bitwise
    # across batch shapes).
    chunked = _llm(path, enable_return_routed_experts=True, batch_invariant=True, max_num_batched_tokens=5,
                   enable_prefix_caching=False)
    mc = chunked.llm_engine.model_config
    prompt, trace = _prompt(23, 9), _prompt(12, 10)
    plain, _ = _run(chunked, prompt, trace_decode_token_ids=trace, trace_replay_chunk_size=1, logprobs=1)
    forced = _shifted(plain.routed_experts, mc.moe_layers, mc.num_experts)  # every position forced
    base = dict(trace_decode_token_ids=trace, logprobs=1, trace_routed_experts=forced)
    ref, _ = _run(chunked, prompt, trace_replay_chunk_size=1, **base)
    assert np.array_equal(ref.routed_experts, forced) and _logprobs(ref) != _logprobs(plain)
    out, _ = _run(chunked, prompt, trace_replay_chunk_size=8, **base)
    assert _logprobs(out) == _logprobs(ref) and np.array_equal(out.routed_experts, forced)
    # Prefix caching: the forced run's blocks are cached under its routes. A plain request of the same prompt
    # reads none of them; the same routes again read them (batch-invariant: a cache read changes no bit).
    cache = _llm(path, enable_return_routed_experts=True, batch_invariant=True)
    first, cached = _run(cache, prompt, trace_replay_chunk_size=1, **base)
    assert cached == 0 and _logprobs(first) == _logprobs(ref)
    again, cached = _run(cache, prompt, trace_decode_token_ids=trace, trace_replay_chunk_size=1, logprobs=1,
                         skip_reading_prefix_cache=False)
    assert cached == 0 and _logprobs(again) == _logprobs(plain)
    hit, cached = _run(cache, prompt, trace_replay_chunk_size=1, **base)
    assert cached > 0 and _logprobs(hit) == _logprobs(ref) and np.array_equal(hit.routed_experts, forced)
    # Preemption: 4 forced requests in 20 blocks of 4; the recompute replays the same routes.
    small = _llm(path, enable_return_routed_experts=True, batch_invariant=True, num_gpu_blocks_override=20,
                 enable_prefix_caching=False, max_model_len=64)
    prompts = [_prompt(10, 20 + i) for i in range(4)]
    alone = [_run(chunked, p, temperature=0, max_tokens=20, ignore_eos=True, logprobs=1,
                  trace_routed_experts=forced[:15]) for p in prompts]
    outs = small.generate([{"prompt_token_ids": p} for p in prompts],
                          SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=1,
                                         trace_routed_experts=forced[:15]), use_tqdm=False)
    assert small.llm_engine.scheduler.num_preemptions > 0
    for (ref_out, _), out in zip(alone, outs):
        comp = out.outputs[0]
        assert comp.token_ids == ref_out.token_ids and _logprobs(comp) == _logprobs(ref_out)
        assert np.array_equal(comp.routed_experts, ref_out.routed_experts)
        assert np.array_equal(comp.routed_experts[:15], forced[:15])
