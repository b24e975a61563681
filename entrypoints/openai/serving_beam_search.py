"""`use_beam_search: true` on /v1/completions and /v1/chat/completions: vLLM's beam search (entrypoints/
beam_search.py's BeamSearch) over the engine client. Each step queues every live beam as a one-token request (the
prefix cache serves the beams' earlier blocks), waits for them all, and ranks the extensions; the response has
`n` choices per prompt, its n best beams, best first (`n` is the beam width, as in vLLM).

Beam search uses n, max_tokens (max_completion_tokens), temperature, ignore_eos, length_penalty, the logprobs
fields and include_stop_str_in_output; a request that sets another sampling option (stop strings, top_p,
penalties, a trace, structured outputs, tools, ...) or asks for streaming or echo is a 400 naming it: beam search
would not do what it says."""

from __future__ import annotations

from collections.abc import Callable

from ...outputs import CompletionOutput, Logprob, RequestOutput
from ..beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from ..http.errors import APIError, bad_request
from .serving_base import ServingBase
from .streaming import final_outputs

# Fields beam search does not use (of either route): any of them set to other than its default is refused.
UNUSED = ("stream", "stream_options", "echo", "stop", "stop_token_ids", "bad_words", "top_p", "top_k", "min_p",
          "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "min_tokens", "logit_bias",
          "allowed_token_ids", "prompt_logprobs", "skip_special_tokens", "spaces_between_special_tokens",
          "trace_decode_token_ids", "trace_replay_chunk_size", "trace_routed_experts", "thinking_token_budget",
          "repetition_detection", "response_format", "structured_outputs", "guided_json", "guided_regex",
          "guided_choice", "guided_grammar", "skip_reading_prefix_cache", "return_tokens_as_token_ids", "tools",
          "tool_choice", "parallel_tool_calls")


def check_beam_request(req) -> None:
    fields = type(req).model_fields
    for name in UNUSED:
        if name not in fields or name not in req.model_fields_set:
            continue
        value = getattr(req, name)
        if value is not None and value != fields[name].default:
            raise bad_request(f"{name} is not supported with use_beam_search (beam search uses n, max_tokens, "
                              "temperature, ignore_eos, length_penalty and logprobs)", name, "not_implemented")


def _params(req, max_tokens: int | None, prompt_lens: list[int], max_model_len: int,
            prompt_field: str) -> BeamSearchParams:
    """The request's beam search: n beams, max_tokens steps (None: as many as the longest prompt leaves)."""
    room = max_model_len - max(prompt_lens)
    if room < 1:
        raise bad_request(f"the prompt has {max(prompt_lens)} tokens: max_model_len={max_model_len} leaves no "
                          "position to generate", prompt_field)
    steps = room if max_tokens is None else max_tokens
    if steps > room:
        raise bad_request(f"max_tokens={steps} does not fit: the longest prompt ({max(prompt_lens)} tokens) "
                          f"leaves {room} of max_model_len={max_model_len}", "max_tokens")
    try:
        return BeamSearchParams(beam_width=req.n or 1, max_tokens=steps, ignore_eos=bool(req.ignore_eos),
                                temperature=0.0 if req.temperature is None else req.temperature,
                                length_penalty=1.0 if req.length_penalty is None else req.length_penalty,
                                include_stop_str_in_output=bool(req.include_stop_str_in_output))
    except ValueError as e:
        field = next(f for f in ("beam_width", "max_tokens", "length_penalty", "temperature") if f in str(e))
        raise bad_request(str(e).replace("beam_width", "n"), "n" if field == "beam_width" else field) from None


async def run_beam_search(server: ServingBase, req, prompt_ids: list[list[int]], max_tokens: int | None,
                          logprobs: int | None, receive, to_error: Callable[[BaseException], APIError],
                          prompt_field: str) -> tuple[list[BeamSearchOutput], int]:
    """The search for `prompt_ids` (tokenized, checked): (per prompt its beams, the beam width). `logprobs`: how
    many each choice shows (the steps read at least that many); `to_error`: the route's error mapping;
    `prompt_field`: what a 400 about the prompt's length names ("prompt", "messages"). A request that sets
    neither max_tokens nor max_completion_tokens searches --generation-config's length (as its sampling would)."""
    if "max_tokens" in server.default_sampling and not {"max_tokens", "max_completion_tokens"} & req.model_fields_set:
        max_tokens = server.default_sampling["max_tokens"]
    mc, eos, max_logprobs, max_model_len = await server.engine.run_tokenizer(
        lambda e: (e.model_config, e.eos_token_ids, e.config.max_logprobs, e.config.max_model_len), size=0)
    params = _params(req, max_tokens, [len(x) for x in prompt_ids], max_model_len, prompt_field)
    try:
        search = BeamSearch([{"prompt_token_ids": x} for x in prompt_ids], params, eos, mc.vocab_size,
                            max_logprobs, logprobs or 0)
    except ValueError as e:
        raise bad_request(str(e).replace("beam_width", "n"), "n") from None
    while inputs := search.next_inputs():
        try:
            _, stream = await server.queue("beam", inputs, search.step_params,
                                           [len(x["prompt_token_ids"]) for x in inputs], False)
        except Exception as e:
            raise to_error(e) from e
        finals = await final_outputs(stream, receive, to_error)
        search.advance([finals[i] for i in range(len(inputs))])
    results = await server.engine.run_tokenizer(
        lambda e: search.results(None if e.tokenizer is None else e.tokenizer.decode), size=0)
    return results, params.beam_width


def finals_of(results: list[BeamSearchOutput], prompt_ids: list[list[int]], logprobs: int | None,
              request_id: str) -> dict[int, RequestOutput]:
    """Each prompt's beams as a finished RequestOutput (one CompletionOutput a beam, best first), which the routes'
    renderers turn into choices. Each token's logprob dict keeps the chosen token and the `logprobs` best (the
    search read more)."""
    finals = {}
    for i, (result, ids) in enumerate(zip(results, prompt_ids)):
        outputs = [_completion(j, beam, len(ids), logprobs) for j, beam in enumerate(result.sequences)]
        finals[i] = RequestOutput(f"{request_id}-{i}", None, ids, None, outputs, True)
    return finals


def _completion(index: int, beam: BeamSearchSequence, prompt_len: int, logprobs: int | None) -> CompletionOutput:
    tokens = beam.tokens[prompt_len:]
    entries = None if logprobs is None else [_top(d, t, logprobs) for d, t in zip(beam.logprobs, tokens)]
    return CompletionOutput(index=index, text=beam.text or "", token_ids=tokens, cumulative_logprob=beam.cum_logprob,
                            logprobs=entries, finish_reason=beam.finish_reason)


def _top(entry: dict[int, Logprob], token: int, k: int) -> dict[int, Logprob]:
    """The chosen token and the k best (k -1: all the search read, the whole vocabulary)."""
    return {t: lp for t, lp in entry.items() if t == token or k == -1 or (lp.rank is not None and lp.rank <= k)}
