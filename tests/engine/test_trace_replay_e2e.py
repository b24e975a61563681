"""Trace replay end to end (issue acceptance 2-6): the seed example, parity with transformers, bit-exact
self-replay, mixed batches, the trace rules and rejections, and which kernel implementation runs.
Runtime corners (chunked prefill, preemption, prefix hits, slot reuse, abort) are in
test_trace_replay_runtime.py. Shared settings, helpers and engines: trace_replay_common.py.

Every comparison that needs bit-exact numbers runs the same batch composition twice: logprobs on CPU are exact
for a given batch, but a request run alone and the same request inside a batch can differ in the last bits
(padded attention, GEMM blocking).
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from helpers.hf_reference import VOCAB, hf_rank, teacher_forced
from helpers.trace_replay_common import (
    BATCH_NOISE,
    EMBEDDED_VOCAB,
    HF_TOL,
    TIE,
    TINY_EOS,
    _chosen,
    _full,
    _ids,
    _max_delta,
    _opts,
    _rand_ids,
    _tiny,
)

from replayllm import LLM, SamplingParams
from replayllm.kernels import trace_replay as trace_kernels


# -- acceptance 2: the seed example ------------------------------------------------------------------------
def test_seed_example_on_embedded_model(embedded):
    llm = embedded  # LLM(enable_trace_replay=True, device="cpu", dtype="float32", max_model_len=512)
    outs = llm.generate(["Once upon a time"], SamplingParams(trace_decode_token_ids=[15, 284], logprobs=5))
    comp = outs[0].outputs[0]
    rows = [(tok, lp[tok].logprob, lp[tok].rank) for tok, lp in zip(comp.token_ids, comp.logprobs)]
    assert comp.token_ids == [15, 284]
    assert comp.finish_reason == "length" and outs[0].finished
    assert comp.text == llm.get_tokenizer().decode([15, 284])
    for (tok, logprob, rank), lp in zip(rows, comp.logprobs):
        assert isinstance(logprob, float) and logprob < 0.0
        assert isinstance(rank, int) and 1 <= rank <= EMBEDDED_VOCAB
        assert len(lp) in (5, 6)  # top-5 plus the forced token unless it is among them
        top = sorted((v.rank, t) for t, v in lp.items() if t != tok)
        assert [r for r, _ in top] == list(range(1, len(top) + 1))
        assert all(lp[t].logprob >= logprob for _, t in top if lp[t].rank < rank)
        assert lp[tok].decoded_token == llm.get_tokenizer().decode([tok])
    assert comp.cumulative_logprob == sum(r[1] for r in rows)  # the reported logprobs added in order: exact


# -- acceptance 3: forced logprobs equal transformers' teacher-forced log_softmax ----------------------------
@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
def test_random_traces_match_hf_teacher_forcing(tiny_llms, hf_models, arch):
    rng = random.Random(f"traces-{arch}")  # str seeds are hashed with sha512: stable across runs
    prompts = [_rand_ids(rng, n, lo=3) for n in (1, 6, 17, 40)]
    traces = [_rand_ids(rng, n) for n in (12, 20, 9, 25)]
    outs = tiny_llms[arch].generate([_ids(p) for p in prompts],
                                    [SamplingParams(trace_decode_token_ids=t, logprobs=5) for t in traces],
                                    use_tqdm=False)
    hf = hf_models[arch]
    num_forced = num_unlikely = 0
    for prompt, trace, out in zip(prompts, traces, outs):
        comp = out.outputs[0]
        assert comp.token_ids == trace and comp.finish_reason == "length"
        ref, _ = teacher_forced(hf, prompt, trace)  # [n, V]
        for i, (tok, logprob, rank) in enumerate(_chosen(comp)):
            assert abs(logprob - float(ref[i, tok])) <= HF_TOL, (arch, i)
            want = hf_rank(ref[i], tok)
            if rank != want:  # only a near-tie with the forced token may move the rank, and only by one
                assert abs(rank - want) == 1
                assert int(((ref[i] - ref[i, tok]).abs() < TIE).sum()) >= 2
            # The reported top-5 (forced token included when it is among them) are HF's top-5 logprobs.
            top = sorted((v.logprob for v in comp.logprobs[i].values() if v.rank <= 5), reverse=True)
            assert torch.allclose(torch.tensor(top), ref[i].topk(5).values, atol=HF_TOL, rtol=0)
            num_forced += 1
            num_unlikely += rank > 1
    # The traces are not what the model would pick: nearly every forced token is off the argmax.
    assert num_unlikely >= 0.9 * num_forced


# -- acceptance 4: replaying the engine's own greedy output is bit-exact -------------------------------------
@pytest.mark.parametrize("which", ["embedded", "llama"])
def test_greedy_then_replay_is_bit_exact(request, tiny_models, which):
    # Bit-exact needs the same computation twice: the same batches and the same prompt chunks. A prefix-cache
    # hit changes the chunks (only the uncached tail runs), so it may move the last bits (see
    # test_prefix_cache_hits_keep_replay_close): the embedded run uses prompts shorter than one block, the
    # tiny one turns prefix caching off and uses prompts of several blocks.
    if which == "embedded":
        llm = request.getfixturevalue("embedded")
        prompts = ["Once upon a time", "The capital of France is", "1 2 3"]
    else:
        llm = _tiny(tiny_models[which], enable_prefix_caching=False)
        rng = random.Random(1)
        prompts = [_ids(_rand_ids(rng, n, lo=3)) for n in (3, 20, 33, 70)]
    greedy = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, logprobs=5), use_tqdm=False)
    # One token per step, as the greedy run computed them (fast replay's chunks are other matmul shapes: equal
    # within rounding only, bit for bit in batch-invariant mode; tests/engine/test_fast_replay.py).
    replay = llm.generate(
        prompts, [SamplingParams(trace_decode_token_ids=o.outputs[0].token_ids, logprobs=5,
                                 trace_replay_chunk_size=1) for o in greedy],
        use_tqdm=False)
    for g, r in zip(greedy, replay):
        assert r.num_cached_tokens == 0
        assert r.outputs[0].token_ids == g.outputs[0].token_ids
        assert _full(r.outputs[0]) == _full(g.outputs[0])  # == on floats: bit for bit
        assert all(rank == 1 for _, _, rank in _chosen(g.outputs[0]))


# -- acceptance 5: a mixed batch ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_text(tiny_models, embedded) -> LLM:
    """Tiny Qwen3 (vocab 512, EOS 2) detokenized with the embedded Qwen tokenizer, only so that stop strings
    have text to match; ids below 512 decode to short ASCII pieces. Prompts must be token ids."""
    return _tiny(tiny_models["qwen3"], skip_tokenizer_init=False,
                 tokenizer=embedded.llm_engine.model_config.path)


def test_mixed_batch_honours_every_trace_and_leaves_others_alone(tiny_text):
    llm = tiny_text
    tok = llm.get_tokenizer()
    rng = random.Random(5)
    prompts = [_ids(_rand_ids(rng, n, lo=3)) for n in (2, 5, 9, 14, 20, 27, 33, 41, 50, 8)]
    # A control request with a stop string that fires, picked from its own greedy output.
    stop_control = SamplingParams(temperature=0.0, max_tokens=30)
    control_text = llm.generate(prompts[9], stop_control, use_tqdm=False)[0].outputs[0].text
    control_stop = control_text[6:8]
    worded = _rand_ids(rng, 12, lo=256, hi=VOCAB)
    worded_text = tok.decode(worded)
    worded_stops = [worded_text[len(worded_text) // 2:][:3], control_stop]
    params = [
        SamplingParams(trace_decode_token_ids=[7], logprobs=2),
        SamplingParams(trace_decode_token_ids=[15, TINY_EOS, 284, TINY_EOS, 16], logprobs=2),
        SamplingParams(trace_decode_token_ids=[TINY_EOS] + _rand_ids(rng, 11)),
        # Stop strings, stop ids and min_tokens would each end this one early; with a trace they are off.
        SamplingParams(trace_decode_token_ids=worded, stop=worded_stops,
                       stop_token_ids=[worded[3]], min_tokens=2, logprobs=1),
        SamplingParams(trace_decode_token_ids=_rand_ids(rng, 40), logprobs=5),
        SamplingParams(trace_decode_token_ids=_rand_ids(rng, 20), temperature=0.8, top_p=0.9, seed=3),
        SamplingParams(temperature=0.0, max_tokens=10, logprobs=3),
        SamplingParams(temperature=0.9, top_p=0.9, seed=1234, max_tokens=12, logprobs=3),
        SamplingParams(temperature=1.0, top_k=20, seed=7, max_tokens=15, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30, stop=[control_stop]),
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert len(outs) >= 8 and llm.llm_engine.max_running_in_step == len(prompts)
    for p, out in zip(params, outs):
        comp = out.outputs[0]
        if p.trace_decode_token_ids is None:
            continue
        assert comp.token_ids == p.trace_decode_token_ids
        assert comp.finish_reason == "length" and comp.stop_reason is None
        if p.logprobs is not None:
            assert len(comp.logprobs) == len(p.trace_decode_token_ids)
    assert outs[1].outputs[0].token_ids.count(TINY_EOS) == 2  # emitted, and replay went on
    assert outs[3].outputs[0].text == worded_text and worded_stops[0] in worded_text
    # Untraced requests: the same tokens (and, within float noise of another batch, logprobs) as alone.
    for p, prompt, out in zip(params, prompts, outs):
        if p.trace_decode_token_ids is not None:
            continue
        solo = llm.generate(prompt, p, use_tqdm=False)[0].outputs[0]
        comp = out.outputs[0]
        assert comp.token_ids == solo.token_ids and comp.text == solo.text
        assert (comp.finish_reason, comp.stop_reason) == (solo.finish_reason, solo.stop_reason)
        if p.logprobs is not None:
            assert _max_delta(comp, solo) < BATCH_NOISE
    assert outs[9].outputs[0].finish_reason == "stop"  # the same stop string does end an untraced request


def test_batch_shrinks_as_traces_end(tiny_models):
    # Counts per step() call: the synchronous loop's contract (async scheduling, the default on CUDA, reports a
    # step one call later; tests/engine/test_async_scheduling.py covers it).
    llm = _tiny(tiny_models["qwen3"], async_scheduling=False, trace_replay_chunk_size=1)  # owns the engine
    engine = llm.llm_engine
    lengths = [1, 3, 6, 10]
    for i, n in enumerate(lengths):
        trace = [TINY_EOS] * n  # EOS everywhere: a trace never stops on it
        engine.add_request(f"shrink-{i}", _ids([10 + i] * (3 + i)),
                           SamplingParams(trace_decode_token_ids=trace))
    engine.add_request("untraced", _ids([40, 41, 42]), SamplingParams(temperature=0.0, max_tokens=8,
                                                                     ignore_eos=True))
    running, finished_at = [], {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished_at[out.request_id] = len(running) + 1
                if out.request_id != "untraced":
                    assert out.outputs[0].token_ids == [TINY_EOS] * lengths[int(out.request_id[-1])]
        running.append(len(engine.scheduler.running))
    assert finished_at == {"shrink-0": 1, "shrink-1": 3, "shrink-2": 6, "untraced": 8, "shrink-3": 10}
    assert running == [4, 4, 3, 3, 3, 2, 2, 1, 1, 0]


# -- acceptance 6: rules and rejections --------------------------------------------------------------------
def test_max_tokens_becomes_trace_length(embedded):
    trace = [15, 284, 16, 17, 18]
    params = [SamplingParams(trace_decode_token_ids=trace),  # default max_tokens=16
              SamplingParams(trace_decode_token_ids=trace, max_tokens=3),
              SamplingParams(trace_decode_token_ids=trace, max_tokens=100),
              SamplingParams(trace_decode_token_ids=trace, max_tokens=None)]
    outs = embedded.generate(["Count: 1 2 3"] * len(params), params, use_tqdm=False)
    for p, out in zip(params, outs):
        assert p.max_tokens == len(trace)
        assert out.outputs[0].token_ids == trace and out.outputs[0].finish_reason == "length"


def test_trace_truncated_at_max_model_len(tiny_models):
    llm = _tiny(tiny_models["qwen3"], max_model_len=32)
    rng = random.Random(3)
    prompt, trace = _rand_ids(rng, 10, lo=3), _rand_ids(rng, 40)
    out = llm.generate(_ids(prompt), SamplingParams(trace_decode_token_ids=trace, logprobs=0), use_tqdm=False)
    comp = out[0].outputs[0]
    assert comp.token_ids == trace[:22] and len(comp.logprobs) == 22
    assert comp.finish_reason == "length"


@pytest.mark.parametrize("kwargs, field", [
    (dict(n=2), "n"),
    (dict(prompt_logprobs=1), "prompt_logprobs"),
    (dict(bad_words=["cat"]), "bad_words"),
    (dict(structured_outputs={"json": {"type": "object"}}), "structured_outputs"),
    (dict(repetition_detection={"max_pattern_size": 4}), "repetition_detection"),
    (dict(thinking_token_budget=16), "thinking_token_budget"),
    (dict(trace_decode_token_ids=[]), "trace_decode_token_ids"),
    (dict(trace_decode_token_ids=[15, -1]), "trace_decode_token_ids"),
    (dict(trace_decode_token_ids=[15, 2.0]), "trace_decode_token_ids"),
    (dict(trace_decode_token_ids=[15, EMBEDDED_VOCAB]), "trace_decode_token_ids"),
])
def test_conflicts_raise_value_error_at_generate(embedded, kwargs, field):
    kwargs = {"trace_decode_token_ids": [15, 284], **kwargs}
    with pytest.raises(ValueError, match=field):
        embedded.generate(["Hello", "world"], SamplingParams(**kwargs), use_tqdm=False)
    assert not embedded.llm_engine.has_unfinished_requests()


def test_one_bad_request_rejects_the_whole_call(embedded):
    good = SamplingParams(trace_decode_token_ids=[15, 284])
    bad = SamplingParams(trace_decode_token_ids=[15, EMBEDDED_VOCAB + 7])  # only an engine knows the vocab
    with pytest.raises(ValueError, match="outside the vocabulary"):
        embedded.generate(["fine", "not fine"], [good, bad], use_tqdm=False)
    assert not embedded.llm_engine.has_unfinished_requests()  # the good one was never queued
    assert embedded.generate("fine", good, use_tqdm=False)[0].outputs[0].token_ids == [15, 284]


def test_trace_rejected_when_flag_off(tiny_models):
    llm = LLM(tiny_models["qwen3"], **_opts(max_model_len=64, skip_tokenizer_init=True))
    assert llm.llm_engine.runner.sampler.trace is None  # no buffer, no kernel
    with pytest.raises(ValueError, match="enable_trace_replay") as err:
        llm.generate(_ids([5, 6, 7]), SamplingParams(trace_decode_token_ids=[1, 2]), use_tqdm=False)
    assert "--enable-trace-replay" in str(err.value)
    out = llm.generate(_ids([5, 6, 7]), SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_speculative_decoding_rejected_at_construction(tiny_models):
    with pytest.raises(ValueError, match="speculative"):
        LLM(tiny_models["qwen3"], enable_trace_replay=True, speculative_config={"method": "ngram"},
            **_opts(skip_tokenizer_init=True))


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_sampling_knobs_leave_tokens_and_logprobs_raw(tiny_llms, arch):
    llm = tiny_llms[arch]
    rng = random.Random(11)
    trace, prompt = _rand_ids(rng, 12), _ids(_rand_ids(rng, 6, lo=3))
    base = llm.generate(prompt, SamplingParams(trace_decode_token_ids=trace, temperature=0.0, logprobs=5),
                        use_tqdm=False)[0].outputs[0]
    assert base.token_ids == trace
    for knobs in (dict(temperature=0.7), dict(top_p=0.5), dict(top_k=3), dict(presence_penalty=0.5),
                  dict(temperature=0.7, top_p=0.5, top_k=3, min_p=0.1, presence_penalty=0.5,
                       frequency_penalty=1.0, repetition_penalty=1.3, seed=9)):
        comp = llm.generate(prompt, SamplingParams(trace_decode_token_ids=trace, logprobs=5, **knobs),
                            use_tqdm=False)[0].outputs[0]
        assert comp.token_ids == trace, knobs
        assert _full(comp) == _full(base), knobs


# -- which implementation runs ---------------------------------------------------------------------------
def _spy(monkeypatch, name: str) -> list[int]:
    calls: list[int] = []
    real = getattr(trace_kernels, name)

    def wrapper(sampled, *args):
        calls.append(sampled.shape[0])
        return real(sampled, *args)

    monkeypatch.setattr(trace_kernels, name, wrapper)
    return calls


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter on CPU")
def test_triton_interpreter_and_torch_reference_give_identical_engine_outputs(tiny_llms, monkeypatch):
    llm = tiny_llms["llama"]
    rng = random.Random(2)
    prompts = [_ids(_rand_ids(rng, n, lo=3)) for n in (4, 9, 21)]
    # One-token replay: one kernel launch per step (fast replay's offsets: tests/engine/test_fast_replay.py).
    params = [SamplingParams(trace_decode_token_ids=_rand_ids(rng, 7), logprobs=3, trace_replay_chunk_size=1),
              SamplingParams(temperature=0.0, max_tokens=9, logprobs=3),
              SamplingParams(trace_decode_token_ids=_rand_ids(rng, 12), logprobs=3, temperature=0.5, seed=1,
                             trace_replay_chunk_size=1)]
    assert trace_kernels.use_triton_trace_kernel(torch.device("cpu")) is True
    triton_calls = _spy(monkeypatch, "trace_replay_triton")
    torch_calls = _spy(monkeypatch, "trace_replay_torch")

    def run():
        llm.llm_engine.block_manager.reset_prefix_cache()  # the same computation both times
        return [_full(o.outputs[0]) for o in llm.generate(prompts, params, use_tqdm=False)]

    with_triton = run()
    assert len(triton_calls) == 12 and not torch_calls  # one launch per step while a trace replays
    # No row replays: the launch is skipped entirely.
    llm.generate(prompts[1], params[1], use_tqdm=False)
    assert len(triton_calls) == 12

    with monkeypatch.context() as m:
        m.setenv("TRITON_INTERPRET", "0")
        assert trace_kernels.use_triton_trace_kernel(torch.device("cpu")) is False
    monkeypatch.setattr(trace_kernels, "use_triton_trace_kernel", lambda device: False)
    with_torch = run()
    assert len(torch_calls) == 12 and len(triton_calls) == 12
    assert with_torch == with_triton


