"""The trace file's pydantic models and their committed JSON Schema (docs/trace_file.schema.json)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from replayllm.entrypoints.diff import TraceFileError
from replayllm.entrypoints.diff.trace_file import TRACE_KEYS, parse_trace_line
from replayllm.entrypoints.diff.trace_schema import TraceHeader, TraceRequest, json_schema, schema_text

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_committed_schema_is_the_generated_one():
    committed = (DOCS / "trace_file.schema.json").read_text(encoding="utf-8")
    assert committed == schema_text(), "docs/trace_file.schema.json is stale: run `make trace-schema`"


def test_schema_forbids_extra_keys_and_requires_id_and_trace():
    schema = json_schema()
    request, header = schema["$defs"]["TraceRequest"], schema["$defs"]["TraceHeader"]
    assert request["additionalProperties"] is False and header["additionalProperties"] is False
    assert set(request["required"]) == {"id", "trace_token_ids"} and header["required"] == ["provenance"]
    assert tuple(request["properties"]) == TRACE_KEYS
    ids = request["properties"]["trace_token_ids"]
    assert ids["minItems"] == 1 and ids["items"] == {"minimum": 0, "type": "integer"}
    assert all(p.get("description") for p in request["properties"].values())


def test_documented_example_lines_validate():
    """The header and request shown in docs/diff.md pass the models (and the reader)."""
    text = (DOCS / "diff.md").read_text(encoding="utf-8")
    block = re.search(r"```json\n(\{\"provenance\".*?)```", text, re.S).group(1).strip().splitlines()
    TraceHeader.model_validate(json.loads(block[0]))
    TraceRequest.model_validate(json.loads(block[1]))
    record = parse_trace_line(block[1], 2)
    assert record.id == "0" and record.top_logprobs[0][14387] == record.logprobs[0]


@pytest.mark.parametrize("obj, message", [
    ({"id": "a", "prompt": "x", "trace_token_ids": [1], "colour": 1, "size": 2},
     "unknown key(s) 'colour', 'size'; allowed keys: id, prompt, "),
    ({"prompt": "x", "trace_token_ids": [1]}, "missing 'id'"),
    ({"id": True, "prompt": "x", "trace_token_ids": [1]}, "'id' must be a non-empty string or an integer"),
    ({"id": 3, "prompt": "x", "trace_token_ids": [1], "top_logprobs": [{"5": -1}, {"6": -1}]},
     "'top_logprobs' must be a list with one object per trace token (1), got a list of 2"),
    ({"id": 3, "prompt": "x", "trace_token_ids": [1], "logprobs": [float("nan")]}, "must be a finite number"),
    ({"id": 3, "prompt": "", "trace_token_ids": [1]}, "'prompt' must be a non-empty string"),
    ({"id": 3, "prompt": "x", "trace_token_ids": [1], "meta": [1]}, "'meta' must be a JSON object"),
])
def test_model_errors_keep_the_readers_messages(obj, message):
    with pytest.raises(TraceFileError) as e:
        parse_trace_line(json.dumps(obj))
    assert message in str(e.value)


@pytest.mark.parametrize("line", [{"id": 0, "trace_token_ids": [7]},
                                  {"id": 0, "prompt": None, "trace_token_ids": [7]},
                                  {"id": 0, "prompt_token_ids": [1], "trace_token_ids": [7],
                                   "top_logprobs": [{"abc": -1.0}]}],
                         ids=["no-prompt", "null-prompt", "top-k-key-not-an-id"])
def test_the_schema_refuses_what_the_reader_refuses(line):
    """A prompt (text or ids) is required and top-k keys are token ids: rules JSON Schema can state, so the schema
    states them (a validator and the reader agree on these lines)."""
    import jsonschema

    validator = jsonschema.Draft202012Validator(json_schema())
    assert not validator.is_valid(line)
    with pytest.raises(TraceFileError):
        parse_trace_line(json.dumps(line), 1)
    fixed = {**line, "prompt_token_ids": [1], "top_logprobs": None}
    assert validator.is_valid({k: v for k, v in fixed.items() if k != "prompt"})
