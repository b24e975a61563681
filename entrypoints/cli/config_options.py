"""ConfigOption: one typed option of a config dataclass (type, choices, default, help from its source comments)."""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import io
import re
import textwrap
import tokenize
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal

from ...param_checks import json_object

_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")
_NONE = ("none", "null")
# "json": a dict option (speculative_config), given as a JSON object, as vLLM's --speculative-config.
# "other": a type the command line cannot spell (list, a union of several types): the option is not offered.
Kind = Literal["bool", "int", "float", "str", "json", "other"]


@dataclass(frozen=True)
class ConfigOption:
    """A dataclass field as the command line, a --config file and a diff SPEC see it: `kind` is the scalar type
    (Optional stripped), `choices` the values of a Literal type (None: any), `help` the field's comment."""

    name: str  # the field name (max_model_len); the flag is --max-model-len
    kind: Kind
    optional: bool  # `X | None`: "none" is a value
    choices: tuple[Any, ...] | None
    default: Any
    help: str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def offered(self) -> bool:
        """Whether the command line, --config files and SPECs can set it (a scalar or Literal type)."""
        return self.kind != "other"

    @property
    def metavar(self) -> str | None:
        if self.kind == "json":
            return "JSON"
        if self.choices is None:
            return None
        return "{" + ",".join(str(c) for c in (*self.choices, *(("none",) if self.optional else ()))) + "}"

    def parse(self, text: str) -> Any:
        """A command-line / SPEC string -> this option's typed value. ValueError says what was expected."""
        text = text.strip()
        if self.optional and text.lower() in _NONE:
            return None
        if self.kind == "bool":
            if text.lower() in _TRUE:
                return True
            if text.lower() in _FALSE:
                return False
            raise ValueError(f"expected true or false, got {text!r}")
        if self.kind == "other":
            raise ValueError("this option cannot be given as text (set it from Python)")
        if self.kind == "json":
            return json_object(text)
        if self.kind == "int":
            try:
                value: Any = int(text)
            except ValueError:
                if self.name not in HUMAN_READABLE:
                    raise ValueError(f"expected an integer, got {text!r}") from None
                value = human_readable_int(text)
        elif self.kind == "float":
            try:
                value = float(text)
            except ValueError:
                raise ValueError(f"expected a number, got {text!r}") from None
        else:
            value = text
        return self.check_choice(value)

    def check_choice(self, value: Any) -> Any:
        if self.choices is not None and value not in self.choices and not (self.optional and value is None):
            allowed = ", ".join(str(c) for c in (*self.choices, *(("none",) if self.optional else ())))
            hint = closest(str(value), [str(c) for c in self.choices])
            raise ValueError(f"invalid choice {value!r} (choose from {allowed})"
                             + (f"; did you mean {hint!r}?" if hint else ""))
        return value


def closest(word: str, candidates: list[str]) -> str | None:
    """The candidate `word` was most likely meant to be (a typo), or None (difflib's ratio >= 0.6)."""
    close = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    return close[0] if close else None


def config_options(cls: type) -> list[ConfigOption]:
    """Every init field of the dataclass `cls`, typed from its annotations (resolved) and documented from its
    source: the comment on the field's line, else the comment block right above it, else its attribute
    docstring."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    out = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        kind, optional, choices = _describe_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else None
        help_text = f.metadata.get("help") or docs.get(f.name, "")
        out.append(ConfigOption(f.name, kind, optional, choices, default, help_text))
    return out


def _describe_type(tp: Any) -> tuple[Kind, bool, tuple[Any, ...] | None]:
    args = typing.get_args(tp)
    optional = False
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        optional = type(None) in args
        rest = [a for a in args if a is not type(None)]
        if any((typing.get_origin(a) or a) is dict for a in rest):
            return "json", optional, None  # a dict, or a config dataclass that also takes one
        if len(rest) != 1:
            return "other", optional, None
        tp, args = rest[0], typing.get_args(rest[0])
    if typing.get_origin(tp) is Literal:
        kinds = {type(a) for a in args}
        kind = _KINDS.get(kinds.pop()) if len(kinds) == 1 else None
        return (kind, optional, tuple(args)) if kind else ("other", optional, None)
    origin = typing.get_origin(tp) or tp
    return _KINDS.get(origin, "other"), optional, None


_KINDS: dict[type, Kind] = {bool: "bool", int: "int", float: "float", str: "str"}


def field_docs(cls: type) -> dict[str, str]:
    """{field: its comment}, read from the class source (empty when the source is not available)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    comments: dict[int, str] = {}  # line -> comment text
    code_lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):
            code_lines.add(tok.start[0])
    body = ast.parse(source).body[0].body
    docs = {}
    for i, node in enumerate(body):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        line = node.lineno
        text = comments.get(node.end_lineno) if node.end_lineno in code_lines else None
        if not text:  # the comment block right above (no blank line between)
            above, n = [], line - 1
            while n in comments and n not in code_lines:
                above.insert(0, comments[n])
                n -= 1
            text = " ".join(above)
        nxt = body[i + 1] if i + 1 < len(body) else None
        if not text and isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant) \
                and isinstance(nxt.value.value, str):
            text = " ".join(nxt.value.value.split())
        docs[node.target.id] = text
    return docs


# vLLM's sizes written as 4k (4,000), 32K (32,768), 1.5m (1,500,000): on these options, as its CLI takes them
HUMAN_READABLE = frozenset({"max_model_len", "max_num_batched_tokens"})
_SUFFIX = re.compile(r"(\d+(?:\.\d+)?)([kmgtKMGT])")


def human_readable_int(text: str) -> int:
    """"4k" -> 4000 (lower case: powers of 1000, decimals allowed), "4K" -> 4096 (upper case: powers of 1024,
    whole numbers only); ValueError otherwise."""
    match = _SUFFIX.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"expected an integer or a size such as 4k (4000) or 4K (4096), got {text!r}")
    number, suffix = match.groups()
    power = "kmgt".index(suffix.lower()) + 1
    if suffix.islower():
        return int(float(number) * 1000 ** power)
    if "." in number:
        raise ValueError(f"decimals are not allowed with the binary suffix {suffix} (1024s): did you mean "
                         f"{number}{suffix.lower()}?")
    return int(number) * 1024 ** power
