"""The unknown-field policy of request bodies: ignored but named (a rate-limited warning and the
x-replayllm-ignored-fields response header), as vLLM accepts them; or, with --strict-request-fields, a 400."""

from __future__ import annotations

import logging
from urllib.parse import quote

from pydantic import BaseModel

from ..http.errors import bad_request

logger = logging.getLogger("replayllm.server")  # its warnings are rate-limited (log_throttle.py)
IGNORED_HEADER = "x-replayllm-ignored-fields"
_HEADER_NAMES = 32  # names listed in the header at most (then "... N more"): a header stays small
_SAFE = "_-.:[]()"  # kept as they are in a header name; anything else (a comma, non-ASCII) %-escaped
_NAME_CHARS = 100  # a longer name is cut (header and log line)


def apply_field_policy(body: BaseModel, strict: bool) -> None:
    """A body's unknown fields, top-level and nested ("messages.1.cache_control", as pydantic names a place): a
    400 naming the first when `strict`, else ignored, logged and recorded on the body for the header
    (body.ignore). vLLM accepts both kinds."""
    unknown = unknown_fields(body)
    if not unknown:
        return
    if strict:
        raise bad_request(f"Unrecognized request argument supplied: {', '.join(unknown)}", unknown[0],
                          "unknown_parameter")
    body.ignore(unknown)
    logger.warning("ignoring request fields this server does not know: %s (start the server with "
                   "--strict-request-fields to refuse them)", _names(unknown))


def unknown_fields(model: BaseModel, prefix: str = "") -> list[str]:
    """The keys `model` and the models nested in it (through lists too) kept aside as unknown, dotted paths."""
    names = [prefix + k for k in model.model_extra or ()]
    for name in type(model).model_fields:
        names += _nested_unknown(getattr(model, name), f"{prefix}{name}.")
    return names


def _nested_unknown(value, prefix: str) -> list[str]:
    if isinstance(value, BaseModel):
        return unknown_fields(value, prefix)
    # A list of models (messages, tools, parts); lists of ids (a trace may hold a million, forced routes are lists
    # of lists of them) are never walked.
    if isinstance(value, list) and value and isinstance(value[0], BaseModel):
        return [n for i, v in enumerate(value) for n in _nested_unknown(v, f"{prefix}{i}.")]
    return []


def dropped_template_kwargs(body: BaseModel, names: list[str]) -> None:
    """chat_template_kwargs keys (or reasoning_effort) the chat template does not read, dropped: logged and
    recorded on the body for the header."""
    if not names:
        return
    body.ignore(names)
    logger.warning("dropping chat template variables the chat template does not read: %s", _names(names))


def ignored_header(body: BaseModel | None) -> dict[str, str]:
    """{IGNORED_HEADER: "a, b"} when the server ignored something of `body`, else {}."""
    names = getattr(body, "ignored_fields", None)
    if not names:
        return {}
    shown = [quote(_cut(n), safe=_SAFE, errors="backslashreplace") for n in names[:_HEADER_NAMES]]  # lone surrogates
    if len(names) > _HEADER_NAMES:
        shown.append(f"... {len(names) - _HEADER_NAMES} more")
    return {IGNORED_HEADER: ", ".join(shown)}


def _names(names: list[str]) -> str:
    text = ", ".join(repr(_cut(n)) for n in names[:_HEADER_NAMES])
    return text + (f" and {len(names) - _HEADER_NAMES} more" if len(names) > _HEADER_NAMES else "")


def _cut(name: str) -> str:
    return name if len(name) <= _NAME_CHARS else name[:_NAME_CHARS - 3] + "..."
