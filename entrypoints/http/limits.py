"""RequestLimits: the server's per-request size caps (`replayllm serve --max-*`), checked before any work."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import msgspec

from .errors import APIError, bad_request

if TYPE_CHECKING:
    from ..openai.openai_protocol import _ChatPrompt, _SamplingRequest

MiB = 1 << 20
PROMPT_CHARS_PER_TOKEN = 32  # --max-prompt-chars default: max_model_len x this (no real token is 32 chars)
TRACE_IDS_PER_CONTEXT = 4  # --max-trace-ids default: max_model_len x this


@dataclass(frozen=True)
class RequestLimits:
    """Each cap is a flag of `replayllm serve` (the field's name with dashes). Going over one is a 4xx before
    the body is parsed (body size) or before anything is tokenized or queued (the rest)."""

    max_request_body_bytes: int = 32 * MiB  # 413 past this (Content-Length, or bytes as they arrive)
    max_sequences_per_request: int = 1024  # prompts x n in one request
    max_stop_strings: int = 256
    max_bad_words: int = 256
    max_chat_messages: int = 4096
    max_prompt_chars: int | None = None  # per text prompt or all messages' text; None: max_model_len x 32
    max_structured_choices: int = 4096  # entries of structured_outputs.choice (docs/structured_outputs.md)
    max_structured_schema_bytes: int = 256 * 1024  # UTF-8 bytes of one constraint (schema, regex, EBNF, choices)
    # levels of nested arrays/objects in a JSON body (the body's object is level 1): json.loads, pydantic,
    # copy.deepcopy and xgrammar recurse once per level (Python's stack ends near 1000 frames); 128 leaves them
    # far from it and is ~4x what a real body needs (OpenAI caps a response_format schema at 10 nested levels)
    max_json_depth: int = 128
    # ids in one trace_decode_token_ids; None: max_model_len x 4. Not the context: a longer trace is cut to fit
    # max_model_len, as LLM cuts it (trace_rules.fit). This caps the ids a request may send at all, which are
    # parsed and checked one by one before the cut.
    max_trace_ids: int | None = None
    max_model_len: int = 0  # not a flag: the engine's, set by resolved(); bounds every token-id prompt

    def resolved(self, max_model_len: int) -> RequestLimits:
        """These limits with the max_model_len-relative defaults filled in; every value checked."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        if values["max_prompt_chars"] is None:
            values["max_prompt_chars"] = max_model_len * PROMPT_CHARS_PER_TOKEN
        if values["max_trace_ids"] is None:
            values["max_trace_ids"] = max_model_len * TRACE_IDS_PER_CONTEXT
        values["max_model_len"] = max_model_len
        for name, value in values.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        return RequestLimits(**values)


HELP = {
    "max_request_body_bytes": "request bodies larger than this are refused with 413",
    "max_sequences_per_request": "prompts x n one request may ask for",
    "max_stop_strings": "entries of `stop` one request may send",
    "max_bad_words": "entries of `bad_words` one request may send",
    "max_chat_messages": "messages one chat request may send",
    "max_prompt_chars": "characters of one text prompt (chat: of all messages; also of all `stop` strings and of "
                        "all `bad_words`), before tokenizing "
                        f"(default: max_model_len x {PROMPT_CHARS_PER_TOKEN})",
    "max_json_depth": "levels of nested arrays/objects in a JSON request body (the body's object is level 1)",
    "max_structured_choices": "entries of structured_outputs.choice one request may send",
    "max_structured_schema_bytes": "bytes of one structured-outputs constraint (a JSON schema's JSON text, a regex, "
                                   "an EBNF grammar, all choice strings), checked before anything is compiled",
    "max_trace_ids": "token ids one trace_decode_token_ids may send (a trace longer than the context is cut to "
                     f"fit max_model_len; default: max_model_len x {TRACE_IDS_PER_CONTEXT})",
}


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def add_limit_args(parser: argparse.ArgumentParser) -> None:
    for f in fields(RequestLimits):
        if f.name not in HELP:
            continue
        default = f.default
        parser.add_argument("--" + f.name.replace("_", "-"), type=positive_int, default=default, metavar="N",
                            help=HELP[f.name] + ("" if default is None else f" (default: {default})"))


def limits_from_args(args: argparse.Namespace) -> RequestLimits:
    return RequestLimits(**{f.name: getattr(args, f.name) for f in fields(RequestLimits)
                           if f.name in HELP and hasattr(args, f.name)})


def _over(what: str, count: int, limit: int, flag: str, param: str) -> APIError:
    return bad_request(f"too many {what}: {count}; this server allows at most {limit} (--{flag})", param,
                       "limit_exceeded")


def _check_len(values, limit: int, flag: str, param: str, what: str) -> None:
    if isinstance(values, list) and len(values) > limit:
        raise _over(f"{what} in {param}", len(values), limit, flag, param)


def check_sampling(req: _SamplingRequest, limits: RequestLimits, num_prompts: int) -> None:
    """The caps every generating request shares: sequences (prompts x n), stop, bad_words, trace ids."""
    n = req.n or 1
    if num_prompts * n > limits.max_sequences_per_request:
        param = "prompt" if num_prompts > 1 else "n"
        raise _over(f"sequences ({num_prompts} prompt(s) x n={n})", num_prompts * n,
                    limits.max_sequences_per_request, "max-sequences-per-request", param)
    _check_len(req.stop, limits.max_stop_strings, "max-stop-strings", "stop", "strings")
    _check_len(req.bad_words, limits.max_bad_words, "max-bad-words", "bad_words", "words")
    for name in ("stop", "bad_words"):  # matched every step / tokenized on the engine thread: bounded as a prompt
        value = getattr(req, name)
        chars = len(value) if isinstance(value, str) else sum(map(len, value or ()))
        if chars > limits.max_prompt_chars:
            raise _over(f"characters in {name}", chars, limits.max_prompt_chars, "max-prompt-chars", name)
    check_structured(req, limits)
    _check_len(req.trace_decode_token_ids, limits.max_trace_ids, "max-trace-ids", "trace_decode_token_ids",
               "token ids")


def _constraint_bytes(value: Any) -> int:
    """UTF-8 bytes of a constraint as the grammar compiler gets it: a string's own, a choice list's strings, a
    schema's compact JSON text (msgspec: C speed; the body limit bounds it). A lone surrogate counts its 3 bytes
    (surrogatepass): check_text then refuses it as invalid_unicode, a 400 (was a UnicodeEncodeError, a 500)."""
    if isinstance(value, str):
        return len(value.encode("utf-8", "surrogatepass"))
    if isinstance(value, list) and all(isinstance(c, str) for c in value):
        return sum(len(c.encode("utf-8", "surrogatepass")) for c in value)
    try:
        return len(msgspec.json.encode(value))
    except (TypeError, ValueError, OverflowError):  # not JSON: the constraint's own validation says so later
        return 0


def check_structured(req: _SamplingRequest, limits: RequestLimits) -> None:
    """--max-structured-choices and --max-structured-schema-bytes over `structured_outputs` and
    `response_format.json_schema.schema`, before anything is parsed or compiled (a 400 naming the field)."""
    limit = limits.max_structured_schema_bytes
    spec = getattr(req, "structured_outputs", None)
    if isinstance(spec, dict):
        choice = spec.get("choice")
        if isinstance(choice, list) and len(choice) > limits.max_structured_choices:
            raise _over("entries in structured_outputs.choice", len(choice), limits.max_structured_choices,
                        "max-structured-choices", "structured_outputs")
        for name in ("json", "regex", "grammar", "choice"):
            if spec.get(name) is not None and (size := _constraint_bytes(spec[name])) > limit:
                raise bad_request(f"structured_outputs.{name} is {size} bytes; this server allows at most {limit} "
                                  "(--max-structured-schema-bytes)", "structured_outputs", "limit_exceeded")
    fmt = getattr(req, "response_format", None)
    json_schema = getattr(fmt, "json_schema", None)
    if isinstance(json_schema, dict) and json_schema.get("schema") is not None:
        if (size := _constraint_bytes(json_schema["schema"])) > limit:
            raise bad_request(f"response_format.json_schema.schema is {size} bytes; this server allows at most "
                              f"{limit} (--max-structured-schema-bytes)", "response_format", "limit_exceeded")


def check_raw_counts(body: Any, limits: RequestLimits) -> None:
    """The list caps of a large body's raw JSON, before pydantic validates it (one call that holds the GIL for
    its whole run: ~1 s for 100k chat messages, which would stall every stream). Same errors as the checks
    after validation: `messages`, `stop` and `bad_words` entries, and prompts (x n) of a completion."""
    if not isinstance(body, dict):
        return
    _check_len(body.get("messages"), limits.max_chat_messages, "max-chat-messages", "messages", "entries")
    _check_len(body.get("stop"), limits.max_stop_strings, "max-stop-strings", "stop", "strings")
    _check_len(body.get("bad_words"), limits.max_bad_words, "max-bad-words", "bad_words", "words")
    prompt, n = body.get("prompt"), body.get("n")
    n = n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 1
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):  # several prompts
        if len(prompt) * n > limits.max_sequences_per_request:
            raise _over(f"sequences ({len(prompt)} prompt(s) x n={n})", len(prompt) * n,
                        limits.max_sequences_per_request, "max-sequences-per-request", "prompt")


def check_prompts(prompts: list, limits: RequestLimits, truncating: bool = False) -> int:
    """Each text prompt within --max-prompt-chars, each token-id prompt within max_model_len (unless
    `truncating`: truncate_prompt_tokens keeps its last tokens; the body's size still bounds it); the characters
    of all text prompts (the tokenizer pool's job size)."""
    chars = 0
    for i, p in enumerate(prompts):
        name = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if isinstance(p, str) and len(p) > limits.max_prompt_chars:
            raise _over(f"characters in {name}", len(p), limits.max_prompt_chars, "max-prompt-chars", "prompt")
        if isinstance(p, list) and len(p) > limits.max_model_len and not truncating:
            raise bad_request(f"This model's maximum context length is {limits.max_model_len} tokens. However, "
                              f"your request has {len(p)} input tokens: {name} has {len(p)} token ids, more than "
                              f"max_model_len ({limits.max_model_len}) allows", "prompt", "limit_exceeded")
        chars += len(p) if isinstance(p, str) else 0
    return chars


def check_messages(req: _ChatPrompt, limits: RequestLimits) -> int:
    """--max-chat-messages, and --max-prompt-chars over all the messages' text (before the template runs);
    that text's characters (the tokenizer pool's job size)."""
    _check_len(req.messages, limits.max_chat_messages, "max-chat-messages", "messages", "entries")
    chars = 0
    for m in req.messages:
        chars += sum(len(p.text) for p in m.content) if isinstance(m.content, list) else len(m.content or "")
    if chars > limits.max_prompt_chars:
        raise _over("characters in messages", chars, limits.max_prompt_chars, "max-prompt-chars", "messages")
    return chars + 32 * len(req.messages)  # a message's template text counts too: 100k empty ones are work


def check_detokenize(tokens: list[int], limits: RequestLimits) -> None:
    """/detokenize: at most max_model_len ids (more could never have come from one sequence of this model)."""
    if len(tokens) > limits.max_model_len:
        raise bad_request(f"tokens has {len(tokens)} token ids, more than max_model_len ({limits.max_model_len}) "
                          "allows", "tokens", "limit_exceeded")
