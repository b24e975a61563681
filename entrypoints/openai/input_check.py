"""Boundary checks on a request's values: valid Unicode everywhere, token ids by position, integral floats as ints."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, Field, StringConstraints, ValidationError, ValidatorFunctionWrapHandler

from ...engine.input_processor import plain_ints
from ..http.errors import APIError, bad_request

# The accepted-and-ignored fields, capped as OpenAI documents them (metadata: 16 pairs, keys <= 64 characters,
# values <= 512; `user`: 256 here): ignored must not mean unbounded (each took a 10 MB string before).
User = Annotated[str, Field(max_length=256)]
Metadata = Annotated[dict[Annotated[str, StringConstraints(max_length=64)], Annotated[str, StringConstraints(
    max_length=512)]], Field(max_length=16)]


def _bad_char(text: str) -> tuple[int, str] | None:
    """(position, the character) of the first code point UTF-8 cannot encode (a lone surrogate), or None."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start, text[e.start]
    return None


def _whole(value: Any) -> Any:
    """value with every float that has a zero fraction (5.0, 1e3) made an int, in lists too; value itself when
    there is none."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        out = [_whole(v) for v in value]
        return value if all(a is b for a, b in zip(out, value)) else out
    return value


def integral_floats(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """A strict int field's wrap validator: a JSON number with a zero fraction is that integer, as JSON Schema's
    `integer` (what /openapi.json says) and vLLM take it. 1.5, "5" and true stay refused, with the strict
    validator's own error; the happy path costs one call."""
    try:
        return handler(value)
    except ValidationError:
        whole = _whole(value)
        if whole is value:
            raise
        return handler(whole)


def _walk(value: Any, path: list[str]):
    """Every string in a request (dict keys too), with its location as a list of field names and indexes."""
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, BaseModel):  # the fields the request set (defaults are ours), in declaration order
        given = value.model_fields_set
        for name in type(value).model_fields:
            if name in given:
                yield from _walk(getattr(value, name), [*path, name])
    elif isinstance(value, list):
        if value and type(value[0]) is int and plain_ints(value):
            return  # token ids: nothing to check here (fast path for long lists: one C-level pass)
        for i, v in enumerate(value):
            yield from _walk(v, [*path, str(i)])
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _walk(k, [*path, f"<key {k[:20]!r}>" if isinstance(k, str) else str(k)])
            yield from _walk(v, [*path, str(k)[:40]])


def _readable(path: list[str]) -> str:
    """["messages", "0", "content"] -> "messages[0].content"."""
    out = ""
    for p in path:
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return out


def check_text(req: BaseModel) -> None:
    """400 naming the field when any text in the request is not valid Unicode (e.g. a lone surrogate
    "\\ud800", which JSON can carry but no tokenizer can encode)."""
    for path, text in _walk(req, []):
        _check_unicode(text, path)


def check_unicode(text: str | None, param: str) -> None:
    """check_text for one top-level string field (`model`, checked before it is looked up: 400, not 404)."""
    if text is not None:
        _check_unicode(text, [param])


def _check_unicode(text: str, path: list[str]) -> None:
    bad = _bad_char(text)
    if bad is not None:
        pos, ch = bad
        raise bad_request(f"{_readable(path)} is not valid Unicode: character {pos} is U+{ord(ch):04X}, "
                          "a lone surrogate (send text as UTF-8, or escape pairs as \\ud83d\\ude00)",
                          ".".join(path), "invalid_unicode")


def unicode_key_error(key: Any, loc: list[str]) -> APIError | None:
    """The 400 for a field NAME that is not valid Unicode: pydantic refuses the whole object at `loc` (error
    `string_unicode`, its input the key). Names the object and the key; None when `key` is valid text."""
    bad = _bad_char(key) if isinstance(key, str) else None
    if bad is None:
        return None
    pos, ch = bad
    where = f"in {_readable(loc)}" if loc else "of the request body"
    return bad_request(f"a field name {where} is not valid Unicode: {key[:40]!r} has U+{ord(ch):04X} at character "
                       f"{pos}, a lone surrogate (send text as UTF-8)", ".".join([*loc, key[:40]]), "invalid_unicode")


def check_prompt_ids(prompts: list | None) -> None:
    """400 naming the first negative id of a token-id prompt by prompt and position (`prompt[i][j]`: only the
    server knows which of a request's prompts it was). The other id and string lists are checked, by
    position, by SamplingParams itself."""
    for i, p in enumerate(prompts or ()):
        if isinstance(p, list):
            name = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            for j, t in enumerate(p):
                if t < 0:
                    raise bad_request(f"{name}[{j}] = {t} is negative: token ids are >= 0", "prompt")
