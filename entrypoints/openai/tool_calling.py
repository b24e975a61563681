"""Tool calling in chat completions, as vLLM serves it: the server's flags (ToolServing), what one request's
`tools` / `tool_choice` / `parallel_tool_calls` mean (plan_tools -> ToolPlan), and turning a choice's output
into `message.tool_calls` or streamed `delta.tool_calls` (ChoiceTools).

- tool_choice "auto" (the default when tools are given): the model decides; the server's --tool-call-parser
  reads its calls out of the text. Needs --enable-auto-tool-choice (else a 400, as vLLM).
- "required" / a named function: no flag needed; the output is constrained by structured outputs to calls
  (tool_parsers/forced.py) and read back.
- "none": no calls are read; the tools still go to the chat template unless
  --exclude-tools-when-tool-choice-none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..http.errors import bad_request
from .tool_parsers import ToolCallStream, ToolParser, get_tool_parser
from .tool_parsers.base import limit_calls, new_call_id
from .tool_parsers.forced import NamedToolParser, RequiredToolParser, parameters_schema, required_schema


@dataclass(frozen=True)
class ToolServing:
    """`replayllm serve`'s tool flags (vLLM's names)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    exclude_tools_when_tool_choice_none: bool = False

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None:
            get_tool_parser(self.tool_call_parser)  # ValueError naming the known parsers
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes, qwen3_xml or llama3_json)")
        if self.tool_call_parser is not None and not self.enable_auto_tool_choice:
            raise ValueError("--tool-call-parser is only used with --enable-auto-tool-choice (tool_choice "
                             "'required' and named functions need no parser); give both")


@dataclass
class ToolPlan:
    """One request's tool handling. template_tools: what the chat template gets (None: no tools);
    structured_outputs: the constraint of "required" / a named function (a structured_outputs dict);
    parser: reads calls from the output (None: the output is all content); named: a named function (finish
    reason stays "stop", as vLLM and OpenAI); max_calls: 1 with parallel_tool_calls=false; keep_special_tokens:
    the output text keeps special tokens (the hermes / qwen3_xml tags are special tokens of Qwen's tokenizer,
    which the default skip_special_tokens would drop; vLLM's parsers turn it off too)."""

    template_tools: list[dict[str, Any]] | None = None
    structured_outputs: dict[str, Any] | None = None
    parser: ToolParser | None = None
    named: bool = False
    max_calls: int | None = None
    keep_special_tokens: bool = False

    def sampling_overrides(self) -> dict[str, Any]:
        """The request fields this plan sets for sampling (ChatServer applies them to a copy of the request)."""
        out: dict[str, Any] = {}
        if self.structured_outputs is not None:
            out["structured_outputs"] = self.structured_outputs
        if self.keep_special_tokens:
            out["skip_special_tokens"] = False
        return out


def plan_tools(req, serving: ToolServing) -> ToolPlan:
    """The ToolPlan of a ChatCompletionRequest; APIError 400s naming the field for what cannot be served."""
    if req.tools is not None and not req.tools:
        raise bad_request("tools must not be an empty array: give at least one tool or leave tools out", "tools")
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    choice = req.tool_choice
    explicit = choice is not None
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        shown = None if serving.exclude_tools_when_tool_choice_none else tools or None
        return ToolPlan(template_tools=shown)
    if not tools:
        raise bad_request("when tool_choice is set (other than 'none'), tools must be given too", "tool_choice")
    max_calls = 1 if req.parallel_tool_calls is False else None
    if choice == "auto":
        if not serving.enable_auto_tool_choice:
            raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
                              "set (tool_choice 'required', a named function or 'none' work without them)",
                              "tool_choice" if explicit else "tools")
        strict = [t["function"]["name"] for t in tools if t["function"].get("strict")]
        if strict:
            raise bad_request(f"function strict mode is only enforced with tool_choice 'required' or a named "
                              f"function (the output is then constrained); with 'auto' the model writes calls "
                              f"freely: set strict false or leave it out for {strict}", "tools")
        if req.skip_special_tokens:
            raise bad_request("skip_special_tokens=true would drop the tool-call tags the parser reads (special "
                              "tokens): leave it out with tool_choice 'auto'", "skip_special_tokens")
        return ToolPlan(tools, None, get_tool_parser(serving.tool_call_parser)(tools), max_calls=max_calls,
                        keep_special_tokens=True)
    _no_other_constraint(req)
    if choice == "required":
        try:
            schema = required_schema(tools, parallel=max_calls is None)
        except ValueError as e:
            raise bad_request(f"tools: {e}", "tools") from None
        return ToolPlan(tools, _compact({"json": schema}), RequiredToolParser(tools), max_calls=max_calls)
    name = choice.function.name
    tool = next((t for t in tools if t["function"]["name"] == name), None)
    if tool is None:
        raise bad_request(f"tool_choice names the function {name!r}, which is not in tools "
                          f"({', '.join(repr(t['function']['name']) for t in tools)})", "tool_choice")
    return ToolPlan(tools, _compact({"json": parameters_schema(tool)}), NamedToolParser(tools, name), named=True)


def _compact(constraint: dict[str, Any]) -> dict[str, Any]:
    """Calls as compact JSON (no whitespace between tokens): a model cannot stall in endless whitespace, which
    JSON grammars otherwise allow between any two tokens."""
    return {**constraint, "disable_any_whitespace": True}


def _no_other_constraint(req) -> None:
    """"required" and named functions constrain the output themselves; a second constraint is a 400."""
    fmt = req.response_format
    if req.structured_outputs is not None or (fmt is not None and fmt.type != "text") or any(
            getattr(req, name, None) is not None for name in ("guided_json", "guided_regex", "guided_choice",
                                                              "guided_grammar")):
        raise bad_request("tool_choice 'required' or a named function constrains the output to tool calls; it "
                          "cannot be combined with response_format or structured_outputs", "tool_choice")


def check_tool_schemas(plan: ToolPlan) -> None:
    """A constraint built from the tools' parameter schemas compiles (xgrammar), else a 400 naming tools."""
    if plan.structured_outputs is None:
        return
    from ...engine.structured_output_manager import check_structured_outputs
    from ...structured_outputs import StructuredOutputsParams

    try:
        check_structured_outputs(StructuredOutputsParams(**plan.structured_outputs))
    except ValueError as e:
        raise bad_request(f"tools: a function's parameters are no JSON schema structured outputs can follow: {e}",
                          "tools") from None


def tool_calls_json(calls) -> list[dict[str, Any]]:
    """OpenAI's message.tool_calls of parsed calls (new ids)."""
    return [{"id": new_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls]


class ChoiceTools:
    """A request's ToolPlan applied to its choices' content: whole messages, or streamed deltas (one
    ToolCallStream per choice, fed the content streamed so far)."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.streams: dict[int, ToolCallStream] = {}
        self.content: dict[int, str] = {}

    @property
    def active(self) -> bool:
        return self.plan.parser is not None

    def message(self, fields: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """A whole message's fields with the calls read out of its content: (fields, whether it has calls)."""
        parsed = limit_calls(self.plan.parser.parse(fields.get("content") or "", True), self.plan.max_calls)
        if not parsed.calls:
            return fields, False
        return {**fields, "content": parsed.content or None, "tool_calls": tool_calls_json(parsed.calls)}, True

    def delta(self, index: int, delta: dict[str, Any], last: bool) -> dict[str, Any]:
        """A streamed delta with its content run through the choice's ToolCallStream."""
        stream = self.streams.get(index)
        if stream is None:
            stream = self.streams[index] = ToolCallStream(self.plan.parser, self.plan.max_calls)
        text = self.content.get(index, "") + delta.pop("content", "")
        self.content[index] = text
        return {**delta, **stream.delta(text, last)}

    def called(self, index: int) -> bool:
        stream = self.streams.get(index)
        return stream is not None and stream.called

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        """"tool_calls" for a choice that stopped with calls (not for a named function: "stop", as vLLM and
        OpenAI); a choice cut by max_tokens keeps "length"."""
        return "tool_calls" if called and reason == "stop" and not self.plan.named else reason
