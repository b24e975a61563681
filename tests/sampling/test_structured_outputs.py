"""Structured outputs (xgrammar): params validation, the bitmask op against plain torch, and the embedded model
(random weights, real Qwen tokenizer) made to emit schema-valid JSON, regex matches and choices, offline, with
async scheduling (overlapped: the bitmask is filled after the forward is launched), mixed with plain rows, and
without leaking grammar state."""

from __future__ import annotations

import gc
import json
import re

import numpy as np
import pytest
import torch
from helpers.trace_replay_common import DEVICE, DTYPE

from replayllm import LLM, SamplingParams, StructuredOutputsParams
from replayllm.engine.grammar_workers import GrammarWorkers
from replayllm.kernels.token_bitmask import token_bitmask, token_bitmask_torch, token_bitmask_triton

pytest.importorskip("xgrammar")  # a dependency; the GPU machine has it only when its wheels travel in .whl/
jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)"
CHOICES = ["yes", "no", "maybe so"]
PROMPTS = [f"Person {i} in one line:" for i in range(20)]


@pytest.fixture(scope="module")
def sync_llm():
    # Synchronous (the async engine is compared against it below); on CUDA with CUDA graphs.
    return LLM(device=DEVICE, dtype=DTYPE, max_model_len=256, max_num_seqs=32, async_scheduling=False)


@pytest.fixture(scope="module")
def async_llm():
    # Async scheduling (the default on CUDA): structured steps overlap, the bitmask filled after the forward.
    return LLM(device=DEVICE, dtype=DTYPE, max_model_len=256, max_num_seqs=32, async_scheduling=True)


@pytest.fixture(params=["sync", "async"])
def llm(request, sync_llm, async_llm):
    """The engine-level tests run on both engines."""
    return sync_llm if request.param == "sync" else async_llm


def _so(**kw) -> SamplingParams:
    sample = kw.pop("sample", {"temperature": 0})
    return SamplingParams(max_tokens=kw.pop("max_tokens", 64), structured_outputs=StructuredOutputsParams(**kw),
                          **sample)


# -- params -------------------------------------------------------------------------------------------------
def test_params_exactly_one_kind():
    assert StructuredOutputsParams(regex="a+").kind == "regex"
    for bad in ({}, {"regex": "a", "choice": ["a"]}, {"json_object": False}):
        with pytest.raises(ValueError, match="exactly one of"):
            StructuredOutputsParams(**bad)
    with pytest.raises(ValueError, match=r"choice\[1\]"):
        StructuredOutputsParams(choice=["a", ""])
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json="{nope")
    with pytest.raises(ValueError, match="unknown fields"):
        SamplingParams(structured_outputs={"regex": "a", "whitespace_pattern": " "})
    assert SamplingParams(structured_outputs={"choice": ["a"]}).structured_outputs.choice == ["a"]


def test_trace_conflict_names_both():
    with pytest.raises(ValueError, match="structured_outputs cannot be combined with trace_decode_token_ids"):
        SamplingParams(trace_decode_token_ids=[1, 2], structured_outputs=StructuredOutputsParams(regex="a"))


def test_bad_spec_rejected_at_admission(sync_llm):
    for spec, field in (({"json": {"type": "object", "properties": 5}}, "json"), ({"regex": "a(b"}, "regex"),
                        ({"grammar": "root ::= undefined_rule"}, "grammar")):
        with pytest.raises(ValueError, match=rf"structured_outputs\.{field} is invalid: [^[]"):  # no C++ log prefix
            sync_llm.generate(["x"], SamplingParams(structured_outputs=spec))


# -- the bitmask op -----------------------------------------------------------------------------------------
def _random_bitmask(num_rows: int, width: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(-(2**31), 2**31 - 1, (num_rows, width), generator=g, dtype=torch.int64).to(torch.int32)


@pytest.mark.parametrize("impl", ["triton", "dispatch"])
def test_bitmask_op_matches_torch_reference(impl):
    g = torch.Generator().manual_seed(0)
    vocab, num_rows = 1000, 5  # vocab not a multiple of 32: the last word is partly padding
    width = (vocab + 31) // 32
    logits = torch.randn(num_rows, vocab, generator=g)
    rows = torch.tensor([1, 3, 4])
    bitmask = _random_bitmask(3, width, g)
    bitmask[2] = -1  # all allowed
    ref = logits.clone()
    token_bitmask_torch(ref, rows, bitmask)
    # Independent check of the reference: bit j of word i of row g allows token 32*i + j.
    for gi, r in enumerate(rows.tolist()):
        for t in (0, 31, 32, 517, vocab - 1):
            allowed = (int(bitmask[gi, t // 32]) >> (t % 32)) & 1
            assert (ref[r, t] == float("-inf")) == (not allowed)
    assert torch.equal(ref[[0, 2]], logits[[0, 2]]) and torch.equal(ref[4], logits[4])
    # The compiled kernel needs CUDA tensors (the GPU run sets no REPLAYLLM_TEST_DEVICE); on CPU the interpreter.
    dev = "cuda" if torch.cuda.is_available() else DEVICE
    out = logits.clone().to(dev)
    (token_bitmask_triton if impl == "triton" else token_bitmask)(out, rows.to(dev), bitmask.to(dev))
    assert torch.equal(out.cpu(), ref)


@pytest.mark.gpu
def test_bitmask_kernel_full_vocab_on_cuda():
    g = torch.Generator().manual_seed(1)
    vocab, num_rows = 151_936, 96
    logits = torch.randn(num_rows, vocab, generator=g)
    rows = torch.arange(0, num_rows, 2)
    bitmask = _random_bitmask(rows.numel(), (vocab + 31) // 32, g)
    ref = logits.clone()
    token_bitmask_torch(ref, rows, bitmask)
    out = logits.cuda()
    token_bitmask_triton(out, rows.cuda(), bitmask.cuda())
    assert torch.equal(out.cpu(), ref)


# -- the engine ---------------------------------------------------------------------------------------------
def test_json_schema_outputs_validate(llm):
    outs = llm.generate(PROMPTS, _so(json=SCHEMA, disable_any_whitespace=True))
    assert len(outs) == 20
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SCHEMA)


def test_json_object_and_any_whitespace(llm):
    # json_object: any JSON object. With JSON's whitespace allowed (the default) a random model may spend its
    # tokens on whitespace: whatever is emitted is a prefix of valid JSON, so a finished output parses.
    params = [_so(json_object=True, disable_any_whitespace=True, max_tokens=48), _so(json=SCHEMA, max_tokens=48)]
    outs = llm.generate(PROMPTS[:4], params * 2)
    for o, p in zip(outs, params * 2):
        c = o.outputs[0]
        assert c.text.lstrip().startswith("{")
        if c.finish_reason == "stop":
            value = json.loads(c.text)
            assert isinstance(value, dict)
            if p.structured_outputs.json is not None:
                jsonschema.validate(value, SCHEMA)


def test_regex_and_choice(llm):
    outs = llm.generate(PROMPTS, _so(regex=REGEX, sample={"temperature": 1.0, "seed": 7}))
    for o in outs:
        assert o.outputs[0].finish_reason == "stop"
        assert re.fullmatch(REGEX, o.outputs[0].text), o.outputs[0].text
    choices = [*CHOICES, 'say "hi"', "back\\slash", "naïve ☃", "two\nlines"]  # escaped into the EBNF literal
    outs = llm.generate(PROMPTS, _so(choice=choices, sample={"temperature": 1.0, "seed": 1}))
    assert all(o.outputs[0].text in choices and o.outputs[0].finish_reason == "stop" for o in outs)
    assert len({o.outputs[0].text for o in outs}) > 1  # sampling really chose among them


def test_grammar_that_ends_finishes_with_stop(llm):
    grammar = 'root ::= "ab" [0-9] [0-9]'
    out = llm.generate(["Hello"], _so(grammar=grammar, max_tokens=50))[0].outputs[0]
    assert out.finish_reason == "stop" and re.fullmatch(r"ab[0-9]{2}", out.text)
    assert len(out.token_ids) < 50


def test_mixed_batch_plain_rows_unchanged(llm):
    plain = SamplingParams(temperature=0, max_tokens=12, logprobs=2)
    alone = llm.generate(PROMPTS[:4], plain)
    mixed = llm.generate(PROMPTS[:8], [plain] * 4 + [_so(json=SCHEMA, disable_any_whitespace=True)] * 4)
    for a, m in zip(alone, mixed[:4]):
        assert m.outputs[0].token_ids == a.outputs[0].token_ids
        assert m.outputs[0].text == a.outputs[0].text
    for m in mixed[4:]:
        jsonschema.validate(json.loads(m.outputs[0].text), SCHEMA)


def test_raw_logprobs_come_from_unmasked_logits(llm):
    # A choice forces tokens the random model would rarely pick: their raw logprob is far below the max.
    out = llm.generate(["Hi"], _so(choice=["zebra"], max_tokens=8, sample={"temperature": 0, "logprobs": 1}))[0]
    c = out.outputs[0]
    first = c.logprobs[0][c.token_ids[0]]
    assert first.rank > 1 and first.logprob < -1.0


def _results(outs):
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


def test_async_scheduling_same_outputs(sync_llm, async_llm, caplog):
    """Async scheduling keeps structured steps overlapped (the bitmask of step N+1 is filled after N+1's forward
    is launched, once N's tokens reached the matchers): every output equals the synchronous engine's, greedy and
    seeded random, in a batch mixing grammars with plain rows and a penalties row (which turns the overlap off
    while it runs), and no token is ever rejected by its matcher (the matchers were current at every fill)."""
    params = [_so(json=SCHEMA, disable_any_whitespace=True), _so(regex=REGEX),
              _so(json=SCHEMA, disable_any_whitespace=True, sample={"temperature": 1.0, "seed": 3}),
              _so(choice=CHOICES, sample={"temperature": 1.0, "seed": 5}),
              _so(grammar='root ::= "ab" [0-9] [0-9]', sample={"temperature": 0.8, "seed": 9}),
              SamplingParams(temperature=0, max_tokens=10),
              SamplingParams(temperature=1.0, seed=4, max_tokens=12),
              SamplingParams(temperature=0, max_tokens=4, repetition_penalty=1.5, presence_penalty=0.5)]
    with caplog.at_level("WARNING", logger="replayllm.engine.scheduler"):
        results = [_results(engine.generate(PROMPTS[:8], params)) for engine in (sync_llm, async_llm)]
    assert results[0] == results[1]
    assert async_llm.llm_engine.config.async_scheduling and async_llm.llm_engine.num_overlapped_steps > 0
    assert "rejected by its grammar" not in caplog.text
    (_, js, js_reason), (_, rx, rx_reason), (_, js_random, _), (_, choice, _), (_, ab, _) = results[1][:5]
    assert js_reason == rx_reason == "stop" and re.fullmatch(REGEX, rx)
    jsonschema.validate(json.loads(js), SCHEMA)
    if results[1][2][2] == "stop":  # sampled JSON may run out of tokens inside a string ("length")
        jsonschema.validate(json.loads(js_random), SCHEMA)
    assert choice in CHOICES and re.fullmatch(r"ab[0-9]{2}", ab)


def test_async_structured_steps_overlap(sync_llm, async_llm):
    """A structured-only run on the async engine overlaps its steps (before issue 17's deferred bitmask a
    grammar turned the overlap off: num_overlapped_steps stayed 0), with the sync engine's outputs."""
    engine = async_llm.llm_engine
    params = [_so(json=SCHEMA, disable_any_whitespace=True, max_tokens=40), _so(regex=REGEX)]
    steps_before, overlapped_before = engine.num_steps, engine.num_overlapped_steps
    outs = async_llm.generate(PROMPTS[:4], params * 2)
    steps, overlapped = engine.num_steps - steps_before, engine.num_overlapped_steps - overlapped_before
    assert steps > 5
    assert overlapped >= steps - 2  # all but the first launch (and the last, with nothing behind it)
    assert _results(outs) == _results(sync_llm.generate(PROMPTS[:4], params * 2))


def test_threaded_grammar_work_same_outputs(sync_llm, async_llm, monkeypatch):
    """The fill split over 3 threads (the 2-core CI machines default to 1: everything inline) gives the outputs
    of the other engine, greedy and seeded random; 16 rows a step: chunks of 8 rows really run on the pool."""
    params = [_so(json=SCHEMA, disable_any_whitespace=True, max_tokens=24), _so(json=SCHEMA, max_tokens=16),
              _so(regex=REGEX, sample={"temperature": 1.0, "seed": 2}), _so(json_object=True, max_tokens=16)] * 4
    reference = _results(sync_llm.generate(PROMPTS[:16], params))
    workers = GrammarWorkers(3)  # the sync engine fills on the caller + a pool, in chunks
    monkeypatch.setattr(sync_llm.llm_engine.structured, "workers", workers)
    assert _results(sync_llm.generate(PROMPTS[:16], params)) == reference
    assert workers._pool is not None and workers.stats.fill_rows > 16 and workers.stats.accept_rows > 16
    workers = GrammarWorkers(3)  # the async engine fills on the fill thread (xgrammar's pool of 3)
    monkeypatch.setattr(async_llm.llm_engine.structured, "workers", workers)
    assert _results(async_llm.generate(PROMPTS[:16], params)) == reference
    assert workers._jobs is not None and workers.stats.fill_rows > 16 and workers.stats.accept_rows > 16


def test_async_fill_overlaps_previous_outputs(async_llm, monkeypatch):
    """Async scheduling: step N+1's bits are filled on the fill thread while, on the engine thread, step N's
    outputs are processed and step N+2 is scheduled (fill started, outputs, schedule, fill waited for); each
    step's outputs are returned once."""
    engine = async_llm.llm_engine
    events = []
    workers = engine.structured.workers
    start_fill, process, schedule = workers.start_fill, engine.output_processor.process, engine.scheduler.schedule

    def traced_start(handles, bitmask):
        pending = start_fill(handles, bitmask)
        wait = pending.wait
        events.append("start")
        pending.wait = lambda: (events.append("wait"), wait())[1]
        return pending

    monkeypatch.setattr(workers, "start_fill", traced_start)
    monkeypatch.setattr(engine.output_processor, "process",
                        lambda *a: (events.append("outputs"), process(*a))[1])
    monkeypatch.setattr(engine.scheduler, "schedule", lambda: (events.append("schedule"), schedule())[1])
    params = [_so(json=SCHEMA, max_tokens=12)] * 4
    reference = _results(async_llm.generate(PROMPTS[:4], params))
    events.clear()
    outs = async_llm.generate(PROMPTS[:4], params)
    assert _results(outs) == reference and all(len(o.outputs[0].token_ids) > 0 for o in outs)
    runs = [events[i:i + 4] for i in range(len(events) - 3)]
    assert runs.count(["start", "outputs", "schedule", "wait"]) >= 5, events
    assert engine._ahead is None and engine._inflight is None and not engine.has_unfinished_requests()


def test_abort_while_a_step_is_scheduled_ahead(async_llm):
    """A request aborted while it sits in the step scheduled ahead: that step still runs (its token is dropped),
    the others finish as alone, and every KV block comes back."""
    engine = async_llm.llm_engine
    bm = engine.block_manager
    free_before = bm.num_free_blocks
    params = _so(json=SCHEMA, max_tokens=16)
    for i in range(3):
        engine.add_request(f"ab{i}", PROMPTS[i], params)
    for _ in range(6):
        engine.step()
    assert engine._ahead is not None and any(r.request_id == "ab1" for r in engine._ahead.sched.rows)
    assert engine.abort_request("ab1")
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            finals[out.request_id] = out
    assert "ab1" not in finals and sorted(finals) == ["ab0", "ab2"]
    alone = _results(async_llm.generate([PROMPTS[0], PROMPTS[2]], params))
    assert _results([finals["ab0"], finals["ab2"]]) == alone
    assert engine._ahead is None and bm.num_free_blocks == free_before
    assert len(engine.runner.req_states.req_id_to_slot) == 0 or engine.step() == []


def test_a_failed_fill_leaves_the_engine_serving(async_llm, monkeypatch):
    """A fill that fails after the next step was scheduled ahead: generate raises it, that early step is dropped
    with its requests (aborted), and the next generate gives the outputs an untroubled engine gives."""
    engine = async_llm.llm_engine
    params = [_so(json=SCHEMA, max_tokens=10)] * 3
    reference = _results(async_llm.generate(PROMPTS[5:8], params))
    free_before = engine.block_manager.num_free_blocks
    workers = engine.structured.workers
    start_fill, calls = workers.start_fill, []

    def failing_start(handles, bitmask):
        pending = start_fill(handles, bitmask)
        calls.append(1)
        if len(calls) == 4:
            wait = pending.wait
            pending.wait = lambda: (wait(), (_ for _ in ()).throw(RuntimeError("fill failed")))
        return pending

    monkeypatch.setattr(workers, "start_fill", failing_start)
    with pytest.raises(RuntimeError, match="fill failed"):
        async_llm.generate(PROMPTS[5:8], params)
    assert engine._ahead is None and not engine.has_unfinished_requests()
    assert _results(async_llm.generate(PROMPTS[5:8], params)) == reference
    assert engine.block_manager.num_free_blocks == free_before


def test_fill_thread_error_reaches_the_engine_thread(async_llm):
    """A fill that fails on the fill thread raises from PendingFill.wait, and the thread keeps serving."""
    import xgrammar as xgr

    manager = async_llm.llm_engine.structured
    matcher = xgr.GrammarMatcher(manager.compile(StructuredOutputsParams(json_object=True)))
    workers = GrammarWorkers(1)
    with pytest.raises(RuntimeError, match="int32"):  # xgrammar wants int32 bits
        workers.start_fill([matcher._handle], np.zeros((1, manager.bitmask_width), dtype=np.int64)).wait()
    good = np.zeros((1, manager.bitmask_width), dtype=np.int32)
    workers.start_fill([matcher._handle], good).wait()
    assert good.any() and not good.all() and workers.stats.fill_calls == 2
    workers.shutdown()


def test_structured_request_keeps_overlap_but_never_speculates():
    from replayllm.engine.request import Request

    req = Request("r", [1, 2], _so(regex=REGEX), 0, (0,), 0)
    assert not req.needs_host_tokens and not req.can_speculate
    assert Request("p", [1, 2], SamplingParams(), 0, (0,), 0).can_speculate


def test_grammar_is_filled_between_the_two_runner_calls(async_llm, monkeypatch):
    """Each step is execute_model (the forward launched), then the bits filled on the host, then sample_tokens
    with them: the runner's two calls alternate, every fill falls between them, and structured steps sample
    with bits."""
    engine = async_llm.llm_engine
    runner, workers, events = engine.runner, engine.structured.workers, []

    def traced(obj, name, event):
        real = getattr(obj, name)
        monkeypatch.setattr(obj, name, lambda *a: (events.append(event(*a)), real(*a))[1])

    traced(runner, "execute_model", lambda sched: "execute_model")
    traced(runner, "sample_tokens", lambda grammar: "sample" if grammar is None else "sample with bits")
    traced(workers, "fill", lambda handles, bitmask: "fill")
    traced(workers, "start_fill", lambda handles, bitmask: "fill")
    async_llm.generate(PROMPTS[:2], [_so(regex=REGEX)] * 2)
    calls = [e for e in events if e != "fill"]
    assert calls[0::2] == ["execute_model"] * (len(calls) // 2) and calls[-1].startswith("sample")
    assert all(e.startswith("sample") for e in calls[1::2]) and calls.count("sample with bits") >= 3
    assert all(events[i - 1] in ("execute_model", "fill") for i, e in enumerate(events) if e == "fill")


def test_no_grammar_state_left_after_many_requests(llm):
    engine = llm.llm_engine
    llm.generate([f"p{i}" for i in range(40)], [_so(choice=CHOICES, max_tokens=8), _so(regex=REGEX)] * 20)
    gc.collect()
    assert len(engine.structured.live) == 0


def test_speculative_engine_same_outputs(sync_llm):
    """On an n-gram speculative engine a structured request decodes without drafts (its matcher must see each
    token), next to plain rows that carry drafts in the same steps: every output equals the plain engine's."""
    # 2,048 tokens: its fp32 logits reserve for the default budget starved the GPU suite's KV share (session 33)
    spec = LLM(device=DEVICE, dtype=DTYPE, max_model_len=256, max_num_seqs=32, max_num_batched_tokens=2048,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                   "prompt_lookup_max": 3})
    prompts = PROMPTS[:4]
    # A bias makes the plain rows repeat one token: their n-gram drafts are proposed (and accepted) every step.
    repeat = SamplingParams(temperature=0, max_tokens=16, logit_bias={1378: 100.0})
    params = [repeat, SamplingParams(temperature=0, max_tokens=16), _so(json=SCHEMA, disable_any_whitespace=True),
              _so(regex=REGEX)]
    results = [[(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in engine.generate(prompts, params)]
               for engine in (sync_llm, spec)]
    assert results[0] == results[1]
    assert spec.llm_engine.scheduler.spec_stats.num_draft_tokens > 0  # the plain rows did carry drafts
