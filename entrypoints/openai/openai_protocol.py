"""Request bodies: OpenAI's (completions, chat) with vLLM's extras and `trace_decode_token_ids` (vLLM's
(de)tokenize bodies: tokenize_protocol.py).

Validation policy:
- Types are strict: `"max_tokens": "5"`, `true` for an int, or `1.5` for a token id is a 400, not coerced.
  Numbers may be ints where floats are expected, and integers may carry a zero fraction (`5.0`: JSON Schema's
  `integer`, what /openapi.json says, and vLLM's lax parsing take it). `null` means "the default" for every
  optional field.
- Values (ranges, combinations, trace rules) are checked once, by SamplingParams and the engine, whose
  ValueErrors become 400s naming the parameter.
- Unknown top-level fields of a request body (what newer OpenAI SDKs and vLLM clients send: `service_tier`,
  `prompt_cache_key`, `verbosity`, ...) are accepted and ignored, as vLLM does, but never silently: each is
  logged (rate-limited) and named in the response's `x-replayllm-ignored-fields` header (request_fields.py).
  `replayllm serve --strict-request-fields` rejects them instead (400 "Unrecognized request argument
  supplied: ...", as OpenAI's API does). Unknown keys of nested objects (messages, stream_options, ...) the same,
  named by their path (`messages.1.cache_control`). Known
  fields replayllm cannot honour (suffix, best_of != n, ...) are 400s in both modes; the few that cannot
  change the output (`user`, `metadata`, `store`) are accepted and ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, WrapValidator

from ...sampling_params import SamplingParams, clamp_logit_bias
from ..chat_template import tool_calls_for_template
from ..http.errors import APIError, bad_request
from .chat_messages import ChatMessage, ChatTool, NamedToolChoice
from .guided_decoding import GUIDED_FIELDS, check_guided, guided_structured_outputs, renamed
from .input_check import Metadata, User, check_unicode, integral_floats
from .protocol_fields import Ids, Int, _Body, _nonempty, _only, _ranged, _Strict
from .structured_request import structured_outputs_from_body

# Fields passed to SamplingParams under the same name when not null.
_SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "seed", "stop", "stop_token_ids", "bad_words", "ignore_eos",
                    "min_tokens", "include_stop_str_in_output", "skip_special_tokens",
                    "spaces_between_special_tokens", "allowed_token_ids", "trace_decode_token_ids",
                    "trace_replay_chunk_size", "thinking_token_budget", "skip_reading_prefix_cache",
                    "trace_routed_experts", "truncate_prompt_tokens")

# What a field accepts, for readable errors when a union type fails in several ways at once.
FIELD_HINTS = {
    "prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "a string or a list of strings",
    "content": "a string or a list of {'type': 'text', 'text': ...} parts",
    "tool_choice": "'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
}


def _routes_schema(s: dict) -> None:
    """trace_routed_experts' schema: non-empty lists down to ids >= -1 (rectangular and in range: SamplingParams)."""
    for branch in s.get("anyOf", [s]):
        node = branch
        while node.get("type") == "array":
            node["minItems"] = 1
            node = node["items"]
        if node.get("type") == "integer":
            node["minimum"] = -1


# structured_outputs' shape (StructuredOutputsParams; null = unset). Not stated here: exactly one constraint is
# set, and it compiles (a regex, grammar or JSON schema xgrammar accepts).
_STRUCTURED_SCHEMA = {"anyOf": [{"type": "null"}, {
    "type": "object", "additionalProperties": False, "minProperties": 1, "properties": {
        "json": {"type": ["object", "string", "null"]}, "regex": {"type": ["string", "null"], "minLength": 1},
        "choice": {"type": ["array", "null"], "minItems": 1, "items": {"type": "string", "minLength": 1}},
        "grammar": {"type": ["string", "null"], "minLength": 1}, "json_object": {"enum": [True, None]},
        "disable_any_whitespace": {"type": "boolean"}}}]}
class StreamOptions(_Strict):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM: usage in every chunk


class RepetitionDetection(_Strict):
    """vLLM's `repetition_detection` body object (SamplingParams' RepetitionDetectionParams; values checked there)."""

    max_pattern_size: Int = _ranged(0, minimum=0)
    min_pattern_size: Int = _ranged(0, minimum=0)
    min_count: Int = _ranged(0, minimum=0)


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class _SamplingRequest(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None  # null: the served model (vLLM allows omitting it)
    n: Annotated[int, Field(le=128), WrapValidator(integral_floats)] | None = _ranged(minimum=1)  # OpenAI's limit
    temperature: float | None = _ranged(minimum=0)
    top_p: float | None = _ranged(exclusiveMinimum=0, maximum=1)
    stop: str | list[str] | None = Field(None, json_schema_extra=_nonempty(lists=False))
    presence_penalty: float | None = _ranged(minimum=-2, maximum=2)
    frequency_penalty: float | None = _ranged(minimum=-2, maximum=2)
    seed: Int | None = _ranged(minimum=-(2**63), maximum=2**64 - 1)
    logit_bias: dict[str, float] | None = _ranged(propertyNames={"pattern": "^[0-9]{1,20}$"})  # token ids
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: User | None = None  # accepted, ignored (cannot change the output); <= 256 characters
    metadata: Metadata | None = None  # accepted, ignored; <= 16 pairs, keys <= 64 characters, values <= 512
    store: bool | None = None  # accepted, ignored
    # vLLM extras
    top_k: Int | None = _ranged(minimum=-1)  # -1 and 0: off
    min_p: float | None = _ranged(minimum=0, maximum=1)
    repetition_penalty: float | None = _ranged(exclusiveMinimum=0)
    ignore_eos: bool | None = None
    stop_token_ids: Ids | None = _ranged(items_minimum=0)
    min_tokens: Int | None = _ranged(minimum=0)
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    bad_words: list[str] | None = Field(None, json_schema_extra=_nonempty(lists=False))
    allowed_token_ids: Ids | None = _ranged(items_minimum=0, minItems=1)  # only these tokens may be generated
    prompt_logprobs: Int | None = _ranged(minimum=-1)  # -1: the whole vocabulary (vLLM's)
    return_token_ids: bool | None = False  # each choice gets prompt_token_ids and token_ids
    return_tokens_as_token_ids: bool | None = False  # logprob tokens rendered as "token_id:N"
    # vLLM's: prefix-cache blocks shared only with requests of the same salt (a tenant's prompts unreadable by timing)
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    # vLLM's: the base of the response's id ("chatcmpl-{request_id}"); the X-Request-Id header wins (api_server)
    request_id: str | None = Field(None, max_length=256, pattern=r"^[!-~]+$")  # printable ASCII, no spaces
    # vLLM's priority scheduling: not enabled here, so only 0 (first come, first served)
    priority: Int | None = _only(0, None, default=0)
    # vLLM's beam search (serving_beam_search.py): n beams, ranked by cum_logprob / length ** length_penalty
    use_beam_search: bool | None = False
    length_penalty: float | None = None  # only with use_beam_search (1.0 when not given)
    # replayllm: force these decoded tokens and report their logprobs (needs --enable-trace-replay)
    trace_decode_token_ids: Ids | None = _ranged(items_minimum=0, minItems=1)
    # replayllm: trace tokens per step (fast replay); only with a trace
    trace_replay_chunk_size: Int | None = _ranged(minimum=1)
    # replayllm (routing replay, MoE models): the experts of positions 0 .. P-1, [P][num_layers][top_k] as a
    # choice's routed_experts (dense layers' rows -1); shape and ids are checked by SamplingParams and the engine
    trace_routed_experts: Annotated[list[list[list[int]]], WrapValidator(integral_floats)] | None = Field(
        None, json_schema_extra=_routes_schema)
    # vLLM's SamplingParams field: compute the whole prompt, reuse no cached KV (null: the engine's rule, true with
    # prompt_logprobs and with a trace outside batch-invariant mode)
    skip_reading_prefix_cache: bool | None = None
    # vLLM's: keep the prompt's last k tokens (k < max_model_len); -1: the most a prompt may have (max_model_len - 1)
    truncate_prompt_tokens: Int | None = _ranged(minimum=-1)
    # vLLM: at most N tokens inside <think>..</think>, then </think> forced; -1: unlimited
    thinking_token_budget: Int | None = _ranged(minimum=-1)
    repetition_detection: RepetitionDetection | None = None  # vLLM: stop when the output ends in a repeated pattern
    # Structured outputs: OpenAI's response_format (json_object / json_schema) or vLLM's structured_outputs
    # ({"json" | "regex" | "choice" | "grammar" | "json_object": ..., "disable_any_whitespace": bool}).
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = Field(None, json_schema_extra=lambda s: s.update(_STRUCTURED_SCHEMA))
    # vLLM's older spellings of one structured_outputs constraint (guided_decoding.py); not with structured_outputs
    # or a response_format constraint
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = Field(None, min_length=1)
    guided_choice: list[Annotated[str, Field(min_length=1)]] | None = Field(None, min_length=1)
    guided_grammar: str | None = Field(None, min_length=1)

    def check_common(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        if self.length_penalty not in (None, 1.0) and not self.use_beam_search:  # 1.0: vLLM's default, harmless
            raise bad_request("length_penalty is only used by beam search (use_beam_search=true)", "length_penalty")
        if self.priority:
            raise bad_request(f"priority scheduling is not enabled: requests are served first come, first served; "
                              f"send priority 0 or leave it out (got {self.priority})", "priority")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage on every chunk: vLLM's continuous_usage_stats, which counts only with include_usage."""
        return bool(self.stream_options and self.stream_options.continuous_usage_stats
                    and self.stream_options.include_usage)

    def to_sampling_params(self, *, max_tokens: int | None, logprobs: int | None,
                           prompt_logprobs: int | None, defaults: dict | None = None) -> SamplingParams:
        """ValueError / NotImplementedError for bad values (the caller turns them into 400s). defaults: the
        server's --generation-config sampling defaults, for the fields this request does not set."""
        defaults = dict(defaults or {})
        if "max_tokens" in defaults and not {"max_tokens", "max_completion_tokens"} & self.model_fields_set:
            max_tokens = defaults["max_tokens"]
        defaults.pop("max_tokens", None)
        kwargs: dict[str, Any] = {**defaults, **{name: getattr(self, name) for name in _SAMPLING_FIELDS
                                                 if getattr(self, name) is not None}}
        if self.logit_bias is not None:
            kwargs["logit_bias"] = _token_id_keys(self.logit_bias)
        if self.repetition_detection is not None:
            kwargs["repetition_detection"] = self.repetition_detection.model_dump()
        fmt = self.response_format
        guided = guided_structured_outputs({name: getattr(self, name) for name in GUIDED_FIELDS},
                                           self.structured_outputs, fmt.type if fmt else None)
        try:
            kwargs["structured_outputs"] = structured_outputs_from_body(
                guided[1] if guided else self.structured_outputs, fmt.type if fmt else None,
                fmt.json_schema if fmt else None)
            if guided:
                check_guided(kwargs["structured_outputs"], guided[0])
        except APIError as e:
            raise (renamed(e, guided[0]) if guided else e) from None
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                              **kwargs)


def _token_id_keys(logit_bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's logit_bias is a JSON object keyed by token ids as strings ("50256": -100): the keys parsed, the
    biases clamped to OpenAI's [-100, 100] (as vLLM's OpenAI path); SamplingParams checks the ids."""
    bad = [k for k in logit_bias if not (k.isascii() and k.isdigit() and len(k) <= 20)]
    if bad:
        raise ValueError(f"logit_bias keys must be token ids written as decimal integers, got {bad[:8]!r}")
    ids = clamp_logit_bias({int(k): bias for k, bias in logit_bias.items()})
    if len(ids) < len(logit_bias):
        raise ValueError("logit_bias names the same token id twice (e.g. '7' and '07')")
    return ids


class CompletionRequest(_SamplingRequest):
    # list[int] before list[str]: the union stops at the first member that matches exactly, and a token-id prompt
    # tried as list[str] first cost one error object per id (a 512-id request: 46 -> 10 us of validation)
    prompt: Annotated[str | list[int] | list[str] | list[list[int]],
                      WrapValidator(integral_floats)] = Field(json_schema_extra=_nonempty(lists=True))
    # OpenAI's default; null: up to max_model_len; 0 only with echo (the prompt scored, nothing generated)
    max_tokens: Int | None = _ranged(16, minimum=0)
    logprobs: Int | None = _ranged(minimum=-1)  # -1: the whole vocabulary (vLLM's)
    echo: bool | None = False
    best_of: Int | None = _ranged(minimum=1, maximum=128)  # only == n (checked below)
    suffix: str | None = _only(None)
    add_special_tokens: bool | None = True

    def check(self) -> None:
        self.check_common()
        if self.suffix is not None:
            raise bad_request("suffix is not supported by replayllm", "suffix", "not_implemented")
        if self.max_tokens == 0 and not self.echo:
            raise bad_request("max_tokens must be at least 1, or 0 with echo=true (the prompt echoed and scored, "
                              "nothing generated)", "max_tokens")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise bad_request("best_of is not supported (only best_of == n)", "best_of", "not_implemented")

    def prompts(self) -> list[str] | list[list[int]]:
        """The prompt as a list: strings, or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise bad_request("prompt must not be empty", "prompt")
        if isinstance(p[0], int):
            return [p]
        return list(p)


class _ChatPrompt(_Body):
    """Messages and the chat-template options: what /v1/chat/completions and chat-style /tokenize share."""

    messages: list[ChatMessage] = Field(min_length=1)
    # vLLM extras
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    add_special_tokens: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None  # extra chat-template variables (e.g. enable_thinking)
    # vLLM's per-request template: refused (as vLLM does without --trust-request-chat-template: a caller's Jinja
    # would run on the server); the server's own is --chat-template
    chat_template: str | None = _only(None)
    tools: list[ChatTool] | None = None  # rendered by the chat template; chat completions also read calls back

    def template_kwargs(self) -> dict[str, Any] | None:
        """The extra chat-template variables this request sets."""
        return self.chat_template_kwargs

    def template_kwarg_fields(self, keys: list[str]) -> list[str]:
        """Where template variables came from in the body: "chat_template_kwargs.KEY"."""
        return [f"chat_template_kwargs.{k}" for k in keys]

    def check_chat_prompt(self) -> None:
        if self.chat_template is not None:
            raise bad_request("a per-request chat_template is not supported: start the server with --chat-template",
                              "chat_template", "not_implemented")
        if self.add_generation_prompt and self.continue_final_message:
            raise bad_request("add_generation_prompt and continue_final_message cannot both be true",
                              "continue_final_message")
        for i, m in enumerate(self.messages):
            if m.tool_calls and m.role != "assistant":
                raise bad_request(f"messages[{i}].tool_calls: only assistant messages make tool calls",
                                  f"messages.{i}.tool_calls")
            for name in ("function_call", "refusal", "audio", "annotations"):
                if getattr(m, name):
                    raise bad_request(f"messages[{i}].{name} is not supported by replayllm",
                                      f"messages.{i}.{name}", "not_implemented")

    def conversation(self) -> list[dict[str, str]]:
        """The messages as the chat template expects them: role and plain-text content."""
        conv = []
        for m in self.messages:
            msg = {"role": m.role, "content": m.text()}
            if m.name is not None:
                msg["name"] = m.name
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
            if reasoning is not None:
                msg["reasoning_content"] = msg["reasoning"] = reasoning
            if m.tool_calls:  # arguments parsed into objects, as templates render them (as vLLM)
                try:
                    msg["tool_calls"] = tool_calls_for_template([c.model_dump() for c in m.tool_calls],
                                                                f"messages.{len(conv)}.tool_calls")
                except ValueError as e:
                    raise bad_request(str(e), str(e).split(" ", 1)[0]) from None
            conv.append(msg)
        return conv


class ChatCompletionRequest(_SamplingRequest, _ChatPrompt):
    max_tokens: Int | None = _ranged(minimum=1)  # deprecated OpenAI name
    max_completion_tokens: Int | None = _ranged(minimum=1)  # null (both): up to max_model_len
    logprobs: bool | None = False
    top_logprobs: Int | None = _ranged(minimum=-1)  # -1: the whole vocabulary (vLLM's)
    # null: "auto" with tools, else "none" (as vLLM); what each means: tool_calling.py
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call (the first), as vLLM
    # OpenAI's (o-series, gpt-oss): passed to the chat template as the `reasoning_effort` variable, as vLLM does;
    # a template that does not read it drops it (named in x-replayllm-ignored-fields; a 400 when strict)
    reasoning_effort: str | None = None
    # vLLM's: the answer starts with the last message's content when that message is the assistant's (continuing
    # it: continue_final_message); otherwise nothing is echoed
    echo: bool | None = False

    def echoed(self) -> str | None:
        """What `echo` puts before each choice's content (None: nothing)."""
        if self.echo and self.messages and self.messages[-1].role == "assistant":
            return self.messages[-1].text()
        return None

    def new_tokens(self) -> int | None:
        """The most tokens to generate: max_completion_tokens, else the deprecated max_tokens (None: the context);
        with both, max_completion_tokens wins (as vLLM)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def shown_logprobs(self) -> int | None:
        """Alternatives per token each choice shows (top_logprobs) when logprobs is on; None when off."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_kwargs(self) -> dict[str, Any] | None:
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        return {**(self.chat_template_kwargs or {}), "reasoning_effort": self.reasoning_effort}

    def template_kwarg_fields(self, keys: list[str]) -> list[str]:
        return ["reasoning_effort" if k == "reasoning_effort" and self.reasoning_effort is not None
                else f"chat_template_kwargs.{k}" for k in keys]

    def check(self) -> None:
        self.check_common()
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        self.check_chat_prompt()


def served_names(served: str | tuple[str, ...]) -> tuple[str, ...]:
    """`--served-model-name`: one name, or several (the first is the one responses report)."""
    return (served,) if isinstance(served, str) else tuple(served)


def check_model(requested: str | None, served: str | tuple[str, ...]) -> None:
    check_unicode(requested, "model")  # a lone surrogate is a malformed name (400), not an unknown one (404)
    names = served_names(served)
    if requested is not None and requested not in names:
        raise APIError(404, f"The model `{requested}` does not exist (this server serves "
                            f"{', '.join(f'`{n}`' for n in names)})", param="model", code="model_not_found")
