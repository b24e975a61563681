"""POST /inference/v1/generate (vLLM >= 0.22's token-in/token-out route, RL rollouts): body and response models.

vLLM's GenerateRequest: `token_ids`, `sampling_params` (SamplingParams' fields), `model`, `stream`,
`stream_options`, `request_id`, `priority`; its response: `request_id`, `choices` [{index, token_ids, logprobs
(chat's format, tokens as "token_id:N"), finish_reason, routed_experts (base64 .npy)}], `prompt_logprobs`,
`kv_transfer_params` (always null: no disaggregated serving here).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from ...sampling_params import SamplingParams
from ..http.errors import bad_request
from .openai_protocol import StreamOptions, _token_id_keys
from .openai_responses import ChatLogprobs
from .protocol_fields import Ids, Int, _Body, _only, _ranged
from .sampling_fields import model_with_sampling_fields
from .structured_request import structured_outputs_from_body

# SamplingParams fields declared as on chat (max_tokens, logprobs and detokenize are declared below).
_SHARED = ("n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
           "repetition_penalty", "seed", "stop", "stop_token_ids", "bad_words", "ignore_eos", "min_tokens",
           "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
           "allowed_token_ids", "logit_bias", "prompt_logprobs", "trace_decode_token_ids", "trace_replay_chunk_size",
           "trace_routed_experts", "skip_reading_prefix_cache", "thinking_token_budget", "repetition_detection",
           "structured_outputs", "truncate_prompt_tokens")


class GenerateSamplingParams(model_with_sampling_fields("_GenerateSampling", _SHARED, "chat's fields")):
    """`sampling_params`: SamplingParams' fields by name (values checked by SamplingParams, 400s naming
    `sampling_params.<field>`); `output_kind` and the server's own fields are not the caller's."""

    max_tokens: Int | None = _ranged(minimum=1)  # absent or null: up to max_model_len (vLLM's server default)
    logprobs: Int | None = _ranged(minimum=-1)  # each token's logprob plus this many alternatives (-1: all)
    detokenize: bool | None = None  # false: no text is made (stop strings then need it)

    def to_sampling_params(self, defaults: dict | None = None) -> SamplingParams:
        """ValueError for bad values. defaults: the server's --generation-config, for fields not set here."""
        defaults = dict(defaults or {})
        max_tokens = self.max_tokens if "max_tokens" in self.model_fields_set else defaults.get("max_tokens")
        defaults.pop("max_tokens", None)
        kwargs: dict[str, Any] = {**defaults, **{name: getattr(self, name) for name in (*_SHARED, "detokenize")
                                                 if getattr(self, name) is not None}}
        if self.logit_bias is not None:
            kwargs["logit_bias"] = _token_id_keys(self.logit_bias)
        if self.repetition_detection is not None:
            kwargs["repetition_detection"] = self.repetition_detection.model_dump()
        kwargs["structured_outputs"] = structured_outputs_from_body(self.structured_outputs, None, None)
        return SamplingParams(max_tokens=max_tokens, logprobs=self.logprobs, **kwargs)


class GenerateRequest(_Body):
    model: str | None = None  # null: the served model
    request_id: str | None = None  # echoed in the response (null: a random one)
    token_ids: Ids = _ranged(..., items_minimum=0, minItems=1)  # the prompt
    sampling_params: GenerateSamplingParams
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    priority: Int | None = _only(0, None, default=0)  # first come, first served here

    def check(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        if self.priority:
            raise bad_request(f"priority scheduling is not enabled: requests are served first come, first served; "
                              f"send priority 0 or leave it out (got {self.priority})", "priority")


class GenerateChoice(BaseModel):
    index: int
    token_ids: list[int]
    logprobs: ChatLogprobs | None = None  # with sampling_params.logprobs
    finish_reason: str | None = None
    # --enable-return-routed-experts (MoE): [len(prompt) + len(token_ids) - 1, num_layers, top_k] int16 as a
    # base64 .npy (np.load(io.BytesIO(base64.b64decode(s)))), as vLLM sends it; dense layers' rows -1
    routed_experts: str | None = None


class GenerateResponse(BaseModel):
    request_id: str
    choices: list[GenerateChoice]
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None  # with sampling_params.prompt_logprobs
    kv_transfer_params: None = None
