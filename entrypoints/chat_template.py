"""vLLM's `chat_template_kwargs`: extra variables for the tokenizer's chat template (e.g. Qwen3's
`enable_thinking`), shared by /v1/chat/completions, chat-style /tokenize and `LLM.chat`; and the server's
`--chat-template` (a template instead of the tokenizer's).

A variable the template never reads would be silently ignored: `LLM.chat` and a server started with
--strict-request-fields refuse it; the server otherwise drops it, as vLLM does, but names it (a log line and the
x-replayllm-ignored-fields header). The options `apply_chat_template` takes itself (`tokenize`,
`add_generation_prompt`, ...), which have their own request fields or arguments, are always refused."""

from __future__ import annotations

import functools
import inspect
import json
import os
from typing import Any

RESERVED = frozenset({"messages", "conversation"})  # what the template gets the conversation as


def check_chat_template_kwargs(tok, kwargs: dict[str, Any] | None, chat_template: str | None = None,
                               drop_unused: bool = False) -> dict:
    """`kwargs` checked against the chat template that will render (ValueError naming chat_template_kwargs);
    with `drop_unused`, the keys the template does not read are left out of the result instead of refused."""
    if not kwargs:
        return {}
    own = set(inspect.signature(tok.apply_chat_template).parameters) | RESERVED
    for key in kwargs:
        if key in own:
            raise ValueError(f"chat_template_kwargs may not set {key!r}: it is an option of the chat rendering "
                             f"itself (use its own field or argument)")
    used = _template_variables(template_source(tok, chat_template))
    unused = sorted(k for k in kwargs if k not in used)
    if drop_unused:
        return {k: v for k, v in kwargs.items() if k in used}
    if unused:
        raise ValueError(f"chat_template_kwargs {unused} are not used by this model's chat template (it reads: "
                         f"{sorted(used - own) or 'no extra variables'})")
    return dict(kwargs)


def template_source(tok, chat_template: str | None = None) -> str:
    """The template that renders: `chat_template` (a template, or the name of one of the tokenizer's), else the
    tokenizer's."""
    return tok.get_chat_template(chat_template) if hasattr(tok, "get_chat_template") else (
        chat_template or tok.chat_template)


def tool_calls_for_template(calls: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """A replayed assistant message's `tool_calls` ([{id, type, function: {name, arguments}}]) as chat templates
    render them: OpenAI sends `arguments` as a JSON string, HF templates (Qwen's, Llama's) write it with
    `| tojson`, so it is parsed into its object first, as vLLM does. ValueError naming `where`.j.function.arguments
    when it is no JSON."""
    out = []
    for j, call in enumerate(calls):
        function = dict(call["function"])
        try:
            function["arguments"] = json.loads(function["arguments"])
        except ValueError as e:
            raise ValueError(f"{where}.{j}.function.arguments must be a JSON string: {e}") from None
        out.append({**call, "function": function})
    return out


@functools.lru_cache(maxsize=16)
def _template_variables(source: str) -> frozenset[str]:
    """The variables a Jinja template reads from its context."""
    from jinja2 import meta
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    return frozenset(meta.find_undeclared_variables(env.parse(source)))


@functools.lru_cache(maxsize=16)
def iterates_content(source: str) -> bool:
    """Whether the template loops over a message's `content` (`{% for part in message['content'] %}`: LLaVA's,
    Idefics3's, most multimodal templates), i.e. expects OpenAI's list of parts; vLLM's "openai" content format."""
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    for loop in env.parse(source).find_all(nodes.For):
        target = loop.iter.node if isinstance(loop.iter, nodes.Filter) else loop.iter
        if isinstance(target, nodes.Getattr) and target.attr == "content":
            return True
        if isinstance(target, nodes.Getitem) and isinstance(target.arg, nodes.Const) and target.arg.value == "content":
            return True
    return False


CONTENT_FORMATS = ("auto", "string", "openai")  # vLLM's chat_template_content_format


def messages_for_template(messages: list[dict], source: str | None, content_format: str = "auto") -> list[dict]:
    """The conversation as the template reads it (vLLM's two content formats). A template that loops over
    `content` gets a list of parts: a string content becomes [{"type": "text", "text": it}] (a loop over a string
    would walk its characters and render nothing). Any other template gets a string: text parts
    joined with newlines, as vLLM joins them; None becomes "". A part that is not text is a ValueError (this engine
    serves text only). content_format "openai" / "string" forces one form, "auto" detects it."""
    if content_format not in CONTENT_FORMATS:
        raise ValueError(f"chat_template_content_format must be one of {list(CONTENT_FORMATS)}, got {content_format!r}")
    parts = content_format == "openai" or (content_format == "auto" and bool(source) and iterates_content(source))
    return [_message_for_template(m, parts) if isinstance(m, dict) else m for m in messages]


def _message_for_template(m: dict, parts: bool) -> dict:
    content = m.get("content")
    if parts:
        return {**m, "content": [{"type": "text", "text": content}]} if isinstance(content, str) else m
    if content is None:
        return {**m, "content": ""} if "content" in m else m
    if isinstance(content, list):
        return {**m, "content": "\n".join(_text_part(p) for p in content)}
    return m


def _text_part(part) -> str:
    if isinstance(part, str):
        return part
    if isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
        return part["text"]
    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
    raise ValueError(f"message content part of type {kind!r}: this engine serves text only (parts must be "
                     f"{{'type': 'text', 'text': str}})")


def load_chat_template(value: str | None) -> str | None:
    """vLLM's `--chat-template`: a file's path or the Jinja template itself, checked to compile. ValueError for a
    path that does not exist or a template with a syntax error (the server refuses to start)."""
    if value is None:
        return None
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                source = f.read()
        except OSError as e:
            raise ValueError(f"--chat-template: cannot read {value}: {e}") from e
        where = value
    elif any(c in value for c in "{}\n"):
        source, where = value, "the inline template"
    else:
        raise ValueError(f"--chat-template: {value!r} is no file (and no inline Jinja template: it has no '{{')")
    from jinja2 import TemplateSyntaxError

    try:
        _template_variables(source)
    except TemplateSyntaxError as e:
        raise ValueError(f"--chat-template: {where} is not a valid Jinja template (line {e.lineno}: {e.message})"
                         ) from e
    return source
