"""repetition_detection: stop a request whose output ends in a pattern repeated min_count times."""

from __future__ import annotations

import random

import pytest
from helpers.trace_replay_common import _opts

from replayllm import LLM, RepetitionDetectionParams, SamplingParams
from replayllm.repetition_detection import has_repeated_tail

PROMPT = [12522, 5193, 264, 882]  # "Once upon a time"
A = 1052
THINK, END_THINK = 151667, 151668


def _reference(output: list[int], p: RepetitionDetectionParams) -> bool:
    """Brute force: some L in min..max with the last L * min_count tokens = the last L tokens, min_count times."""
    for length in range(max(1, p.min_pattern_size), p.max_pattern_size + 1):
        if length * p.min_count <= len(output) and output[-length * p.min_count :] == output[-length:] * p.min_count:
            return True
    return False


def test_tail_check_matches_brute_force():
    rng = random.Random(0)
    for _ in range(3000):
        p = RepetitionDetectionParams(max_pattern_size=rng.randint(1, 5), min_count=rng.randint(2, 4))
        p = RepetitionDetectionParams(p.max_pattern_size, rng.randint(0, p.max_pattern_size), p.min_count)
        prompt = [rng.randint(0, 2) for _ in range(rng.randint(0, 6))]
        output = [rng.randint(0, 2) for _ in range(rng.randint(0, 16))]
        assert has_repeated_tail(prompt + output, len(output), p) == _reference(output, p), (prompt, output, p)


def test_prompt_tokens_never_count():
    p = RepetitionDetectionParams(max_pattern_size=1, min_count=3)
    assert not has_repeated_tail([5, 5, 5], 1, p)  # only one of the three 5s is output
    assert has_repeated_tail([5, 5, 5], 3, p)


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_pattern_size=-1), "max_pattern_size and min_pattern_size must be >= 0"),
    (dict(max_pattern_size=2, min_pattern_size=3, min_count=2), "min_pattern_size <= max_pattern_size"),
    (dict(max_pattern_size=2, min_count=1), "min_count must be >= 2"),
    (dict(max_pattern_size=2.0, min_count=2), "max_pattern_size must be an integer"),
    (dict(max_pattern_size=2, min_count=True), "min_count must be an integer"),
])
def test_params_are_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RepetitionDetectionParams(**kwargs)
    with pytest.raises(ValueError, match=message):
        SamplingParams(repetition_detection=kwargs)  # the HTTP body's dict form


def test_sampling_params_forms():
    p = SamplingParams(repetition_detection={"max_pattern_size": 3, "min_count": 2})
    assert p.repetition_detection == RepetitionDetectionParams(3, 0, 2)
    assert SamplingParams(repetition_detection=RepetitionDetectionParams()).repetition_detection is None  # off
    with pytest.raises(ValueError, match="unknown fields"):
        SamplingParams(repetition_detection={"window": 8})
    with pytest.raises(ValueError, match="repetition_detection must be"):
        SamplingParams(repetition_detection=[3, 0, 2])
    with pytest.raises(ValueError, match="^repetition_detection cannot be combined with trace_decode_token_ids"):
        SamplingParams(trace_decode_token_ids=[1], repetition_detection=RepetitionDetectionParams(3, 0, 2))


@pytest.fixture(scope="module")
def llm():
    return LLM(**_opts(max_model_len=128, max_num_seqs=8))


def _gen(llm, params):
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * len(params), params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def _loop(max_tokens=20, **rd):
    """Greedy with a bias that makes the model repeat one token forever."""
    return SamplingParams(temperature=0, max_tokens=max_tokens, logit_bias={A: 100.0},
                          repetition_detection=RepetitionDetectionParams(**rd) if rd else None)


def test_engine_stops_a_loop_at_the_right_token(llm):
    one, two, late, short, off = _gen(llm, [
        _loop(max_pattern_size=1, min_count=4),
        _loop(max_pattern_size=2, min_pattern_size=2, min_count=3),  # [A A] three times: 6 tokens
        SamplingParams(temperature=0, max_tokens=20, logit_bias={A: 100.0}, min_tokens=5,
                       repetition_detection=RepetitionDetectionParams(max_pattern_size=1, min_count=2)),
        _loop(max_tokens=3, max_pattern_size=1, min_count=4),  # the length limit comes first
        _loop(max_tokens=8),
    ])
    for comp, n in ((one, 4), (two, 6), (late, 5)):
        assert comp.token_ids == [A] * n
        assert (comp.finish_reason, comp.stop_reason) == ("stop", "repetition_detected")
    assert short.token_ids == [A] * 3 and (short.finish_reason, short.stop_reason) == ("length", None)
    assert off.token_ids == [A] * 8 and off.finish_reason == "length"


def test_two_token_pattern(llm):
    """A thinking budget of 0 with <think> biased loops on [<think>, </think>]: a pattern of two tokens, which
    patterns of one token never match."""
    def alternating(**rd):
        return SamplingParams(temperature=0, max_tokens=10, logit_bias={THINK: 100.0}, thinking_token_budget=0,
                              repetition_detection=RepetitionDetectionParams(**rd))
    pair, single = _gen(llm, [alternating(max_pattern_size=3, min_count=3), alternating(max_pattern_size=1,
                                                                                        min_count=2)])
    assert pair.token_ids == [THINK, END_THINK] * 3 and pair.stop_reason == "repetition_detected"
    assert single.token_ids == [THINK, END_THINK] * 5 and single.finish_reason == "length"


def test_output_that_does_not_repeat_enough_runs_to_the_end(llm):
    plain = SamplingParams(temperature=0, max_tokens=24)
    watched = SamplingParams(temperature=0, max_tokens=24,
                             repetition_detection=RepetitionDetectionParams(max_pattern_size=8, min_count=2))
    a, b = _gen(llm, [plain, watched])
    assert not _reference(a.token_ids, watched.repetition_detection)  # this greedy output has no repeated tail
    assert b.token_ids == a.token_ids and b.finish_reason == "length" and b.stop_reason is None
