"""LLM: the offline entry point, `LLM(model, **engine options).generate(prompts, params)`."""

from __future__ import annotations

import contextlib
import gc
import itertools
import weakref
from collections.abc import Callable, Sequence

from ..config import EngineConfig
from ..engine.llm_engine import LLMEngine
from ..model_source import resolve_model_path
from ..outputs import RequestOutput
from ..sampling_params import RequestOutputKind, SamplingParams
from .beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from .chat_template import check_chat_template_kwargs, messages_for_template, template_source
from .generation_config import default_sampling_params, log_defaults, override_fields
from .torch_profile import TorchProfile
from .vllm_options import take_vllm_options
from .worker_rpc import call_worker, load_extension, make_worker


class LLM:
    """`LLM(model=None, generation_config="auto", **options)`; options are EngineConfig's fields (vLLM names).
    An unknown option is a TypeError, a bad value a ValueError; vLLM-only options whose value changes nothing here
    (trust_remote_code, pipeline_parallel_size=1, ...) are taken (vllm_options.py). model=None selects the
    embedded default model.
    generation_config (vLLM's): where get_default_sampling_params() (what generate uses without params) comes
    from: 'auto' the model's generation_config.json, 'vllm' SamplingParams(), or a folder holding the file;
    override_generation_config (vLLM's): a dict of generation_config.json keys that win over it."""

    def __init__(self, model: str | None = None, generation_config: str = "auto",
                 override_generation_config: dict | None = None, **kwargs):
        # vLLM's worker_extension_cls: methods collective_rpc can call by name (entrypoints/worker_rpc.py)
        self._worker_extension = load_extension(kwargs.pop("worker_extension_cls", None))
        self._worker = None  # collective_rpc's worker, made on first use
        self._profile: TorchProfile | None = None  # start_profile / stop_profile
        # vLLM's override_generation_config: checked before the engine is built (an unknown key is a ValueError)
        overrides = None if override_generation_config is None else override_fields(override_generation_config)
        self.llm_engine = LLMEngine(EngineConfig(model=model, **take_vllm_options(model, kwargs)))
        # The LLM owns its engine: `del llm` (or the LLM going out of scope) shuts the engine down at once, so its
        # device memory comes back without waiting for the collector (the engine sits in reference cycles).
        self._finalizer = weakref.finalize(self, self.llm_engine.shutdown)
        self.model_config = self.llm_engine.model_config  # vLLM's LLM.model_config (max_model_len, hf_config, ...)
        self._ids = itertools.count()
        self._default_sampling = default_sampling_params(generation_config,
                                                         resolve_model_path(self.llm_engine.config.model), overrides)
        log_defaults(self._default_sampling, generation_config)

    def shutdown(self) -> None:
        """Release everything the engine holds (CUDA graphs and their pools, KV cache, weights, threads,
        tensor-parallel workers) and return the freed CUDA memory to the device (torch's cache emptied).
        Idempotent; `with LLM(...) as llm:` calls it on exit, and `del llm` does the same (the LLM owns its
        engine: keep the LLM, not only `llm.llm_engine`, while you use the engine). The LLM takes no request
        afterwards."""
        self._finalizer()

    def load_weights(self, weights) -> int:
        """Update the weights in place from an nn.Module, a state dict or (HF name, tensor) pairs (any dtype or
        device; a subset is fine): all checked, then all copied; see LLMEngine.load_weights. Returns the number of
        tensors applied."""
        return self.llm_engine.load_weights(weights)

    def apply_model(self, func):
        """vLLM's: `func(model)` on the engine's model (the `nn.Module` with HF-named parameters), returning
        `[result]` (vLLM's list has one entry per worker; here one process holds the model). For reading or for
        in-place changes (`param.data.copy_`, `mul_`: the CUDA graphs keep their addresses); the prefix cache is
        dropped afterwards (also when func raises), since its KV may come from the old weights. A ValueError while
        sleep() holds the weights, and with tensor_parallel_size > 1 (the other ranks' models live in worker
        processes: use load_weights, which reaches every rank)."""
        engine = self.llm_engine
        if engine.is_shut_down:
            raise RuntimeError("this LLM has been shut down (LLM.shutdown()); build a new one")
        if engine.config.tensor_parallel_size > 1:
            raise ValueError("apply_model reaches one process's model, and with tensor_parallel_size="
                             f"{engine.config.tensor_parallel_size} the other ranks' are in worker processes; "
                             "use load_weights to change weights on every rank")
        engine.check_weights_awake("apply_model")
        try:
            return [func(engine.runner.model)]
        finally:  # also when func raised: it may have changed weights first
            engine.reset_prefix_cache()

    def collective_rpc(self, method, timeout: float | None = None, args: tuple = (), kwargs: dict | None = None
                       ) -> list:
        """vLLM's: `method` (a worker method's name, e.g. one of worker_extension_cls's, or a callable taking the
        worker first) run on the engine's worker, returning [result] (entrypoints/worker_rpc.py: the worker's
        `model_runner.model`, refused while sleep() holds the weights, and `model_runner.load_weights`). The
        prefix cache is dropped afterwards, as after apply_model. `timeout` must be None: the call runs in this
        process and cannot be cut off. With tensor_parallel_size > 1, a ValueError (the other ranks are worker
        processes; load_weights reaches them)."""
        engine = self.llm_engine
        if engine.is_shut_down:
            raise RuntimeError("this LLM has been shut down (LLM.shutdown()); build a new one")
        if timeout is not None:
            raise ValueError("collective_rpc runs in this process: a timeout cannot stop it (pass timeout=None)")
        if engine.config.tensor_parallel_size > 1:
            raise ValueError("collective_rpc reaches one process's worker, and with tensor_parallel_size="
                             f"{engine.config.tensor_parallel_size} the other ranks are worker processes; "
                             "use load_weights to change weights on every rank")
        if self._worker is None:  # one worker for the LLM's life: an extension keeps its state between calls
            self._worker = make_worker(engine, self._worker_extension)
        try:
            return call_worker(self._worker, method, tuple(args), kwargs)
        finally:  # also when the method raised: it may have changed weights first
            engine.reset_prefix_cache()

    def start_profile(self) -> None:
        """vLLM's: start torch.profiler around the engine's work until stop_profile (entrypoints/torch_profile.py;
        needs REPLAYLLM_TORCH_PROFILER_DIR or VLLM_TORCH_PROFILER_DIR, else a RuntimeError)."""
        if self._profile is None:
            self._profile = TorchProfile(self.llm_engine.config.torch_device)
        self._profile.start()

    def stop_profile(self) -> str:
        """vLLM's: stop the profile and write its Chrome trace; returns the file's path."""
        if self._profile is None:
            raise RuntimeError("no profile is running: call start_profile() first")
        return self._profile.stop()

    def reset_prefix_cache(self) -> bool:
        """vLLM's: drop the prefix cache (the KV of prompt blocks seen before), so later prompts are computed
        afresh. load_weights, sleep and wake_up drop it themselves; RL scripts written for vLLM call this after a
        weight sync. True once dropped (between generate calls the engine is always idle)."""
        if self.llm_engine.is_shut_down:
            raise RuntimeError("this engine has been shut down; build a new one")
        return self.llm_engine.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode (needs enable_sleep_mode=True): give the KV cache's and the weights' GPU memory back,
        e.g. to a trainer on the same GPU. level 1 keeps the weights in pinned host memory; level 2 discards them
        (wake_up(tags=["weights"]), then load_weights). Until wake_up, generate is an error. See docs/rl.md."""
        self.llm_engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take the memory back at the same addresses (CUDA graphs stay valid): tags "weights" and/or
        "kv_cache" (None: both)."""
        self.llm_engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.llm_engine.is_sleeping()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: SamplingParams with the generation config's defaults (see generation_config)."""
        return SamplingParams(**self._default_sampling)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | Callable = True, lora_request=None,
                 priority: list[int] | None = None) -> list[RequestOutput]:
        """prompts: a str, a {"prompt_token_ids": [...]} dict, or a list of those. One params object for all
        prompts or one per prompt. Returns final outputs in prompt order. use_tqdm: a bool, or a tqdm-like class
        (as vLLM's). lora_request and priority are vLLM's: only None (and all-zero priorities) are accepted, as
        this engine has no LoRA and schedules first-come first-served."""
        if lora_request is not None:
            raise ValueError("lora_request: LoRA adapters are not supported by replayllm")
        if priority is not None and any(priority):
            raise ValueError("priority: this engine schedules first-come first-served (no priority policy); "
                             "give None or all zeros")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"the lengths of prompts ({len(prompts)}) and priority ({len(priority)}) must be the same")
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        return self._run(prompts, params, use_tqdm)

    def beam_search(self, prompts, params: BeamSearchParams, use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's offline beam search (entrypoints/beam_search.py): per prompt, the beam_width best sequences after
        max_tokens steps, each step scoring the top 2 * beam_width tokens of every live beam (needs
        max_logprobs >= 2 * beam_width). prompts: as generate's."""
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        mc, config = self.llm_engine.model_config, self.llm_engine.config
        search = BeamSearch(prompts, params, self.llm_engine.eos_token_ids, mc.vocab_size, config.max_logprobs)
        while inputs := search.next_inputs():
            search.advance(self.generate(inputs, search.step_params, use_tqdm=use_tqdm and search.step == 0))
        tokenizer = self.get_tokenizer()
        return search.results(None if tokenizer is None else tokenizer.decode)

    def chat(self, messages, sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, chat_template: str | None = None,
             continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
             tools: list[dict] | None = None, lora_request=None, chat_template_content_format: str = "auto",
             mm_processor_kwargs: dict | None = None) -> list[RequestOutput]:
        """messages: one conversation (list of {"role", "content"}) or a list of conversations.
        continue_final_message: the last (assistant) message is left open and continued; needs
        add_generation_prompt=False. chat_template_kwargs: extra template variables (e.g. enable_thinking).
        tools: OpenAI tool definitions, rendered by the template (as vLLM's `tools`). Each output's `prompt` is
        the rendered conversation; its ids are that text tokenized without added special tokens (the template
        writes them), as the server's chat route does. chat_template_content_format (vLLM's): "string" (text parts
        joined), "openai" (a list of parts) or "auto" (what the template reads). lora_request and
        mm_processor_kwargs: only None (no LoRA; text only)."""
        if lora_request is not None:
            raise ValueError("lora_request: LoRA adapters are not supported by replayllm")
        if mm_processor_kwargs is not None:
            raise ValueError("mm_processor_kwargs: this engine serves text only (no multimodal processor)")
        tok = self.get_tokenizer()
        if tok is None:
            raise ValueError("chat needs a tokenizer; this LLM was built with skip_tokenizer_init=True")
        if add_generation_prompt and continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be true")
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise ValueError(f"chat_template_kwargs must be a dict, got {type(chat_template_kwargs).__name__}")
        kwargs = dict(chat_template_kwargs or {})
        documents = kwargs.pop("documents", None)  # RAG templates' (vLLM passes it on; chat has no field for it)
        extra = check_chat_template_kwargs(tok, kwargs, chat_template)
        if documents is not None:
            extra["documents"] = documents
        if tools is not None:
            if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
                raise ValueError("tools must be a list of tool definitions (dicts)")
            extra["tools"] = tools
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts, source = [], template_source(tok, chat_template)
        for conv in convs:
            conv = messages_for_template(conv, source, chat_template_content_format)
            try:
                text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=add_generation_prompt,
                                               continue_final_message=continue_final_message,
                                               chat_template=chat_template, **extra)
            except Exception as e:  # a template that rejects these messages (role order, ...)
                raise ValueError(f"messages could not be rendered with the chat template: {e}") from e
            ids = self.llm_engine.input_processor.tokenize(text, False, None)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, prompts: list, params: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        if self.llm_engine.is_shut_down:
            raise RuntimeError("this LLM has been shut down (LLM.shutdown()); build a new one")
        with _frozen_heap():
            return self._run_unfrozen(prompts, params, use_tqdm)

    def _run_unfrozen(self, prompts: list, params: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        # Validate everything first, so a bad prompt rejects the call without queueing the good ones.
        prepared = [engine.prepare_request(prompt, p) for prompt, p in zip(prompts, params)]
        order = []
        for prep in prepared:
            # Only final outputs are returned, so the engine builds no per-step snapshots (as vLLM's LLM does).
            # prep.params is prepare_request's private copy (verify_for_engine): the caller's object is untouched.
            prep.params.output_kind = RequestOutputKind.FINAL_ONLY
            rid = str(next(self._ids))
            engine.add_request(rid, None, prepared=prep)
            order.append(rid)
        finals: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            tqdm = use_tqdm if callable(use_tqdm) else None
            if tqdm is None:
                from tqdm.auto import tqdm

            bar = tqdm(total=len(order), desc="Processed prompts", dynamic_ncols=True)
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        finals[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
                for _, error in engine.take_rejected():  # e.g. a grammar that did not compile
                    raise error
        except BaseException:
            for rid in order:  # leave no request (and no KV block) behind
                engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [finals[rid] for rid in order]


@contextlib.contextmanager
def _frozen_heap():
    """For one generate call, move every object alive before it (torch, transformers, the model, the engine:
    ~0.4M) into the collector's permanent generation, so the full collections that the run's many small objects
    (token lists, Logprob dicts) trigger do not walk them again and again (measured: two full collections cost
    0.2 s of a 1.2 s CPU run of 256 x 64 replayed tokens); they go back to the oldest generation afterwards,
    so nothing is kept alive. Skipped when something else froze the heap already (e.g. a server process)."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()

