"""InputProcessor: a request's every check before it is queued (tokenize, verify params, bad words)."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from ..config import EngineConfig
from ..reasoning import ReasoningTokens
from ..routing_replay import RouteShape
from ..sampling_params import SamplingParams
from .structured_output_manager import check_structured_outputs
from .tokenizer import encode_prompt, load_tokenizer, tokenize_bad_words


@dataclass
class PreparedRequest:
    """A request that passed every check: what `LLMEngine.add_request` needs, computed once."""

    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams  # normalised copy (trace rules, max_tokens resolved)
    bad_words_token_ids: list[list[int]]
    reasoning_tokens: ReasoningTokens | None = None  # with a thinking_token_budget: the span's start/end tokens
    cache_salt: str | None = None  # vLLM's: prefix-cache blocks shared only with requests of the same salt
    # EngineConfig.reasoning_parser: the reasoning end token a structured request's grammar waits for (None: the
    # grammar constrains from the first token: no parser, no such token, or the prompt closed the span already)
    grammar_waits_for: int | None = None
    # the ids that end it as EOS (finish_reason "stop", stop_reason None): the tokenizer's, then the checkpoint's
    # (InputProcessor.eos_token_ids); empty: the model config's alone
    eos_token_ids: tuple[int, ...] = ()


_PLAIN_INT = frozenset((int,))


def plain_ints(values) -> bool:
    """Every element's type is exactly int (no bools, no subclasses): one C-level pass (set(map(type, ...))), ~10 us
    for 512 ids against ~29 for a generator of isinstance checks, per request on the server's intake. True when
    empty."""
    return set(map(type, values)) <= _PLAIN_INT


def check_prompt_token_ids(ids, vocab_size: int) -> list[int]:
    """A token-id prompt: a non-empty list of ints in [0, vocab_size). Messages start with "prompt" (the
    server's error `param`)."""
    # The usual list of plain ints in one pass; the exact check (int subclasses yes, bools no) otherwise.
    if not isinstance(ids, (list, tuple)) or not (plain_ints(ids) or all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids)):
        raise ValueError(f"prompt token ids must be a list of integers, got {type(ids).__name__}")
    if not ids:
        raise ValueError("prompt must contain at least one token")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids must be in [0, {vocab_size}), got {bad[:8]}")
    return list(ids)


class InputProcessor:
    """The tokenizer and the checks of one model, no weights: the LLMEngine's front half, and all the API
    server process holds when the engine core runs in its own process (engine/core_client.py)."""

    def __init__(self, config: EngineConfig, with_tokenizer: bool = True):
        """with_tokenizer=False: none even if the config has one (the engine core process's warm-up: token ids in,
        no text out; its tokenizer loads after start-up, `load_tokenizer_into`)."""
        self.config = config
        self.model_config = config.model_config
        self.tokenizer = None if config.skip_tokenizer_init or not with_tokenizer else load_tokenizer(config)
        # thinking_token_budget's span: think_start_str / think_end_str, else <think> / </think> if the tokenizer
        # has them
        self.reasoning_tokens = ReasoningTokens.from_tokenizer(self.tokenizer, config.think_start_str,
                                                               config.think_end_str)
        self._token_text: dict[int, str] = {}
        self.eos_token_ids = engine_eos_ids(self.tokenizer, self.model_config)
        self.route_shape = RouteShape.of(self.model_config)  # trace_routed_experts' checks (None: dense)

    def tokenize(self, prompt: str, add_special_tokens: bool = True, max_model_len: int | None = None
                 ) -> list[int]:
        """A text's ids; with max_model_len, a prompt that cannot fit is a ValueError before they are listed."""
        if self.tokenizer is None:
            raise ValueError("text prompts need a tokenizer; this engine was built with skip_tokenizer_init=True")
        return encode_prompt(self.tokenizer, prompt, add_special_tokens, max_model_len)

    def decode_token(self, token: int) -> str | None:
        """One token's text (cached; None without a tokenizer)."""
        if self.tokenizer is None:
            return None
        text = self._token_text.get(token)
        if text is None:
            text = self._token_text[token] = self.tokenizer.decode([token])
        return text

    def process_prompt(self, prompt, add_special_tokens: bool = True, truncate: int | None = None
                       ) -> tuple[str | None, list[int]]:
        """str | {"prompt": str} | {"prompt_token_ids": [...]} -> (text or None, token ids). The one prompt check
        of `LLM.generate` and the server (which calls it before queueing); the length limits follow in
        SamplingParams.verify_for_engine. `truncate`: SamplingParams.truncate_prompt_tokens (the ids cut to
        their last k; the text, when given, stays the caller's)."""
        text, ids = self._prompt_ids(prompt, add_special_tokens, self.config.max_model_len if truncate is None
                                     else None)
        if truncate is not None:
            ids = ids[-self.truncation_size(truncate):]
        return text, ids

    def truncation_size(self, truncate: int) -> int:
        """truncate_prompt_tokens resolved: -1 is max_model_len - 1 (a prompt must leave one position to
        generate); a larger k than that is a ValueError."""
        limit = self.config.max_model_len - 1
        if truncate == -1:
            return limit
        if truncate > limit:
            raise ValueError(f"truncate_prompt_tokens={truncate} must be less than max_model_len "
                             f"({self.config.max_model_len}): a prompt leaves at least one position to generate "
                             f"(-1 keeps the last {limit} tokens)")
        return truncate

    def _prompt_ids(self, prompt, add_special_tokens: bool, limit: int | None) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenize(prompt, add_special_tokens, limit)
        if isinstance(prompt, dict):
            check_prompt_keys(prompt)
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), check_prompt_token_ids(prompt["prompt_token_ids"],
                                                                    self.model_config.prompt_vocab_size)
            if "prompt" in prompt and isinstance(prompt["prompt"], str):
                return prompt["prompt"], self.tokenize(prompt["prompt"], add_special_tokens, limit)
        raise ValueError(f"a prompt must be a string, {{'prompt': str}} or {{'prompt_token_ids': [...]}}, "
                         f"got {type(prompt).__name__}")

    def verify_params(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        return params.verify_for_engine(prompt_len=prompt_len, max_model_len=self.config.max_model_len,
                                        vocab_size=self.model_config.vocab_size,
                                        max_logprobs=self.config.max_logprobs,
                                        enable_trace_replay=self.config.enable_trace_replay,
                                        trace_replay_chunk_size=self.config.trace_replay_chunk_size,
                                        speculative=self.config.speculative_config is not None,
                                        batch_invariant=self.config.batch_invariant,
                                        route_shape=self.route_shape)

    def prepare_request(self, prompt, params: SamplingParams) -> PreparedRequest:
        """All validation of one request (tokenize, verify params, tokenize bad words). Raises ValueError."""
        truncate = params.truncate_prompt_tokens if isinstance(params, SamplingParams) else None
        text, ids = self.process_prompt(prompt, truncate=truncate)
        params = self.verify_params(params, len(ids))
        self._stop_on_other_eos(params)
        if self.model_config.input_vocab_size is not None:
            self._check_input_only_ids(ids, params)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer (they match the detokenized text); this engine was built "
                             "with skip_tokenizer_init=True: use stop_token_ids")
        bad_words = tokenize_bad_words(self.tokenizer, params.bad_words) if params.bad_words else []
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise ValueError("structured_outputs needs a tokenizer; this engine was built with "
                                 "skip_tokenizer_init=True")
            check_structured_outputs(params.structured_outputs)
        reasoning = None
        if params.thinking_token_budget is not None:
            if self.reasoning_tokens is None:
                raise ValueError("thinking_token_budget needs the model's reasoning start/end tokens, and this "
                                 "tokenizer has no single <think> / </think> tokens (or no tokenizer is loaded); "
                                 "name them with the engine options think_start_str and think_end_str "
                                 "(--think-start-str / --think-end-str)")
            reasoning = self.reasoning_tokens
        waits = None
        if params.structured_outputs is not None and self.config.reasoning_parser and self.reasoning_tokens:
            waits = None if self.reasoning_tokens.ended_in(ids) else self.reasoning_tokens.end_token_id
        elif params.structured_outputs is not None and params.thinking_token_budget is not None:
            raise ValueError("structured_outputs with a thinking_token_budget needs the engine's reasoning_parser "
                             "(--reasoning-parser): without it the grammar constrains the reasoning span too (and "
                             "rejects the forced end token)")
        return PreparedRequest(text, ids, params, bad_words, reasoning, cache_salt(prompt), waits, self.eos_token_ids)

    def _stop_on_other_eos(self, params: SamplingParams) -> None:
        """vLLM's update_from_generation_config: the model's EOS ids other than the tokenizer's (a
        generation_config.json list) join `params.stop_token_ids` (a verified copy), so a stop on one reports it
        as stop_reason; not with ignore_eos, nor with a trace (it ignores every stop)."""
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is None or params.ignore_eos or params.has_trace:
            return
        other = [t for t in self.model_config.eos_token_ids if t != eos and t not in params.stop_token_ids]
        if other:
            params.stop_token_ids = [*params.stop_token_ids, *other]

    def _check_input_only_ids(self, ids: list[int], params: SamplingParams) -> None:
        """A prompt holding ids the model can take but not score (past its logits' width: Apertus 1.5's image /
        audio codes): ValueError where a feature would score or draft them (prompt_logprobs, speculative decoding's
        n-gram drafts copied from the prompt)."""
        vocab = self.model_config.vocab_size
        outside = [t for t in ids if t >= vocab]
        if not outside:
            return
        what = "prompt_logprobs" if params.prompt_logprobs is not None else \
            "speculative decoding" if self.config.speculative_config is not None else None
        if what:
            raise ValueError(f"{what} cannot take a prompt with ids past the model's {vocab} output tokens (input-only "
                             f"ids such as image / audio codes): {outside[:8]}")

    def prepare_requests(self, prompts: list, params: list[SamplingParams]) -> list[PreparedRequest]:
        """`prepare_request` of each (prompt, params) pair, in order."""
        return [self.prepare_request(pr, p) for pr, p in zip(prompts, params)]


INLINE_MAX_IDS = 16384  # token ids one call may check on an event loop (a few hundred µs at most)


def checks_only(prompts: list, params: list[SamplingParams]) -> bool:
    """Preparing these is the id and params checks only (cheap enough for an event loop): token-id prompts of at
    most INLINE_MAX_IDS ids in all, no structured outputs (their check may compile a grammar), no bad words
    (tokenized)."""
    total = 0
    for prompt in prompts:
        ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
        if not isinstance(ids, list):
            return False
        total += len(ids)
    return total <= INLINE_MAX_IDS and all(p.structured_outputs is None and not p.bad_words for p in params)


def load_tokenizer_into(future: Future, config: EngineConfig) -> None:
    """Load the model's tokenizer on a daemon thread into `future` (its error too). The engine core process does
    this once it is ready: its grammars are the only users there (they wait for the future), and on a host
    without .pyc files the import of transformers costs ~10 s of the GIL that start-up's compiles and captures
    would share."""

    def run() -> None:
        try:
            future.set_result(load_tokenizer(config))
        except BaseException as e:  # noqa: BLE001 (the first grammar raises it)
            future.set_exception(e)

    threading.Thread(target=run, name="replayllm-tokenizer", daemon=True).start()


def engine_eos_ids(tokenizer, model_config) -> tuple[int, ...]:
    """The ids a request ends on as EOS: the tokenizer's eos_token_id (vLLM's EOS: a fine-tune whose config.json still
    names the base model's id stops on its tokenizer's), then config.json's and generation_config.json's
    (ModelConfig.eos_token_ids; vLLM adds generation_config's as stop ids). The model config's alone without a
    tokenizer, or where the tokenizer's is not a token the model can sample."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if not isinstance(eos, int) or not 0 <= eos < model_config.vocab_size:
        return model_config.eos_token_ids
    return tuple(dict.fromkeys((eos, *model_config.eos_token_ids)))


def load_in_background(config: EngineConfig, pool: ThreadPoolExecutor) -> tuple[Future, Future]:
    """Start building the InputProcessor on `pool`'s (single) thread: a tokenizer takes ~1-1.5 s to load for a
    150k vocabulary, which used to come before the model load and now overlaps it. Returns (the processor's
    future, its tokenizer's future): EngineCore takes the tokenizer's and waits for it only where it needs it,
    after the runner is built. A tokenizer that cannot load raises from either future."""
    inputs = pool.submit(InputProcessor, config)
    tokenizer = pool.submit(lambda: inputs.result().tokenizer)  # runs after it: one thread, first in first out
    return inputs, tokenizer


_PROMPT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")
_TEXT_ONLY = ("multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids", "prompt_embeds")


def check_prompt_keys(prompt: dict) -> None:
    """A prompt dict holds "prompt" and/or "prompt_token_ids", and optionally "cache_salt"; any other key (vLLM's
    multi_modal_data, prompt_embeds, ...) is a ValueError rather than silently dropped."""
    extra = [k for k in prompt if k not in _PROMPT_KEYS]
    if not extra:
        return
    if any(k in _TEXT_ONLY for k in extra):
        raise ValueError(f"prompt keys {extra}: this engine serves text only (a multimodal checkpoint serves its "
                         f"language model); give 'prompt' or 'prompt_token_ids'")
    raise ValueError(f"unknown prompt keys {extra}: a prompt dict takes {list(_PROMPT_KEYS)}")


def cache_salt(prompt) -> str | None:
    """A prompt dict's "cache_salt" (vLLM's): a non-empty string, else a ValueError; None when absent."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and not (isinstance(salt, str) and salt):
        raise ValueError(f"cache_salt must be a non-empty string, got {salt!r}")
    return salt
