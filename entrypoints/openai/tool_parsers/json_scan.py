"""A scanner for JSON text that may still be growing: where a value ends (or that it has not ended yet), and the
members of an object. The tool-call parsers read the model's output with it while it streams, so a call's name
and the raw text of its arguments are known before the whole call has been generated."""

from __future__ import annotations

import json
from typing import NamedTuple

_WS = " \t\r\n"
_SCALAR_END = _WS + ",]}"


class Member(NamedTuple):
    """One `"key": value` of an object: the key, and the value's span in the text (end None: not complete yet)."""

    key: str
    start: int
    end: int | None


def skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WS:
        pos += 1
    return pos


def value_end(text: str, pos: int) -> int | None:
    """The end (exclusive) of the JSON value starting at text[pos], or None if the text ends inside it (or a
    scalar runs to the end of the text, where more digits or letters may follow). Only the nesting and the
    strings are followed: a malformed value is found malformed later, by json.loads."""
    if pos >= len(text):
        return None
    first = text[pos]
    if first == '"':
        return _string_end(text, pos)
    if first not in "{[":
        while pos < len(text) and text[pos] not in _SCALAR_END:
            pos += 1
        return pos if pos < len(text) else None
    depth = 0
    while pos < len(text):
        c = text[pos]
        if c == '"':
            end = _string_end(text, pos)
            if end is None:
                return None
            pos = end
            continue
        if c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return pos + 1
        pos += 1
    return None


def _string_end(text: str, pos: int) -> int | None:
    """The end (exclusive) of the string literal opening at text[pos] ('"'), None if it is not closed yet."""
    pos += 1
    while pos < len(text):
        c = text[pos]
        if c == "\\":
            pos += 2
            continue
        if c == '"':
            return pos + 1
        pos += 1
    return None


def object_members(text: str, pos: int) -> tuple[list[Member], int | None]:
    """The members of the object opening at text[pos] ('{') as far as the text goes, and the object's end
    (exclusive; None if not closed yet). A member appears once its key is complete; its end is None while its
    value is still growing. Text that is no object member (malformed) ends the scan: (members so far, None)."""
    members: list[Member] = []
    pos = skip_ws(text, pos + 1)
    while pos < len(text):
        if text[pos] == "}":
            return members, pos + 1
        if text[pos] == ",":
            pos = skip_ws(text, pos + 1)
            continue
        if text[pos] != '"':
            return members, None
        key_end = _string_end(text, pos)
        if key_end is None:
            return members, None
        try:
            key = json.loads(text[pos:key_end])
        except ValueError:
            return members, None
        pos = skip_ws(text, key_end)
        if pos >= len(text) or text[pos] != ":":
            return members, None
        start = skip_ws(text, pos + 1)
        if start >= len(text):
            return members, None
        end = value_end(text, start)
        members.append(Member(key, start, end))
        if end is None:
            return members, None
        pos = skip_ws(text, end)
    return members, None
