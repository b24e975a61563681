"""A request body's `response_format` (OpenAI) or `structured_outputs` (vLLM) -> StructuredOutputsParams."""

from __future__ import annotations

from typing import Any

from ...engine.structured_output_manager import check_structured_outputs
from ...structured_outputs import StructuredOutputsParams
from ..http.errors import bad_request

_JSON_SCHEMA_KEYS = {"name", "schema", "strict", "description"}  # OpenAI's json_schema object
_OPTIONS = ("disable_any_whitespace",)  # StructuredOutputsParams fields that are options, not constraints


def structured_outputs_from_body(structured_outputs: dict[str, Any] | None, format_type: str | None,
                                 json_schema: dict[str, Any] | None) -> StructuredOutputsParams | None:
    """`structured_outputs` ({"json" | "regex" | "choice" | "grammar" | "json_object": ...}) or `response_format`
    ({"type": "json_object"} / {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}; "text" is
    no constraint). Errors are 400s naming the field they came from; a malformed schema in response_format is
    caught here (parsed by xgrammar), one in structured_outputs when the engine admits the request."""
    fmt = None if format_type in (None, "text") else format_type
    options = {}
    if structured_outputs is not None and fmt is not None:
        # As vLLM: structured_outputs may carry options only (disable_any_whitespace) next to response_format.
        if not isinstance(structured_outputs, dict) or set(structured_outputs) - set(_OPTIONS):
            raise bad_request("give the constraint in response_format or in structured_outputs, not both "
                              f"(next to response_format, structured_outputs takes only {', '.join(_OPTIONS)})",
                              "structured_outputs")
        options, structured_outputs = structured_outputs, None
    if structured_outputs is not None:
        try:
            return StructuredOutputsParams.from_dict(structured_outputs)
        except (TypeError, ValueError) as e:
            raise bad_request(_with_field(str(e), "structured_outputs"), "structured_outputs") from None
    if fmt is None:
        if json_schema is not None:
            raise bad_request("response_format.json_schema needs type 'json_schema'", "response_format")
        return None
    if fmt == "json_object":
        try:
            spec = StructuredOutputsParams(json_object=True, **options)
        except ValueError as e:
            raise bad_request(str(e), "structured_outputs") from None
    else:
        if not isinstance(json_schema, dict) or "schema" not in json_schema:
            raise bad_request("response_format type 'json_schema' needs json_schema: {name, schema, strict}",
                              "response_format")
        unknown = sorted(set(json_schema) - _JSON_SCHEMA_KEYS)
        if unknown:
            raise bad_request(f"response_format.json_schema has unknown fields {unknown}", "response_format")
        _check_json_schema_fields(json_schema)
        try:
            spec = StructuredOutputsParams(json=json_schema["schema"], **options)
            check_structured_outputs(spec)
        except ValueError as e:
            field = "structured_outputs" if str(e).startswith("structured_outputs.disable") else "response_format"
            raise bad_request(f"response_format.json_schema.schema: {e}", field) from None
    return spec


def _check_json_schema_fields(json_schema: dict[str, Any]) -> None:
    """OpenAI's (and vLLM's) json_schema object, typed as strictly as the rest of the body: `name` a string (required),
    `description` a string, `strict` a boolean (a "yes" or 1 is a 400, never read as true)."""
    if not isinstance(json_schema.get("name"), str):
        said = "is required" if "name" not in json_schema else "must be a string"
        raise bad_request(f"response_format.json_schema.name {said}", "response_format")
    for key, kind, name in (("description", str, "a string"), ("strict", bool, "a boolean")):
        if json_schema.get(key) is not None and not isinstance(json_schema[key], kind):
            raise bad_request(f"response_format.json_schema.{key} must be {name} or null, got "
                              f"{type(json_schema[key]).__name__}", "response_format")


def _with_field(message: str, field: str) -> str:
    return message if message.startswith(field) else f"{field}: {message}"
