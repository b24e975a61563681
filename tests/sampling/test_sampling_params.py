"""Tests for SamplingParams: vLLM defaults, validation, trace-replay rules and engine-time verification."""

import dataclasses
import math

import numpy as np
import pytest

from replayllm.outputs import CompletionOutput, Logprob, RequestOutput, TokensPrompt
from replayllm.sampling_params import RequestOutputKind, SamplingParams, SamplingType

# The engine limits used by verify_for_engine tests unless a test overrides one.
ENGINE = dict(prompt_len=4, max_model_len=32, vocab_size=100, max_logprobs=20, enable_trace_replay=True)


def test_defaults_match_vllm():
    p = SamplingParams()
    expected = dict(
        n=1, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, temperature=1.0, top_p=1.0,
        top_k=0, min_p=0.0, seed=None, stop=[], stop_token_ids=[], bad_words=[], ignore_eos=False,
        max_tokens=16, min_tokens=0, logprobs=None, prompt_logprobs=None, detokenize=True,
        skip_special_tokens=True, spaces_between_special_tokens=True, include_stop_str_in_output=False,
        logit_bias=None, allowed_token_ids=None, structured_outputs=None, repetition_detection=None,
        thinking_token_budget=None, skip_reading_prefix_cache=None, truncate_prompt_tokens=None,
        trace_decode_token_ids=None, trace_replay_chunk_size=None, trace_routed_experts=None,  # replayllm
        return_full_logprobs=False,  # extensions
        output_kind=RequestOutputKind.CUMULATIVE,
    )
    assert dataclasses.asdict(p) == expected
    assert not p.has_trace
    assert p.sampling_type is SamplingType.RANDOM and not p.is_greedy


def test_unknown_option_is_rejected():
    with pytest.raises(TypeError):
        SamplingParams(best_of=2)


def test_normalisation():
    p = SamplingParams(stop="###", top_k=-1, seed=-1, max_tokens=None)
    assert p.stop == ["###"] and p.top_k == 0 and p.seed is None and p.max_tokens is None
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]


def test_greedy():
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=5, min_p=0.1)
    assert p.is_greedy and p.sampling_type is SamplingType.GREEDY
    # Truncation cannot change an argmax; vLLM resets it so the sampler can skip those steps.
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)
    assert SamplingParams(temperature=0.7, seed=3).sampling_type is SamplingType.RANDOM_SEED


def test_tiny_temperature_is_raised_like_vllm():
    p = SamplingParams(temperature=1e-3)
    assert p.temperature == 1e-2 and not p.is_greedy  # set to the constant itself: exact


@pytest.mark.parametrize("field, value", [
    ("n", 0), ("n", 1.5), ("n", True),
    ("temperature", -1), ("temperature", math.nan), ("temperature", math.inf), ("temperature", True),
    ("temperature", "1"),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", -0.1), ("top_p", True),
    ("top_k", -2), ("top_k", 1.5), ("top_k", True),
    ("min_p", -0.1), ("min_p", 1.1), ("min_p", False),
    ("presence_penalty", 2.5), ("presence_penalty", -2.1), ("presence_penalty", True),
    ("frequency_penalty", 2.1), ("frequency_penalty", -3), ("frequency_penalty", False),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", True),
    ("max_tokens", 0), ("max_tokens", -1), ("max_tokens", 2.0), ("max_tokens", True),
    ("min_tokens", -1), ("min_tokens", 1.0), ("min_tokens", True),
    ("logprobs", -2), ("logprobs", 1.0), ("logprobs", True),
    ("prompt_logprobs", -5), ("prompt_logprobs", True),
    ("seed", 1.5), ("seed", "7"), ("seed", True), ("seed", 2**64),
    ("stop", ""), ("stop", [""]), ("stop", ["ok", 3]), ("stop", 5),
    ("stop_token_ids", [-1]), ("stop_token_ids", [1.0]), ("stop_token_ids", [True]), ("stop_token_ids", 5),
    ("bad_words", [""]), ("bad_words", [1]),
    ("ignore_eos", 1), ("detokenize", None), ("skip_special_tokens", "yes"),
    ("spaces_between_special_tokens", 0), ("include_stop_str_in_output", 1),
])
def test_invalid_values_raise_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_temperature_message():
    with pytest.raises(ValueError, match=r"temperature must be .*non-negative.*got -1"):
        SamplingParams(temperature=-1)


@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
def test_minus_one_is_the_whole_vocabulary_where_max_logprobs_allows(name):
    """vLLM's -1: every token's logprob; resolved on the engine's copy, refused past max_logprobs (naming -1)."""
    params = SamplingParams(**{name: -1})
    limits = dict(prompt_len=3, max_model_len=64, vocab_size=300, enable_trace_replay=False)
    assert getattr(params.verify_for_engine(max_logprobs=300, **limits), name) == 300
    assert getattr(params, name) == -1  # the caller's params untouched
    with pytest.raises(ValueError, match=rf"{name}=-1 \(the whole vocabulary, 300 tokens\).*max_logprobs \(20"):
        params.verify_for_engine(max_logprobs=20, **limits)
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: -2})


def test_cross_field_checks():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=10, max_tokens=5)
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)
    assert SamplingParams(min_tokens=50, max_tokens=None).min_tokens == 50


def test_logit_bias_and_allowed_token_ids_are_normalised():
    p = SamplingParams(logit_bias={1: 2, np.int64(5): -0.5, 7: 250.0, 8: -1e9}, allowed_token_ids=(4, 4, 2))
    # Ids become plain ints, biases floats as given (vLLM's constructor: a -1e9 bias bans the token for good);
    # from_optional (and the server) clamp to OpenAI's [-100, 100], as vLLM's OpenAI path does.
    assert p.logit_bias == {1: 2.0, 5: -0.5, 7: 250.0, 8: -1e9}
    q = SamplingParams.from_optional(logit_bias={1: 2, 7: 250.0, 8: -1e9})
    assert q.logit_bias == {1: 2.0, 7: 100.0, 8: -100.0}
    for bad in (float("nan"), float("inf"), 1e39):  # 1e39 is inf in the fp32 logits
        with pytest.raises(ValueError, match="finite"):
            SamplingParams.from_optional(logit_bias={1: bad}) if bad != 1e39 else SamplingParams(logit_bias={1: bad})
    assert all(type(t) is int and type(b) is float for t, b in p.logit_bias.items())
    assert p.allowed_token_ids == [4, 4, 2] and isinstance(p.allowed_token_ids, list)
    assert SamplingParams(logit_bias={}).logit_bias == {}  # biases nothing, not an error


@pytest.mark.parametrize("field, value, message", [
    ("logit_bias", [[1, 2.0]], "dict"),
    ("logit_bias", {"5": 1.0}, "integer token ids"),
    ("logit_bias", {-1: 1.0}, "non-negative"),
    ("logit_bias", {1.0: 1.0}, "integer token ids"),
    ("logit_bias", {True: 1.0}, "integer token ids"),
    ("logit_bias", {1: math.nan}, "finite"),
    ("logit_bias", {1: math.inf}, "finite"),
    ("logit_bias", {1: "2"}, "finite numbers"),
    ("logit_bias", {1: True}, "finite numbers"),
    ("logit_bias", {1: None}, "finite numbers"),
    ("allowed_token_ids", [], "non-empty"),
    ("allowed_token_ids", [1, -2], r"\[1\] = -2 is negative"),
    ("allowed_token_ids", [1.0], "integer"),
    ("allowed_token_ids", [True], "integer"),
    ("allowed_token_ids", 5, "list"),
    ("allowed_token_ids", "12", "list"),
])
def test_logit_bias_and_allowed_token_ids_validation(field, value, message):
    with pytest.raises(ValueError, match=rf"^{field}\b.*{message}"):  # the field, maybe with a position
        SamplingParams(**{field: value})


@pytest.mark.parametrize("field", ["logit_bias", "allowed_token_ids"])
def test_verify_out_of_vocab_logit_bias_and_allowed_ids(field):
    ok = {"logit_bias": {99: 1.0}, "allowed_token_ids": [0, 99]}[field]
    SamplingParams(**{field: ok}).verify_for_engine(**ENGINE)
    bad = {"logit_bias": {3: 1.0, 100: 1.0, 10**9: 2.0}, "allowed_token_ids": [3, 100, 10**9]}[field]
    with pytest.raises(ValueError, match=rf"{field} contains ids outside the vocabulary \(size 100\): "
                                         rf"\[100, {10**9}\]"):
        SamplingParams(**{field: bad}).verify_for_engine(**ENGINE)


# ---- trace replay ----------------------------------------------------------------------------------------

def test_trace_normalisation_default_max_tokens():
    p = SamplingParams(trace_decode_token_ids=[5, 6, 7])
    assert p.has_trace and p.max_tokens == 3 and p.ignore_eos is True and p.min_tokens == 0


def test_trace_overrides_explicit_options():
    trace = (5, 6, 7)
    p = SamplingParams(trace_decode_token_ids=trace, max_tokens=100, min_tokens=2, ignore_eos=False,
                       stop=["x"], stop_token_ids=[2])
    assert p.max_tokens == 3 and p.min_tokens == 0 and p.ignore_eos is True
    assert p.stop == [] and p.stop_token_ids == []
    assert p.trace_decode_token_ids == [5, 6, 7] and isinstance(p.trace_decode_token_ids, list)
    assert SamplingParams(trace_decode_token_ids=[1] * 20, max_tokens=3).max_tokens == 20


def test_trace_keeps_logprobs_and_sampling_knobs():
    p = SamplingParams(trace_decode_token_ids=[1], logprobs=5, temperature=0.7, seed=1)
    assert p.logprobs == 5 and p.temperature == 0.7


@pytest.mark.parametrize("trace", [[], [-1], [1, True], [1.0], "12", 7, [1, None]])
def test_invalid_trace_raises(trace):
    with pytest.raises(ValueError, match="trace_decode_token_ids"):
        SamplingParams(trace_decode_token_ids=trace)


@pytest.mark.parametrize("field, value", [
    ("n", 2), ("prompt_logprobs", 0), ("structured_outputs", {"json": {}}),
    ("repetition_detection", {"window": 8}), ("thinking_token_budget", 64), ("bad_words", ["bad"]),
    ("thinking_token_budget", 0), ("structured_outputs", {}),
    # The trace would silently overrule a bias or a whitelist (logprobs are raw either way): refused.
    ("logit_bias", {1: 5.0}), ("logit_bias", {2: 0.0}), ("allowed_token_ids", [1, 2]),
])
def test_trace_incompatibilities_raise_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^{field}.*trace"):
        SamplingParams(trace_decode_token_ids=[1, 2], **{field: value})


def test_trace_with_empty_bad_words_is_fine():
    assert SamplingParams(trace_decode_token_ids=[1], bad_words=[]).bad_words == []
    assert SamplingParams(trace_decode_token_ids=[1], logit_bias={}).logit_bias == {}  # biases nothing


# ---- verify_for_engine -----------------------------------------------------------------------------------

def test_verify_flag_off_names_both_spellings():
    p = SamplingParams(trace_decode_token_ids=[1, 2])
    with pytest.raises(ValueError) as info:
        p.verify_for_engine(**{**ENGINE, "enable_trace_replay": False})
    assert "enable_trace_replay" in str(info.value) and "--enable-trace-replay" in str(info.value)
    # Without a trace the flag does not matter.
    SamplingParams().verify_for_engine(**{**ENGINE, "enable_trace_replay": False})


def test_verify_out_of_vocab_trace():
    with pytest.raises(ValueError, match=r"trace_decode_token_ids.*vocabulary.*100"):
        SamplingParams(trace_decode_token_ids=[1, 100]).verify_for_engine(**ENGINE)


def test_verify_out_of_vocab_stop_token_ids():
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[150]).verify_for_engine(**ENGINE)


def test_verify_truncates_trace_to_max_model_len():
    p = SamplingParams(trace_decode_token_ids=list(range(50)))
    q = p.verify_for_engine(**{**ENGINE, "prompt_len": 30})  # room = 32 - 30 = 2
    assert q.trace_decode_token_ids == [0, 1] and q.max_tokens == 2
    assert len(p.trace_decode_token_ids) == 50 and p.max_tokens == 50


@pytest.mark.parametrize("prompt_len", [32, 40])
def test_verify_prompt_too_long(prompt_len):
    with pytest.raises(ValueError, match=rf"prompt \({prompt_len} tokens\) is longer than max_model_len"):
        SamplingParams().verify_for_engine(**{**ENGINE, "prompt_len": prompt_len})


def test_verify_empty_prompt():
    with pytest.raises(ValueError, match="prompt"):
        SamplingParams().verify_for_engine(**{**ENGINE, "prompt_len": 0})


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_verify_max_logprobs_cap(field):
    SamplingParams(**{field: 20}).verify_for_engine(**ENGINE)
    with pytest.raises(ValueError, match=rf"{field}=21.*max_logprobs \(20\)"):
        SamplingParams(**{field: 21}).verify_for_engine(**ENGINE)


def test_verify_resolves_max_tokens():
    assert SamplingParams(max_tokens=None).verify_for_engine(**ENGINE).max_tokens == 28
    assert SamplingParams(max_tokens=5).verify_for_engine(**ENGINE).max_tokens == 5
    capped = SamplingParams(max_tokens=100, min_tokens=28).verify_for_engine(**ENGINE)
    assert (capped.max_tokens, capped.min_tokens) == (28, 28)
    with pytest.raises(ValueError, match="min_tokens=29 cannot be met"):  # never quietly lowered
        SamplingParams(max_tokens=100, min_tokens=29).verify_for_engine(**ENGINE)


def test_verify_returns_copy_and_leaves_original_untouched():
    p = SamplingParams(trace_decode_token_ids=list(range(10)), logprobs=3)
    before = dataclasses.asdict(p)
    q = p.verify_for_engine(**{**ENGINE, "prompt_len": 26})
    assert q is not p and q.trace_decode_token_ids is not p.trace_decode_token_ids
    q.trace_decode_token_ids.append(99)
    assert dataclasses.asdict(p) == before
    # A shared params object gives each prompt its own resolution.
    r = p.verify_for_engine(**{**ENGINE, "prompt_len": 4})
    assert len(r.trace_decode_token_ids) == 10 and q.max_tokens == 6


def test_clone_is_deep():
    p = SamplingParams(stop=["a"], stop_token_ids=[1])
    c = p.clone()
    c.stop.append("b")
    c.stop_token_ids.append(2)
    assert p.stop == ["a"] and p.stop_token_ids == [1] and c == SamplingParams(stop=["a", "b"],
                                                                               stop_token_ids=[1, 2])


# ---- output types ----------------------------------------------------------------------------------------

def test_output_types_are_vllm_shaped():
    lp = Logprob(-0.5)
    assert (lp.rank, lp.decoded_token) == (None, None)
    c = CompletionOutput(index=0, text="hi", token_ids=[1], cumulative_logprob=-0.5, logprobs=[{1: lp}])
    assert not c.finished() and c.stop_reason is None
    c.finish_reason = "length"
    assert c.finished()
    r = RequestOutput(request_id="0", prompt=None, prompt_token_ids=[1, 2], prompt_logprobs=None, outputs=[c],
                      finished=True)
    assert r.num_cached_tokens == 0 and r.outputs[0].logprobs[0][1].logprob == -0.5
    assert TokensPrompt.__required_keys__ == frozenset({"prompt_token_ids"})
    assert TokensPrompt.__optional_keys__ == frozenset({"prompt"})


def test_clone_is_equal_and_shares_nothing_mutable():
    p = SamplingParams(logprobs=1, stop=["x", "y"], stop_token_ids=[3], logit_bias={4: 1.5},
                       allowed_token_ids=[1, 2], bad_words=["z"])
    q = p.clone()
    assert q == p and q is not p
    for name in ("stop", "stop_token_ids", "logit_bias", "allowed_token_ids", "bad_words"):
        assert getattr(q, name) == getattr(p, name) and getattr(q, name) is not getattr(p, name), name
    q.stop_token_ids.append(8)
    q.logit_bias[9] = 2.0
    assert p.stop_token_ids == [3] and p.logit_bias == {4: 1.5}
    t = SamplingParams(trace_decode_token_ids=[5, 6, 7], logprobs=1)
    u = t.clone()
    u.trace_decode_token_ids.append(8)
    assert u != t and t.trace_decode_token_ids == [5, 6, 7]


def test_list_errors_name_the_position_and_never_echo_the_input():
    # A million-id trace with one bad id, 10k stop strings with one empty: the message stays short.
    with pytest.raises(ValueError) as e:
        SamplingParams(trace_decode_token_ids=[15] * 1_000_000 + [-5])
    assert str(e.value).startswith("trace_decode_token_ids[1000000] = -5 is negative") and len(str(e.value)) < 200
    with pytest.raises(ValueError) as e:
        SamplingParams(stop=["s"] * 10_000 + [""])
    assert str(e.value).startswith("stop[10000] is an empty string") and len(str(e.value)) < 200


def test_structured_outputs_with_a_thinking_budget_is_the_engines_question():
    """Whether they combine depends on the engine's reasoning_parser (InputProcessor.prepare_request;
    tests/sampling/test_structured_after_reasoning.py): the params alone are fine."""
    SamplingParams(structured_outputs={"choice": ["a", "b"]}, thinking_token_budget=4)
    SamplingParams(structured_outputs={"choice": ["a", "b"]}, thinking_token_budget=-1)


def test_logprobs_beyond_the_vocabulary_is_a_clear_error():
    """A vocabulary smaller than max_logprobs: asking for more alternatives than tokens is a ValueError at
    admission (it was a kernel error inside the step)."""
    params = SamplingParams(logprobs=17)
    with pytest.raises(ValueError, match="vocabulary"):
        params.verify_for_engine(prompt_len=3, max_model_len=64, vocab_size=16, max_logprobs=20,
                                 enable_trace_replay=False)
    with pytest.raises(ValueError, match="vocabulary"):
        SamplingParams(prompt_logprobs=17).verify_for_engine(prompt_len=3, max_model_len=64, vocab_size=16,
                                                             max_logprobs=20, enable_trace_replay=False)


def test_params_with_routes_compare_by_value():
    """trace_routed_experts is held as a numpy array: SamplingParams still compare (by the routes' values) instead
    of raising on an array's elementwise ==."""
    a = SamplingParams(trace_routed_experts=[[[1, 2]]], max_tokens=3)
    assert a == SamplingParams(trace_routed_experts=[[[1, 2]]], max_tokens=3)
    assert a != SamplingParams(trace_routed_experts=[[[2, 1]]], max_tokens=3)
    assert a != SamplingParams(trace_routed_experts=[[[1, 2]]], max_tokens=4)
    assert a != SamplingParams(max_tokens=3) and SamplingParams(max_tokens=3) != a
    assert SamplingParams() == SamplingParams() and a != "params"


def test_trace_rules_are_one_table_for_params_and_http_echo():
    """SamplingParams and the completions endpoint's `echo` checks raise from the same rule table
    (trace_rules.py); each error names the request field at fault and survives the engine-core boundary."""
    import pickle

    from replayllm.trace_rules import TraceConflict, check_options

    with pytest.raises(TraceConflict) as e:
        SamplingParams(trace_decode_token_ids=[1], logit_bias={3: 1.0})
    assert e.value.option == "logit_bias"
    for combination, option in (("echo_logprobs", "echo"), ("echo_prompt_only", "trace_decode_token_ids")):
        with pytest.raises(TraceConflict) as e:
            check_options({combination: True})
        assert e.value.option == option and str(e.value).startswith("echo with")
        again = pickle.loads(pickle.dumps(e.value))
        assert (type(again), again.option, str(again)) == (TraceConflict, option, str(e.value))
    check_options({"echo_logprobs": False, "n": 1, "bad_words": [], "logit_bias": {}})  # nothing in conflict
