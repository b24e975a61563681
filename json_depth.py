"""How deep JSON nests, found without recursion: raw text (the server's --max-json-depth) or parsed values.

json.loads, copy.deepcopy, pydantic and xgrammar all recurse once per level: a 12 KB body nested 500 levels
ran Python out of stack (a 500). Bodies are checked before anything parses them, small ones on the event loop
(entrypoints/http/body_offload.py) and large ones in the helper process that counts their lists (body_counts.py);
a JSON schema given as text or as a dict (StructuredOutputsParams) is checked before it is parsed or copied.
Standard library only: that helper loads this file by its path.
"""

from __future__ import annotations

import json
import re

# A JSON string, or (malformed input) an unterminated one running to the end: every opening quote matches at
# once, so the scan is linear whatever the input (no backtracking over escaped quotes).
_STRING = rb'"[^"\\]*(?:\\[\s\S][^"\\]*)*(?:"|\\?\Z)'
_STRINGS = re.compile(_STRING)
_TOKENS = re.compile(_STRING + rb"|[\[\]{},]")
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
_PARENS = bytes.maketrans(b"[]{}", b"()()")
MAX_DEPTH = 128  # the default: --max-json-depth, and a structured-outputs schema's bound (structured_outputs.py)


class NestedTooDeep(ValueError):
    """A body nested deeper than `limit` levels; `key`: the top-level field where (None: not in an object)."""

    def __init__(self, key: str | None, limit: int):
        where = "the request body" if key is None else f"'{key}'"
        super().__init__(f"{where} nests arrays/objects more than {limit} levels deep; this server accepts at "
                         f"most {limit} (--max-json-depth)")
        self.key, self.limit = key, limit


def check(body: bytes, limit: int) -> None:
    """NestedTooDeep when `body` nests deeper than `limit` levels (well-formed or not: then the parser says)."""
    if exceeds(body, limit):
        deep, key = too_deep_key(body, limit)
        if deep:
            raise NestedTooDeep(key, limit)


def exceeds(body: bytes, limit: int) -> bool:
    """Whether arrays/objects nest more than `limit` levels deep in `body` (the body's own object is level 1).
    Common case (at most `limit` brackets in all): two counts. Else strings are dropped, the brackets kept,
    and innermost pairs removed `limit` times over: what remains nests deeper (or is unbalanced: malformed
    JSON, which the parser then reports; `too_deep_key` tells the two apart). All C-speed byte operations."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    nest = _STRINGS.sub(b"", body).translate(None, _NOT_BRACKETS)
    if nest.count(b"[") + nest.count(b"{") <= limit:
        return False
    nest = nest.translate(_PARENS)
    for passes in range(limit):
        shorter = nest.replace(b"()", b"")
        if not shorter:
            return False
        if len(shorter) == len(nest):  # no pair left: ")))(((", unbalanced; every prefix nests at most
            return passes + shorter.count(b"(") > limit  # the unclosed "(" plus the pairs' depth (`passes`)
        nest = shorter
    return True


def too_deep_key(body: bytes, limit: int) -> tuple[bool, str | None]:
    """(whether `body` really nests deeper than `limit`, the top-level field it does it in: None when the body
    is not an object). One token at a time up to the first bracket too deep: for bodies `exceeds` flagged."""
    depth, key, expect_key = 0, None, False
    for m in _TOKENS.finditer(body):
        tok = m.group()
        c = tok[:1]
        if c in (b"[", b"{"):
            depth += 1
            if depth > limit:
                return True, key
            expect_key = depth == 1 and c == b"{"
        elif c in (b"]", b"}"):
            depth -= 1
            if depth < 0:
                return False, None  # unbalanced: the parser reports it
        elif c == b",":
            expect_key = depth == 1
        elif expect_key:  # a string where a top-level key goes
            key, expect_key = _decode(tok), False
    return False, None


def value_exceeds(value: object, limit: int) -> bool:
    """Whether a parsed JSON value (dicts, lists, scalars) nests more than `limit` levels (a dict or list is level
    1). Iterative: a value too deep for a recursive walk is still measured."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def _decode(token: bytes) -> str:
    try:
        return json.loads(token)
    except ValueError:
        return token[1:-1].decode("utf-8", "replace")
