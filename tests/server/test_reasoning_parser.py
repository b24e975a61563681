"""--reasoning-parser's split of a chat output into reasoning_content and content
(entrypoints/openai/reasoning_parser.py): the rules of qwen3 and deepseek_r1, and streamed deltas that concatenate
to the whole split for every cut."""

from __future__ import annotations

import pytest

from replayllm.entrypoints.openai.reasoning_parser import (
    REASONING_PARSERS,
    ReasoningParser,
    ReasoningSplitter,
    StreamedReasoning,
    split_reasoning,
)

# (text, prompt opened <think>) -> (reasoning, content) per parser
CASES = {
    ("<think>abc</think>def", False): {"qwen3": ("abc", "def"), "deepseek_r1": ("abc", "def")},
    ("abc</think>def", False): {"qwen3": (None, "abc</think>def"), "deepseek_r1": ("abc", "def")},
    ("abc</think>def", True): {"qwen3": ("abc", "def"), "deepseek_r1": ("abc", "def")},
    ("plain answer", False): {"qwen3": (None, "plain answer"), "deepseek_r1": ("plain answer", None)},
    ("<think>cut off", False): {"qwen3": ("cut off", None), "deepseek_r1": ("cut off", None)},
    ("<think></think>x", False): {"qwen3": ("", "x"), "deepseek_r1": ("", "x")},
    ("<thi", False): {"qwen3": (None, "<thi"), "deepseek_r1": ("<thi", None)},
    ("a</thin", True): {"qwen3": ("a</thin", None), "deepseek_r1": ("a</thin", None)},
}


@pytest.mark.parametrize("parser", REASONING_PARSERS)
@pytest.mark.parametrize("case", list(CASES), ids=[f"{t!r}-{o}" for t, o in CASES])
def test_split_and_every_streamed_cut_agree(parser, case):
    text, opened = case
    assert split_reasoning(parser, text, opened) == CASES[case][parser]
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            s = ReasoningSplitter(parser, opened)
            parts = [s.feed(text[:i]), s.feed(text[i:j]), s.feed(text[j:]), s.flush()]
            reasoning, content = "".join(p[0] for p in parts), "".join(p[1] for p in parts)
            want_r, want_c = CASES[case][parser]
            assert (reasoning, content) == (want_r or "", want_c or ""), (i, j)


def test_streamed_deltas_name_only_what_they_add():
    streamed = StreamedReasoning(ReasoningParser("qwen3", None))
    deltas = [streamed.delta(0, [], piece, last) for piece, last in
              (("<th", False), ("ink>ab", False), ("c</think>d", False), ("ef", True))]
    assert deltas == [{"content": ""}, {"reasoning_content": "ab"}, {"reasoning_content": "c", "content": "d"},
                      {"content": "ef"}]
    assert StreamedReasoning(None).delta(0, [], "<think>x", True) == {"content": "<think>x"}


def test_prompt_opened_by_the_template_is_read_from_the_prompt_tokens():
    from transformers import AutoTokenizer

    from replayllm.config import DEFAULT_MODEL
    from replayllm.model_source import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path(DEFAULT_MODEL))
    assert not ReasoningParser.load("qwen3", tok).tags_special  # Qwen3's own: <think> is not special
    # a tokenizer that marks <think> special (DeepSeek-R1's do): the server keeps the tags in the text for it
    tok.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    parser = ReasoningParser.load("qwen3", tok)
    assert parser.tags_special and tok.convert_tokens_to_ids("<think>") == 151667
    opened = tok.encode("<|im_start|>assistant\n<think>\n", add_special_tokens=False)
    closed = tok.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n", add_special_tokens=False)
    assert parser.prompt_opened(opened) and not parser.prompt_opened(closed) and not parser.prompt_opened([])
    assert parser.split(opened, "hmm</think>yes") == ("hmm", "yes")
    assert parser.split(closed, "hmm</think>yes") == (None, "hmm</think>yes")
    with pytest.raises(ValueError, match="not supported"):
        ReasoningParser.load("granite", tok)
