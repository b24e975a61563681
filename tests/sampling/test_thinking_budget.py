"""thinking_token_budget: at most N tokens inside <think> .. </think>, then </think> is forced (offline engine)."""

from __future__ import annotations

import pytest
from helpers.trace_replay_common import _opts

from replayllm import LLM, SamplingParams
from replayllm.config import EngineConfig
from replayllm.reasoning import ReasoningTokens

THINK, END_THINK = 151667, 151668  # the embedded model's (Qwen's) <think> / </think>
PROMPT = [12522, 5193, 264, 882]  # "Once upon a time"
OPEN_THINK = {THINK: 100.0}  # logit_bias that makes the model open <think> at once (and again inside it)


@pytest.fixture(scope="module")
def llm():
    return LLM(enable_trace_replay=True, **_opts(max_model_len=128, max_num_seqs=8))


def _gen(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def test_tokens_come_from_the_tokenizer(llm):
    assert llm.llm_engine.reasoning_tokens == ReasoningTokens(THINK, END_THINK)


@pytest.mark.parametrize("budget", [0, 1, 4])
def test_budget_n_gives_n_reasoning_tokens_then_the_end_token(llm, budget):
    # The bias keeps <think> the top token: the model would think forever. Spans do not nest, so every <think>
    # after the first is one more reasoning token; after </think> the next <think> opens a new span.
    comp = _gen(llm, [PROMPT], SamplingParams(temperature=0, max_tokens=2 * (budget + 2), logit_bias=OPEN_THINK,
                                               thinking_token_budget=budget, logprobs=1))[0]
    span = [THINK] + [THINK] * budget + [END_THINK]
    assert comp.token_ids == span + span[: 2 * (budget + 2) - len(span)]
    # The forced token's logprob and rank are the model's own (raw logits): not the argmax here.
    assert comp.logprobs[budget + 1][END_THINK].rank > 1


def test_unbudgeted_request_in_the_same_batch_is_untouched(llm):
    free = SamplingParams(temperature=0, max_tokens=6, logit_bias=OPEN_THINK)
    capped = SamplingParams(temperature=0, max_tokens=6, logit_bias=OPEN_THINK, thinking_token_budget=2)
    a, b, c = _gen(llm, [PROMPT] * 3, [free, capped, SamplingParams(temperature=0, max_tokens=6,
                                                                     thinking_token_budget=-1,
                                                                     logit_bias=OPEN_THINK)])
    assert a.token_ids == [THINK] * 6 == c.token_ids  # -1: unlimited (vLLM)
    assert b.token_ids == [THINK, THINK, THINK, END_THINK, THINK, THINK]


def test_budget_past_int32_is_unlimited(llm):
    """A budget no sequence can reach (2**40, once an OverflowError in the sampler's int32 slot that failed the
    whole step) thinks as freely as no budget, next to a request with a small one."""
    huge, small = [SamplingParams(temperature=0, max_tokens=6, logit_bias=OPEN_THINK, thinking_token_budget=b)
                   for b in (2**40, 2)]
    a, b = _gen(llm, [PROMPT] * 2, [huge, small])
    assert a.token_ids == [THINK] * 6
    assert b.token_ids == [THINK, THINK, THINK, END_THINK, THINK, THINK]


def test_after_the_end_token_sampling_is_normal(llm):
    """The forced </think> is fed to the model like any token: the greedy continuation equals a plain greedy run
    whose prompt already holds the forced span."""
    budget = 3
    comp = _gen(llm, [PROMPT + [THINK]], SamplingParams(temperature=0, max_tokens=budget + 6,
                                                         thinking_token_budget=budget))[0]
    assert comp.token_ids[budget] == END_THINK and END_THINK not in comp.token_ids[:budget]
    head = comp.token_ids[: budget + 1]
    ref = _gen(llm, [PROMPT + [THINK] + head], SamplingParams(temperature=0, max_tokens=5))[0]
    assert comp.token_ids[budget + 1 :] == ref.token_ids


def test_prompt_that_opened_think_counts_its_reasoning_tokens(llm):
    # Two reasoning tokens in the prompt after <think>: a budget of 3 leaves one to generate.
    prompt = PROMPT + [THINK, 264, 882]
    comp = _gen(llm, [prompt], SamplingParams(temperature=0, max_tokens=4, thinking_token_budget=3))[0]
    assert comp.token_ids[1] == END_THINK and comp.token_ids[0] != END_THINK
    # A prompt whose span is already closed: nothing to force (same as without a budget).
    closed = PROMPT + [THINK, 264, END_THINK]
    plain, budgeted = _gen(llm, [closed] * 2, [SamplingParams(temperature=0, max_tokens=4),
                                               SamplingParams(temperature=0, max_tokens=4, thinking_token_budget=0)])
    assert plain.token_ids == budgeted.token_ids
    # Over budget already: the first token is the end token.
    assert _gen(llm, [prompt], SamplingParams(temperature=0, max_tokens=2,
                                              thinking_token_budget=1))[0].token_ids[0] == END_THINK


def test_next_to_a_fast_replay_row(llm):
    """A replaying request's row samples several positions per step (fast replay): the budgeted row beside it
    is still counted and forced on its own position only."""
    trace = [THINK, 264, 882, 264, 882, 264, 882, 264]
    budgeted = SamplingParams(temperature=0, max_tokens=6, logit_bias=OPEN_THINK, thinking_token_budget=1)
    alone = _gen(llm, [PROMPT], budgeted)[0]
    replay, mixed = _gen(llm, [PROMPT, PROMPT], [SamplingParams(trace_decode_token_ids=trace,
                                                                trace_replay_chunk_size=4), budgeted])
    assert replay.token_ids == trace
    assert mixed.token_ids == alone.token_ids == [THINK, THINK, END_THINK, THINK, THINK, END_THINK]


@pytest.mark.gpu
def test_gpu_default_options():
    """On CUDA with the defaults (async scheduling, CUDA graphs, triton attention): the same forced spans."""
    gpu = LLM(device="cuda", max_model_len=128, max_num_seqs=8)
    assert gpu.llm_engine.config.async_scheduling and gpu.llm_engine.config.use_cuda_graphs
    comps = _gen(gpu, [PROMPT] * 3, [SamplingParams(temperature=0, max_tokens=8, logit_bias=OPEN_THINK,
                                                    thinking_token_budget=b) for b in (0, 1, 2)])
    for b, comp in enumerate(comps):
        span = [THINK] * (b + 1) + [END_THINK]
        assert comp.token_ids == (span * 4)[:8]


def test_preempted_request_resumes_its_span():
    """Preemption by recompute re-adds a request with its outputs: the span's state is rebuilt from the tokens."""
    tight = LLM(**_opts(max_model_len=24, block_size=4, num_gpu_blocks_override=12, max_num_seqs=4))
    budgets = (1, 2, 3, 5)
    comps = _gen(tight, [PROMPT] * 4, [SamplingParams(temperature=0, max_tokens=16, logit_bias=OPEN_THINK,
                                                      thinking_token_budget=b) for b in budgets])
    assert tight.llm_engine.scheduler.num_preemptions > 0
    for b, comp in zip(budgets, comps):
        assert comp.token_ids == (([THINK] * (b + 1) + [END_THINK]) * 16)[:16], b


def test_async_scheduling_counts_on_the_device(llm):
    """With a step in flight the count must still be exact: it lives on the device, advanced by the sampler."""
    asyn = LLM(async_scheduling=True, **_opts(max_model_len=128, max_num_seqs=8))
    params = [SamplingParams(temperature=0, max_tokens=9, logit_bias=OPEN_THINK, thinking_token_budget=b)
              for b in (0, 2, 5)] + [SamplingParams(temperature=0.8, seed=7, max_tokens=9, thinking_token_budget=1)]
    prompts = [PROMPT] * 3 + [PROMPT + [THINK]]
    sync_out = _gen(llm, prompts, params)
    async_out = _gen(asyn, prompts, params)
    assert [c.token_ids for c in async_out] == [c.token_ids for c in sync_out]
    assert asyn.llm_engine.num_overlapped_steps > 0
    assert sync_out[3].token_ids[1] == END_THINK


def test_no_think_tokens_is_a_value_error():
    llm = LLM(skip_tokenizer_init=True, **_opts(max_model_len=64))
    assert llm.llm_engine.reasoning_tokens is None
    with pytest.raises(ValueError, match="thinking_token_budget needs the model's reasoning start/end tokens"):
        llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(thinking_token_budget=4), use_tqdm=False)
    # Without a budget the same engine runs as usual.
    assert len(_gen(llm, [PROMPT], SamplingParams(max_tokens=2))[0].token_ids) == 2


class _CharTokenizer:
    """A tokenizer without <think> tokens: every character is one token."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


def test_reasoning_tokens_resolution():
    assert ReasoningTokens.from_tokenizer(_CharTokenizer()) is None  # no such single tokens: no budget
    assert ReasoningTokens.from_tokenizer(None) is None
    assert ReasoningTokens.from_tokenizer(_CharTokenizer(), "[", "]") == ReasoningTokens(ord("["), ord("]"))
    with pytest.raises(ValueError, match="think_start_str = '<t>' is 3 tokens"):
        ReasoningTokens.from_tokenizer(_CharTokenizer(), "<t>", "]")
    with pytest.raises(ValueError, match="same token"):
        ReasoningTokens.from_tokenizer(_CharTokenizer(), "]", "]")


@pytest.mark.parametrize("tokens, state", [
    ([1, 2, 3], (False, 0)), ([1, 7, 2, 3], (True, 2)), ([7], (True, 0)), ([7, 2, 8], (False, 0)),
    ([7, 2, 8, 5, 7, 7, 4], (True, 2)),  # the span opened at the first <think> after the last </think>
    ([8, 7, 7], (True, 1)), ([7, 7, 8, 1], (False, 0)),
])
def test_state_after(tokens, state):
    assert ReasoningTokens(7, 8).state_after(tokens) == state


@pytest.mark.parametrize("start, end, message", [("<think>", None, "set together"), ("", "x", "think_start_str"),
                                                 ("x", 3, "think_end_str")])
def test_reasoning_strings_are_validated(start, end, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(think_start_str=start, think_end_str=end, device="cpu")


def test_engine_options_name_other_tokens():
    tool_open, tool_close = 151657, 151658  # <tool_call> / </tool_call>: single tokens of the Qwen tokenizer
    llm = LLM(think_start_str="<tool_call>", think_end_str="</tool_call>", **_opts(max_model_len=64))
    comp = _gen(llm, [PROMPT], SamplingParams(temperature=0, max_tokens=4, logit_bias={tool_open: 100.0},
                                               thinking_token_budget=1))[0]
    assert comp.token_ids == [tool_open, tool_open, tool_close, tool_open]
    with pytest.raises(ValueError, match="think_end_str = 'not one token' is 3 tokens"):
        LLM(think_start_str="<tool_call>", think_end_str="not one token", **_opts(max_model_len=64))


@pytest.mark.parametrize("value, message", [(-2, "thinking_token_budget"), (1.5, "thinking_token_budget"),
                                            (True, "thinking_token_budget")])
def test_bad_budget_values(value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(thinking_token_budget=value)
    assert SamplingParams(thinking_token_budget=-1).thinking_token_budget is None


def test_speculative_engine_keeps_the_budget(llm):
    """n-gram drafts are accepted in these repeats, but a budgeted request decodes one token a step (its device
    count advances once per draw): the same tokens as without speculation, next to a request that speculates."""
    spec = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                                   "prompt_lookup_max": 3}, **_opts(max_model_len=128, max_num_seqs=8))
    params = [SamplingParams(temperature=0, max_tokens=12, logit_bias=OPEN_THINK, thinking_token_budget=b)
              for b in (0, 3)] + [SamplingParams(temperature=0, max_tokens=12, logit_bias=OPEN_THINK)]
    want = [c.token_ids for c in _gen(llm, [PROMPT] * 3, params)]
    assert [c.token_ids for c in _gen(spec, [PROMPT] * 3, params)] == want
    assert END_THINK in want[0] and END_THINK not in want[2]
    assert spec.llm_engine.scheduler.spec_stats.num_accepted_tokens > 0  # the unbudgeted one did speculate
