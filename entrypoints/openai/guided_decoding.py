"""vLLM's older guided-decoding body fields (`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`) as
the `structured_outputs` object they stand for. `guided_decoding_backend` is no field here: the server ignores it
as an unknown field (xgrammar is the one backend), naming it in x-replayllm-ignored-fields."""

from __future__ import annotations

from typing import Any

from ...engine.structured_output_manager import check_structured_outputs
from ...structured_outputs import StructuredOutputsParams
from ..http.errors import APIError, bad_request

# guided_* field -> its structured_outputs key (StructuredOutputsParams)
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


def guided_structured_outputs(values: dict[str, Any], structured_outputs: dict[str, Any] | None,
                              format_type: str | None) -> tuple[str, dict[str, Any]] | None:
    """(the guided field given, its structured_outputs object) from {guided field: value or None}, or None when
    none is set. 400 for two guided fields, or one next to structured_outputs / a response_format constraint
    (the constraint would be ambiguous)."""
    given = [name for name, value in values.items() if value is not None]
    if not given:
        return None
    if len(given) > 1:
        raise bad_request(f"give one of {', '.join(GUIDED_FIELDS)}, not several (got {', '.join(given)})", given[1])
    name = given[0]
    if structured_outputs is not None or format_type not in (None, "text"):
        other = "structured_outputs" if structured_outputs is not None else "response_format"
        raise bad_request(f"give the constraint in {name} or in {other}, not both ({name} is vLLM's older "
                          f"spelling of structured_outputs.{GUIDED_FIELDS[name]})", name)
    return name, {GUIDED_FIELDS[name]: values[name]}


def renamed(err: APIError, name: str) -> APIError:
    """A structured_outputs 400 about a constraint that came from the guided field `name`: said about that field."""
    if err.param != "structured_outputs":
        return err
    key = GUIDED_FIELDS[name]
    message = err.message.replace(f"structured_outputs.{key}", name).replace("structured_outputs", name)
    return bad_request(message, name, err.code)


def check_guided(spec: StructuredOutputsParams | None, name: str) -> None:
    """The guided field's constraint compiles (a 400 naming the field now, not structured_outputs at admission)."""
    try:
        check_structured_outputs(spec)
    except ValueError as e:
        raise renamed(bad_request(str(e), "structured_outputs"), name) from None
