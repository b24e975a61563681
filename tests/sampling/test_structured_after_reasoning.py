"""Structured outputs with a reasoning parser (EngineConfig.reasoning_parser, vLLM's --reasoning-parser): the
grammar constrains only the tokens after the reasoning span's end (</think>), as vLLM's structured-output manager
does, unless the prompt closed the span already; without a parser it constrains from the first token. The
embedded model (random weights, the real Qwen tokenizer: <think> / </think> are single tokens), made to close
its reasoning at once by a logit_bias on </think>; synchronous and async scheduling (where the step after the
one that ends the reasoning is launched before that token is seen: its bits must still be the grammar's)."""

from __future__ import annotations

import pytest
from helpers.trace_replay_common import DEVICE, DTYPE

from replayllm import LLM, SamplingParams, StructuredOutputsParams

pytest.importorskip("xgrammar")  # a dependency; the GPU machine has it only when its wheels travel in .whl/

CHOICES = ["yes", "no"]


@pytest.fixture(scope="module", params=["sync", "async"])
def llm(request):
    return LLM(device=DEVICE, dtype=DTYPE, max_model_len=128, reasoning_parser="qwen3",
               async_scheduling=request.param == "async")


def _params(bias: dict[int, float], **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=kw.pop("max_tokens", 8), logit_bias=bias,
                          structured_outputs=StructuredOutputsParams(choice=CHOICES), **kw)


def test_the_grammar_waits_for_the_end_of_the_reasoning(llm):
    tok = llm.get_tokenizer()
    end = tok.convert_tokens_to_ids("</think>")
    out = llm.generate("Answer:", _params({end: 100.0}), use_tqdm=False)[0].outputs[0]
    # </think> first (no grammar yet: the bias wins), then one of the choices (the grammar masks </think> now)
    assert out.token_ids[0] == end
    assert tok.decode(out.token_ids[1:], skip_special_tokens=True) in CHOICES, out.token_ids
    assert out.finish_reason == "stop"
    # Before </think>, nothing is constrained: a biased plain token fills max_tokens (vLLM's behaviour too)
    plain = tok.encode(" banana", add_special_tokens=False)[0]
    free = llm.generate("Answer:", _params({plain: 100.0}, max_tokens=4), use_tqdm=False)[0].outputs[0]
    assert free.token_ids == [plain] * 4 and free.finish_reason == "length"


def test_a_prompt_that_closed_the_reasoning_is_constrained_at_once(llm):
    """enable_thinking=False's templates end the prompt with an empty <think></think>: the grammar is on from the
    first token (the bias on </think> cannot pass the mask); a prompt still inside <think> waits."""
    tok = llm.get_tokenizer()
    end = tok.convert_tokens_to_ids("</think>")
    closed = llm.generate("Answer: <think>\n\n</think>\n\n", _params({end: 100.0}), use_tqdm=False)[0].outputs[0]
    assert end not in closed.token_ids
    assert tok.decode(closed.token_ids, skip_special_tokens=True) in CHOICES
    opened = llm.generate("Answer: <think>\n", _params({end: 100.0}), use_tqdm=False)[0].outputs[0]
    assert opened.token_ids[0] == end


def test_without_a_parser_the_grammar_constrains_from_the_first_token():
    llm = LLM(device=DEVICE, dtype=DTYPE, max_model_len=128)
    tok = llm.get_tokenizer()
    end = tok.convert_tokens_to_ids("</think>")
    out = llm.generate("Answer:", _params({end: 100.0}), use_tqdm=False)[0].outputs[0]
    assert end not in out.token_ids and tok.decode(out.token_ids, skip_special_tokens=True) in CHOICES
    with pytest.raises(ValueError, match="reasoning parser 'nope' is not supported"):
        LLM(device=DEVICE, dtype=DTYPE, max_model_len=128, reasoning_parser="nope", load_format="dummy")


def test_a_thinking_budget_ends_the_reasoning_then_the_grammar_applies(llm):
    """With the parser, thinking_token_budget and structured outputs combine: the budget forces </think>, which
    starts the grammar; without a parser the pair is a ValueError (the grammar would reject the forced end)."""
    tok = llm.get_tokenizer()
    end = tok.convert_tokens_to_ids("</think>")
    params = SamplingParams(temperature=0, max_tokens=12, thinking_token_budget=3,
                            structured_outputs=StructuredOutputsParams(choice=CHOICES))
    out = llm.generate("Answer: <think>", params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids[3] == end and end not in out.token_ids[:3], out.token_ids  # 3 reasoning tokens, then </think>
    assert tok.decode(out.token_ids[4:], skip_special_tokens=True) in CHOICES and out.finish_reason == "stop"
    plain = LLM(device=DEVICE, dtype=DTYPE, max_model_len=128)
    with pytest.raises(ValueError, match="needs the engine's reasoning_parser"):
        plain.generate("Answer: <think>", params, use_tqdm=False)
