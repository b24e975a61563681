"""Tool calling over HTTP, on an in-process app (`--enable-auto-tool-choice --tool-call-parser hermes`): named and
"required" tool_choice constrain the random model's output to valid calls (arguments checked against the tool's
schema), "auto" reads hermes calls out of an output forced with trace_decode_token_ids, streamed deltas
reassemble to the whole response, the chat template renders the tools and a tool-call history, bad requests are
400s naming the field; and the same through the `openai` client."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from replayllm.config import EngineConfig
from replayllm.entrypoints.openai.api_server import build_app
from replayllm.entrypoints.openai.openai_protocol import ChatCompletionRequest
from replayllm.entrypoints.openai.tool_calling import ToolServing, plan_tools

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "A city's forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
             "required": ["zone"], "additionalProperties": False}}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
USER = [{"role": "user", "content": "Weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def app():
    app = build_app(EngineConfig(device="cpu", dtype="float32", max_model_len=1024, max_num_seqs=8, seed=0,
                                 enable_trace_replay=True), tools=ToolServing(True, "hermes"))
    app.state.async_engine.start()
    yield app
    app.state.async_engine.stop()


def _run(app, calls):
    """calls(client) on a client of the app, in a fresh event loop."""
    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                     timeout=120.0) as client:
            return await calls(client)
    return asyncio.run(main())


async def _chat(client, **body) -> dict:
    r = await client.post("/v1/chat/completions", json={"messages": USER, "tools": TOOLS, **body})
    assert r.status_code == 200, r.text
    return r.json()


async def _stream(client, **body) -> tuple[str | None, list[dict], list[str]]:
    """A streamed chat's (content or None, tool calls reassembled, finish reasons)."""
    content, calls, finishes = "", {}, []
    body = {"messages": USER, "tools": TOOLS, "stream": True, **body}
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            content += choice["delta"].get("content") or ""
            for call in choice["delta"].get("tool_calls", []):
                if "id" in call:  # a call's first delta: id, type and name
                    assert call["index"] == len(calls) and call["type"] == "function"
                    calls[call["index"]] = {"id": call["id"], "type": "function", "function": dict(call["function"])}
                else:
                    calls[call["index"]]["function"]["arguments"] += call["function"]["arguments"]
            if choice["finish_reason"]:
                finishes.append(choice["finish_reason"])
    return content or None, [calls[i] for i in sorted(calls)], finishes


def _check_call(call: dict, name: str | None = None) -> None:
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert name is None or call["function"]["name"] == name
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])


def test_named_function_streamed_and_whole(app):
    """A named function: one call of it, arguments valid for its schema, finish_reason "stop" (as vLLM and
    OpenAI); greedy, so the stream reassembles to the whole response's call."""
    async def calls(client):
        whole = (await _chat(client, tool_choice=NAMED, temperature=0, max_tokens=64))["choices"][0]
        streamed = await _stream(client, tool_choice=NAMED, temperature=0, max_tokens=64)
        return whole, streamed
    whole, (content, streamed_calls, finishes) = _run(app, calls)
    message = whole["message"]
    assert message["content"] is None and whole["finish_reason"] == "stop"
    assert len(message["tool_calls"]) == 1
    _check_call(message["tool_calls"][0], "get_weather")
    assert content is None and finishes == ["stop"]
    assert [c["function"] for c in streamed_calls] == [message["tool_calls"][0]["function"]]


def test_required_calls(app):
    """tool_choice "required": one or more calls, each valid for one of the tools; finish_reason "tool_calls".
    parallel_tool_calls=false: exactly one (the constraint allows one)."""
    async def calls(client):
        many = await _chat(client, tool_choice="required", n=3, temperature=1.0, seed=3, max_tokens=120)
        one = await _stream(client, tool_choice="required", parallel_tool_calls=False, temperature=0,
                            max_tokens=120)
        return many, one
    many, (content, one_calls, finishes) = _run(app, calls)
    for choice in many["choices"]:
        assert choice["finish_reason"] == "tool_calls", choice
        assert choice["message"]["content"] is None and choice["message"]["tool_calls"]
        for call in choice["message"]["tool_calls"]:
            _check_call(call)
    assert content is None and len(one_calls) == 1 and finishes == ["tool_calls"]
    _check_call(one_calls[0])


def test_auto_reads_hermes_calls(app):
    """tool_choice "auto" (the default with tools): the hermes parser reads the calls out of the output (here
    forced token by token with trace_decode_token_ids), streamed and whole alike."""
    output = ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
              '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')

    async def calls(client):
        r = await client.post("/tokenize", json={"prompt": output, "add_special_tokens": False})
        trace = r.json()["tokens"]
        body = {"trace_decode_token_ids": trace, "max_tokens": len(trace)}
        return await _chat(client, **body), await _stream(client, **body)
    whole, (content, streamed_calls, finishes) = _run(app, calls)
    choice = whole["choices"][0]
    # a trace ends its choice at max_tokens: "length" stays (only "stop" becomes "tool_calls")
    assert choice["finish_reason"] == "length" and choice["message"]["content"] == "Checking.\n"
    got = [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]]
    assert got == [("get_weather", '{"city": "Paris", "days": 2}'), ("get_time", '{"zone": "CET"}')]
    assert content == "Checking.\n" and finishes == ["length"]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in streamed_calls] == got
    # tool_choice "none": the same output is plain content
    none = _run(app, lambda c: _chat(c, tool_choice="none", trace_decode_token_ids=[15, 16], max_tokens=2))
    assert none["choices"][0]["message"]["tool_calls"] is None


def test_template_renders_tools_and_tool_history(app):
    """The tools go into the prompt (Qwen3's <tools> block), a replayed assistant call (arguments a JSON string,
    as OpenAI sends it) is rendered as an object, a tool message as a <tool_response>; /tokenize renders the same."""
    history = USER + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24C"}]

    async def calls(client):
        ids = (await client.post("/tokenize", json={"messages": history, "tools": TOOLS})).json()["tokens"]
        text = (await client.post("/detokenize", json={"tokens": ids})).json()["prompt"]
        reply = await _chat(client, messages=history, tool_choice="none", max_tokens=1)
        return text, len(ids), reply["usage"]["prompt_tokens"]
    text, count, prompt_tokens = _run(app, calls)
    assert f"<tools>\n{json.dumps(TOOLS[0])}\n{json.dumps(TOOLS[1])}\n</tools>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\nsunny, 24C\n</tool_response><|im_end|>" in text
    assert prompt_tokens == count  # tool_choice "none" still renders the tools (as vLLM)


@pytest.mark.parametrize("body,param,message", [
    ({"tools": []}, "tools", "empty"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not in tools"),
    ({"tool_choice": NAMED, "response_format": {"type": "json_object"}}, "tool_choice", "cannot be combined"),
    ({"tool_choice": "required", "tools": None}, "tool_choice", "tools must be given"),
    ({"tool_choice": "maybe"}, "tool_choice", ""),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True}}]}, "tools", "strict"),
    ({"tool_choice": NAMED, "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": 5}}}]}, "tools", "no JSON schema"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": "{oops"}}]}]}, "messages.0.tool_calls.0.function.arguments", "JSON"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"id": "c", "function": {
        "name": "f", "arguments": "{}"}}]}]}, "messages.0.tool_calls", "only assistant"),
])
def test_bad_tool_requests(app, body, param, message):
    r = _run(app, lambda c: c.post("/v1/chat/completions", json={"messages": USER, "tools": TOOLS,
                                                                  "max_tokens": 2, **body}))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and message in error["message"], error


def test_auto_needs_the_server_flags():
    """Without --enable-auto-tool-choice, "auto" (explicit, or the default with tools) is a 400, as vLLM;
    "none", "required" and named functions need no flag."""
    def plan(**body):
        return plan_tools(ChatCompletionRequest.model_validate({"messages": USER, **body}), ToolServing())
    for body, param in (({"tools": TOOLS}, "tools"), ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice")):
        with pytest.raises(Exception, match="requires --enable-auto-tool-choice") as e:
            plan(**body)
        assert e.value.param == param
    assert plan(tools=TOOLS, tool_choice="none").template_tools == TOOLS
    assert plan_tools(ChatCompletionRequest.model_validate({"messages": USER, "tools": TOOLS, "tool_choice": "none"}),
                      ToolServing(exclude_tools_when_tool_choice_none=True)).template_tools is None
    assert plan(tools=TOOLS, tool_choice="required").structured_outputs["json"]["type"] == "array"
    assert plan().parser is None and plan().template_tools is None
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        ToolServing(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="only used with --enable-auto-tool-choice"):
        ToolServing(tool_call_parser="hermes")


def test_openai_client(app):
    """The `openai` client's chat.completions.create(tools=..., tool_choice=...) against the server, whole and
    streamed."""
    openai = pytest.importorskip("openai")

    async def calls(_):
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t/v1")
        client = openai.AsyncOpenAI(api_key="none", base_url="http://t/v1", http_client=http)
        resp = await client.chat.completions.create(model="replayllm/tiny-qwen3", messages=USER, tools=TOOLS,
                                                    tool_choice=NAMED, temperature=0, max_tokens=64)
        stream = await client.chat.completions.create(model="replayllm/tiny-qwen3", messages=USER, tools=TOOLS,
                                                      tool_choice="required", temperature=0, max_tokens=120,
                                                      stream=True)
        args, names = {}, {}
        async for chunk in stream:
            for call in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
                if call.function.name:
                    names[call.index] = call.function.name
                args[call.index] = args.get(call.index, "") + (call.function.arguments or "")
        await http.aclose()
        return resp, names, args
    resp, names, args = _run(app, calls)
    call = resp.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    assert names and set(names) == set(args)
    for i, name in names.items():
        jsonschema.validate(json.loads(args[i]), SCHEMAS[name])


def test_required_and_named_calls_follow_the_reasoning_with_a_reasoning_parser():
    """--reasoning-parser deepseek_r1 (an engine option: the grammar waits for </think>, as vLLM's): the model
    reasons first, unconstrained (a logit_bias makes it close the span at once), then the calls' constraint
    applies; the calls are read from the content after the reasoning, not swallowed into reasoning_content
    (before, the grammar ran from the first token: the whole JSON was "reasoning" and no call came back)."""
    app = build_app(EngineConfig(device="cpu", dtype="float32", max_model_len=1024, max_num_seqs=8, seed=0,
                                 reasoning_parser="deepseek_r1"), tools=ToolServing(True, "hermes"))
    app.state.async_engine.start()
    try:
        async def calls(client):
            r = await client.post("/tokenize", json={"prompt": "</think>", "add_special_tokens": False})
            end, = r.json()["tokens"]
            bias = {"logit_bias": {str(end): 100}, "temperature": 0, "max_tokens": 120}
            return (await _chat(client, tool_choice="required", **bias), await _chat(client, tool_choice=NAMED, **bias),
                    await _stream(client, tool_choice=NAMED, **bias))
        required, named, (content, streamed, finishes) = _run(app, calls)
    finally:
        app.state.async_engine.stop()
    for whole, finish in ((required, "tool_calls"), (named, "stop")):
        choice = whole["choices"][0]
        assert choice["finish_reason"] == finish, choice
        message = choice["message"]
        assert message["reasoning_content"] == "" and message["content"] is None and message["tool_calls"], message
        for call in message["tool_calls"]:
            _check_call(call, None if finish == "tool_calls" else "get_weather")
    assert content is None and finishes == ["stop"]
    assert [c["function"] for c in streamed] == [named["choices"][0]["message"]["tool_calls"][0]["function"]]
