"""Tool-call parsers on crafted model outputs (no model): each format read into calls and content, and the same
output streamed in pieces (char by char and in uneven chunks) reassembles to exactly the non-streamed result."""

from __future__ import annotations

import json
import random

import pytest

from replayllm.entrypoints.openai.tool_parsers import TOOL_PARSERS, ToolCallStream, get_tool_parser
from replayllm.entrypoints.openai.tool_parsers.forced import NamedToolParser, RequiredToolParser, required_schema

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "metric": {"type": "boolean"}, "ratio": {"type": "number"},
                                     "tags": {"type": "array"}}}}},
         {"type": "function", "function": {"name": "noop"}}]
W = '{"city": "Paris", "days": 3}'  # a call's arguments as the model writes them

# (parser, output, expected content, expected [(name, arguments)])
CASES = [
    ("hermes", f'<tool_call>\n{{"name": "get_weather", "arguments": {W}}}\n</tool_call>', "",
     [("get_weather", W)]),
    ("hermes", f'Let me check.\n<tool_call>\n{{"name": "get_weather", "arguments": {W}}}\n</tool_call>\n'
               '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>', "Let me check.\n",
     [("get_weather", W), ("noop", "{}")]),
    ("hermes", '<tool_call>{"arguments": {"s": "a \\" } <tool_call>"}, "name": "noop"}</tool_call> done',
     " done", [("noop", '{"s": "a \\" } <tool_call>"}')]),  # name after the arguments, tags inside a string
    ("hermes", '<tool_call>\n{"name": "noop"}\n</tool_call>', "", [("noop", "{}")]),  # no arguments: {}
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}', "",
     [("get_weather", '{"city": "Oslo"}')]),  # the closing tag cut by a stop string: still a call
    ("hermes", "no calls here, a < b and <tool", "no calls here, a < b and <tool", []),
    ("hermes", "<tool_call>\n{not json}\n</tool_call> after", "<tool_call>\n{not json}\n</tool_call> after", []),
    ("hermes", "   \n", "   \n", []),  # whitespace only, no calls: the text as it is
    ("qwen3_xml", "<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n"
                  "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n"
                  "<parameter=ratio>\n0.5\n</parameter>\n<parameter=tags>\n[\"a\", 1]\n</parameter>\n"
                  "</function>\n</tool_call>", "",
     [("get_weather", '{"city": "San Francisco", "days": 3, "metric": true, "ratio": 0.5, "tags": ["a", 1]}')]),
    ("qwen3_xml", "Sure.\n<tool_call>\n<function=noop>\n</function>\n</tool_call>\n<tool_call>\n"
                  "<function=get_weather>\n<parameter=city>\n<b>\n</parameter>\n<parameter=days>\nmany\n"
                  "</parameter>\n</function>\n</tool_call>", "Sure.\n",
     [("noop", "{}"), ("get_weather", '{"city": "<b>", "days": "many"}')]),  # not an integer: kept as text
    ("qwen3_xml", "<tool_call>\n<junk>\n</tool_call> x", "<tool_call>\n<junk>\n</tool_call> x", []),
    ("llama3_json", f'{{"name": "get_weather", "parameters": {W}}}', "", [("get_weather", W)]),
    ("llama3_json", f'<|python_tag|>{{"name": "get_weather", "parameters": {W}}}; {{"name": "noop", '
                    '"parameters": {}}', "", [("get_weather", W), ("noop", "{}")]),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),  # JSON, but no call: content
    ("llama3_json", "The weather is fine.", "The weather is fine.", []),
    ("llama3_json", '{"name": "noop", "parameters": {}} and some words', "and some words", [("noop", "{}")]),
]


def _stream(parser, pieces: list[str]) -> tuple[str, list[tuple[str, str]], list[dict]]:
    """Feed growing prefixes, then the whole text as final: (content, [(name, arguments)], first call deltas)."""
    stream = ToolCallStream(parser)
    content, calls, firsts, text = "", {}, [], ""
    for i, piece in enumerate(pieces):
        text += piece
        delta = stream.delta(text, final=i == len(pieces) - 1)
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            if "id" in call:
                firsts.append(call)
                assert call["index"] == len(calls) and call["type"] == "function"
                assert call["id"].startswith("call_") and len(call["id"]) == 29
                calls[call["index"]] = [call["function"]["name"], call["function"]["arguments"]]
            else:
                assert set(call) == {"index", "function"} and set(call["function"]) == {"arguments"}
                calls[call["index"]][1] += call["function"]["arguments"]
    return content, [tuple(c) for _, c in sorted(calls.items())], firsts


def _chunks(text: str, seed: int) -> list[str]:
    rng, out, i = random.Random(seed), [], 0
    while i < len(text):
        n = rng.randint(1, 7)
        out.append(text[i:i + n])
        i += n
    return out or [""]


@pytest.mark.parametrize("name,text,content,calls", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_parse_and_stream(name, text, content, calls):
    parser = get_tool_parser(name)(TOOLS)
    parsed = parser.parse(text, final=True)
    assert parsed.content == content
    assert [(c.name, c.arguments) for c in parsed.calls] == calls
    for c in parsed.calls:
        json.loads(c.arguments)  # valid JSON text
    for pieces in (list(text), _chunks(text, 1), _chunks(text, 2), [text]):
        got_content, got_calls, firsts = _stream(parser, pieces)
        assert (got_content, got_calls) == (content, calls), pieces
        assert [f["function"]["name"] for f in firsts] == [c[0] for c in calls]


def test_malformed_after_the_name():
    """A call that turns out malformed after its name was streamed: the whole response gives its text back as
    content (as vLLM); the stream cannot take back the name it sent (the one case where the two differ)."""
    text = "<tool_call>\n<function=x>\n<junk>\n</function>\n</tool_call>"
    parser = get_tool_parser("qwen3_xml")(TOOLS)
    assert (parser.parse(text, True).content, parser.parse(text, True).calls) == (text, [])
    content, calls, _ = _stream(parser, list(text))
    assert calls == [("x", "{")] and content == text


def test_stream_sends_the_name_before_the_arguments_end():
    """A call's name goes out as soon as it is complete; its arguments follow in fragments as they are written."""
    parser = get_tool_parser("hermes")(TOOLS)
    stream = ToolCallStream(parser)
    text = f'<tool_call>\n{{"name": "get_weather", "arguments": {W}}}\n</tool_call>'
    cut = text.index('"Paris"') + 3
    first = stream.delta(text[:cut], final=False)
    assert first == {"tool_calls": [{"index": 0, "id": first["tool_calls"][0]["id"], "type": "function",
                                     "function": {"name": "get_weather", "arguments": '{"city": "Pa'}}]}
    assert stream.delta(text, final=True) == {"tool_calls": [{"index": 0, "function": {"arguments":
                                                                                           'ris", "days": 3}'}}]}
    # text that may begin a tag is held back, then released when it turns out to be none
    stream = ToolCallStream(parser)
    assert stream.delta("Hi <tool_", final=False) == {"content": "Hi "}
    assert stream.delta("Hi <tool_x", final=True) == {"content": "<tool_x"}


def test_parallel_tool_calls_false_keeps_the_first():
    text = '<tool_call>{"name": "noop", "arguments": {}}</tool_call><tool_call>{"name": "get_weather"}</tool_call>'
    parser = get_tool_parser("hermes")(TOOLS)
    stream = ToolCallStream(parser, max_calls=1)
    sent = [d for i in range(1, len(text) + 1) for d in stream.delta(text[:i], i == len(text)).get("tool_calls", [])]
    assert [d["function"].get("name") for d in sent if "id" in d] == ["noop"]


def test_forced_parsers():
    """tool_choice named: the whole output is the arguments; required: a JSON array of {name, parameters}."""
    named = NamedToolParser(TOOLS, "get_weather")
    assert [(c.name, c.arguments) for c in named.parse(f" {W}\n", True).calls] == [("get_weather", W)]
    assert _stream(named, list(f" {W}\n"))[1] == [("get_weather", W)]
    required = RequiredToolParser(TOOLS)
    text = f'[{{"name": "get_weather", "parameters": {W}}}, {{"name": "noop", "parameters": {{}}}}]'
    expected = [("get_weather", W), ("noop", "{}")]
    assert [(c.name, c.arguments) for c in required.parse(text, True).calls] == expected
    for pieces in (list(text), _chunks(text, 3)):
        assert _stream(required, pieces)[:2] == ("", expected)
    cut = text[:30]  # cut by max_tokens: no call array, the text is content
    assert (required.parse(cut, True).content, required.parse(cut, True).calls) == (cut, [])


def test_required_schema():
    schema = required_schema(TOOLS, parallel=True)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["noop"]]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert required_schema(TOOLS, parallel=False)["maxItems"] == 1
    defs = [{"type": "function", "function": {"name": f"f{i}", "parameters": {
        "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": {"P": {"type": kind}}}}}
        for i, kind in enumerate(("string", "integer"))]
    assert required_schema(defs[:1], parallel=True)["$defs"] == {"P": {"type": "string"}}
    with pytest.raises(ValueError, match="differently"):
        required_schema(defs, parallel=True)


def test_registry():
    assert sorted(TOOL_PARSERS) == ["hermes", "llama3_json", "qwen3_xml"]
    with pytest.raises(ValueError, match="known: hermes"):
        get_tool_parser("mistral")
