"""Repairs a schema-valid generated request body so it also obeys the cross-field rules JSON Schema cannot state."""

from __future__ import annotations

from typing import Any

# What every constraint kind is repaired to when generated: one that compiles (its content is the rule).
GOOD_CONSTRAINT = {"json": {"type": "object"}, "regex": "[a-z]{1,4}", "grammar": 'root ::= "yes" | "no"',
                   "choice": ["yes", "no"], "json_object": True}
KINDS = tuple(GOOD_CONSTRAINT)
# vLLM's older spellings of a structured_outputs constraint (guided_decoding.py), with a value that compiles
GOOD_GUIDED = {"guided_json": {"type": "object"}, "guided_regex": "[a-z]{1,4}", "guided_choice": ["yes", "no"],
               "guided_grammar": 'root ::= "yes" | "no"'}
TRACE_CONFLICTS = ("prompt_logprobs", "bad_words", "logit_bias", "allowed_token_ids", "structured_outputs",
                   "repetition_detection", "thinking_token_budget", "response_format", *GOOD_GUIDED)


def repair(body: Any, path: str, *, vocab_size: int, max_sequences: int, max_prompt_chars: int,
           max_model_len: int) -> None:
    """Edit `body` in place (it stays schema-valid) for the rules below, one per block: the rule and the code
    that enforces it. Every other refusal of a schema-valid body still fails the test."""
    if not isinstance(body, dict):
        return
    if path in ("/v1/completions", "/v1/chat/completions"):
        _sampling(body, vocab_size, max_sequences, max_prompt_chars)
        _truncation(body, max_model_len)
    if path == "/v1/chat/completions":
        # top_logprobs needs logprobs=true (ChatCompletionRequest.check).
        if body.get("top_logprobs") is not None:
            body["logprobs"] = True
        _tools(body)
    if path == "/v1/responses":
        _responses(body, vocab_size, max_sequences, max_prompt_chars)
    if path == "/inference/v1/generate" and isinstance(body.get("sampling_params"), dict):
        sp = body["sampling_params"]
        _sampling(sp, vocab_size, max_sequences, max_prompt_chars)
        _truncation(sp, max_model_len)
        # stream_options only with stream: true (GenerateRequest.check, as vLLM).
        if not body.get("stream"):
            _clear(body, "stream_options")
        # stop strings need the text: no stop with detokenize false (SamplingParams.__post_init__).
        if sp.get("detokenize") is False:
            _clear(sp, "stop")
    if "messages" in body:
        # add_generation_prompt (default true) and continue_final_message exclude each other
        # (_ChatPrompt.check_chat_prompt, as vLLM).
        if body.get("continue_final_message"):
            body["add_generation_prompt"] = False
        # chat_template_kwargs may only set variables the model's chat template reads (chat_template.
        # check_chat_template_kwargs): the template is the model's, not part of the request schema.
        _clear(body, "chat_template_kwargs")
        _cap_chars(body["messages"], max_prompt_chars)
        _tool_history(body["messages"])


def _truncation(body: dict, max_model_len: int) -> None:
    # truncate_prompt_tokens: -1 or 1 .. max_model_len - 1 (SamplingParams, InputProcessor.truncation_size); the
    # schema states -1 .. max_model_len - 1 (EngineBounds), not that 0, which would keep no token, is refused.
    k = body.get("truncate_prompt_tokens")
    if isinstance(k, int) and not isinstance(k, bool) and (k == 0 or k >= max_model_len):
        body["truncate_prompt_tokens"] = -1


def _sampling(body: dict, vocab_size: int, max_sequences: int, max_prompt_chars: int) -> None:
    # max_tokens 0 only with echo (the prompt scored, nothing generated), and then no trace
    # (CompletionRequest.check, serving_completions._prompt_only).
    if "prompt" in body and body.get("max_tokens") == 0:
        body["echo"] = True
        _clear(body, "trace_decode_token_ids")
    if body.get("trace_decode_token_ids") is not None:
        # A trace is the whole output of one sequence, and picks every token: n == 1, and no feature that
        # shapes the choice of token (trace_rules.py).
        _clear(body, "n", "best_of", *TRACE_CONFLICTS)
    else:
        # trace_replay_chunk_size needs a trace (SamplingParams.__post_init__).
        _clear(body, "trace_replay_chunk_size")
    # prompts x n <= --max-sequences-per-request (limits.check_sampling; the schema bounds each factor).
    prompt = body.get("prompt")
    prompts = len(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else 1
    if prompts * (body.get("n") or 1) > max_sequences:
        body["n"] = max_sequences // prompts
    # length_penalty only with use_beam_search, or at its default 1.0 (_SamplingRequest.check_common).
    if not body.get("use_beam_search") and body.get("length_penalty") not in (None, 1.0):
        _clear(body, "length_penalty")
    # best_of only == n (CompletionRequest.check).
    if body.get("best_of") is not None:
        body["best_of"] = body.get("n") or 1
    # min_tokens <= max_tokens (16 by default on /v1/completions; SamplingParams.__post_init__).
    cap = body.get("max_tokens", 16 if "prompt" in body else None)
    cap = body.get("max_completion_tokens") or cap
    if cap is not None and (body.get("min_tokens") or 0) > cap:
        body["min_tokens"] = cap
    # min_tokens <= the room the prompt leaves in max_model_len (SamplingParams.verify_for_engine): a prompt may take
    # all positions but one, so at most 1 here (a text's token count is nothing a schema can bound).
    if (body.get("min_tokens") or 0) > 1:
        body["min_tokens"] = 1
    # seed <= 2**64 - 1, the schema's exact maximum: the generator compares integers with it as floats, so it
    # offers 18446744073709552000 (2**64 rounded) as valid.
    if isinstance(body.get("seed"), int) and body["seed"] > 2**64 - 1:
        body["seed"] = 2**64 - 1
    # stream_options only with stream: true (_SamplingRequest.check_common, as vLLM).
    if not body.get("stream"):
        _clear(body, "stream_options")
    # repetition_detection: min_pattern_size <= max_pattern_size, and min_count >= 2 when on
    # (RepetitionDetectionParams.__post_init__).
    rd = body.get("repetition_detection")
    if isinstance(rd, dict):
        rd["min_pattern_size"] = min(rd.get("min_pattern_size", 0), rd.get("max_pattern_size", 0))
        if rd.get("max_pattern_size", 0) > 0:
            rd["min_count"] = max(2, rd.get("min_count", 0))
    # logit_bias keys: token ids < the vocabulary size (the schema's pattern cannot bound a number written as a
    # key), and no id twice ("7" and "07"): SamplingParams.verify_for_engine, openai_protocol._token_id_keys.
    if isinstance(body.get("logit_bias"), dict):
        ids = {}
        for key, bias in body["logit_bias"].items():
            ids.setdefault(str(int(key) % vocab_size), bias)
        body["logit_bias"] = ids
    _structured(body)
    # The characters of all stop strings, and of all bad words, <= --max-prompt-chars (limits.check_sampling):
    # the schema bounds each string, not their sum.
    for name in ("stop", "bad_words"):
        if isinstance(body.get(name), list):
            body[name] = _prefix(body[name], max_prompt_chars, len)


def _responses(body: dict, vocab_size: int, max_sequences: int, max_prompt_chars: int) -> None:
    _sampling(body, vocab_size, max_sequences, max_prompt_chars)
    # min_tokens <= max_output_tokens (SamplingParams.__post_init__).
    if body.get("max_output_tokens") is not None and (body.get("min_tokens") or 0) > body["max_output_tokens"]:
        body["min_tokens"] = body["max_output_tokens"]
    # top_logprobs needs include ["message.output_text.logprobs"] (ResponsesRequest.check).
    if body.get("top_logprobs") is not None:
        body["include"] = ["message.output_text.logprobs"]
    # chat_template_kwargs: only variables the model's template reads (as on chat, below).
    _clear(body, "chat_template_kwargs")
    # instructions + input messages <= --max-chat-messages, and all their text <= --max-prompt-chars
    # (limits.check_messages on the chat request it becomes): no instructions next to a message list, and the
    # first messages that fit.
    if isinstance(body.get("input"), list):
        _clear(body, "instructions")
        _cap_chars(body["input"], max_prompt_chars)
        body["input"][:] = [m if m.get("content") is not None else {**m, "content": ""} for m in body["input"]]
    elif isinstance(body.get("input"), str):
        body["input"] = body["input"][: max(0, max_prompt_chars - len(body.get("instructions") or ""))]


def _structured(body: dict) -> None:
    """Structured outputs: exactly one constraint, one that compiles (StructuredOutputsParams, engine.
    structured_outputs.check_structured_outputs); response_format.json_schema only with type json_schema, and
    then required (structured_request.structured_outputs_from_body); next to a response_format constraint,
    structured_outputs takes only its options (the same); no thinking_token_budget with one
    (SamplingParams.__post_init__)."""
    fmt = body.get("response_format")
    if isinstance(fmt, dict):
        if fmt["type"] == "json_schema":
            fmt["json_schema"] = {"name": "answer", "schema": {"type": "object"}}
        else:
            fmt["json_schema"] = None
    so = body.get("structured_outputs")
    constrained = isinstance(fmt, dict) and fmt["type"] != "text"
    if isinstance(so, dict):
        if constrained:
            body["structured_outputs"] = {k: v for k, v in so.items() if k == "disable_any_whitespace"} or None
        else:
            kind = next((k for k in KINDS if so.get(k) not in (None, False)), "choice")
            body["structured_outputs"] = {k: v for k, v in so.items() if k == "disable_any_whitespace"}
            body["structured_outputs"][kind] = GOOD_CONSTRAINT[kind]
    # guided_*: one at most, not next to structured_outputs or a response_format constraint, and one that
    # compiles (guided_decoding.guided_structured_outputs).
    guided = [k for k in GOOD_GUIDED if body.get(k) is not None]
    if guided:
        keep = None if body.get("structured_outputs") is not None or constrained else guided[0]
        _clear(body, *(k for k in guided if k != keep))
        if keep is not None:
            body[keep] = GOOD_GUIDED[keep]
            constrained = True
    if body.get("structured_outputs") is not None or constrained:
        _clear(body, "thinking_token_budget")


def _tools(body: dict) -> None:
    """Tool calling (tool_calling.plan_tools): no empty tools; this app has no --enable-auto-tool-choice, so
    "auto" (the default with tools) becomes "none"; "required" / a named function (one of the tools) only without
    another constraint (structured outputs, a trace, thinking_token_budget) and with parameter schemas that
    compile; tool_choice other than "none" needs tools."""
    tools = body.get("tools")
    if tools == []:
        body["tools"] = tools = None
    for tool in tools or []:
        if tool["function"].get("parameters") is not None:
            tool["function"]["parameters"] = {"type": "object"}
    choice = body.get("tool_choice")
    fmt = body.get("response_format")
    constrained = (body.get("structured_outputs") is not None or (isinstance(fmt, dict) and fmt["type"] != "text")
                   or body.get("trace_decode_token_ids") is not None
                   or any(body.get(k) is not None for k in GOOD_GUIDED))
    if not tools:
        if choice not in (None, "none"):
            body["tool_choice"] = "none"
    elif choice in (None, "auto") or (choice != "none" and constrained):
        body["tool_choice"] = "none"
    elif isinstance(choice, dict):
        choice["function"]["name"] = tools[0]["function"]["name"]
    if body.get("tool_choice") not in (None, "none"):
        _clear(body, "thinking_token_budget")


def _tool_history(messages: list) -> None:
    """Replayed tool calls: on assistant messages only, with JSON arguments (openai_protocol._ChatPrompt)."""
    for m in messages:
        if m.get("tool_calls"):
            if m["role"] != "assistant":
                m["tool_calls"] = None
            else:
                for call in m["tool_calls"]:
                    call["function"]["arguments"] = "{}"


def _cap_chars(messages: list, max_chars: int) -> None:
    """The characters of all messages' text <= --max-prompt-chars (limits.check_messages): the schema bounds
    each text, not their sum. Keeps the first messages that fit (at least one: `messages` needs one)."""

    def chars(m: dict) -> int:
        content = m.get("content")
        return sum(len(p["text"]) for p in content) if isinstance(content, list) else len(content or "")

    kept = _prefix(messages, max_chars, chars)
    if not kept:
        kept = [{**messages[0], "content": None}]
    messages[:] = kept


def _clear(body: dict, *names: str) -> None:
    """Null (the default) the fields the body has; a field it lacks may not exist on this route."""
    for name in names:
        if name in body:
            body[name] = None


def _prefix(items: list, limit: int, size) -> list:
    out, total = [], 0
    for item in items:
        total += size(item)
        if total > limit:
            break
        out.append(item)
    return out
