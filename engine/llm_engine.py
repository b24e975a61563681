"""LLMEngine: the front end (input checks, output processing) around an EngineCore; add, step, abort."""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

from ..config import EngineConfig
from ..kernels import compile_workers, jit_watch
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from .engine_core import EngineCore
from .input_processor import (  # noqa: F401 (InputProcessor, PreparedRequest, check_prompt_token_ids: re-exported)
    InputProcessor,
    PreparedRequest,
    check_prompt_token_ids,
    load_in_background,
)
from .output_processor import OutputProcessor
from .served_model_config import ServedModelConfig
from .warm_up import warm_up


def _core_attr(name: str, doc: str) -> property:
    """An attribute of the engine core, read and written through the LLMEngine (tests, tools, warm-up)."""
    return property(lambda self: getattr(self.core, name), lambda self, value: setattr(self.core, name, value),
                    doc=doc)


def _inputs_attr(name: str, doc: str) -> property:
    """A read-only attribute of the input processor."""
    return property(lambda self: getattr(self.input_processor, name), doc=doc)


class LLMEngine:
    """The front end (InputProcessor: every check of a request; OutputProcessor: text, stop strings, logprob
    objects) composed with the EngineCore (scheduler, model runner, grammars). The engine core process runs the
    core alone (core_proc.py), and the API server's client the two front-end halves (core_client.py)."""

    def __init__(self, config: EngineConfig):
        with jit_watch.starting():  # start-up's Triton variants are expected; later ones are logged as late
            with ThreadPoolExecutor(1, thread_name_prefix="replayllm-tokenizer") as pool:
                inputs, tokenizer = load_in_background(config, pool)  # the tokenizer loads while the model does
                core = EngineCore(config, tokenizer)
                self._compose(inputs.result(), core)
            try:
                if config.torch_device.type == "cuda":
                    warm_up(self)  # compiles what a run needs now, not inside the first request (engine/warm_up.py)
            finally:
                compile_workers.stop()  # start-up's compiles are done (kernels/compile_workers.py)
        if config.torch_device.type == "cuda":
            jit_watch.watch()

    @classmethod
    def around(cls, core: EngineCore, input_processor: InputProcessor) -> LLMEngine:
        """A front end for a core built elsewhere, not warmed up (the core process warms its core through one)."""
        engine = cls.__new__(cls)
        engine._compose(input_processor, core)
        return engine

    def _compose(self, input_processor: InputProcessor, core: EngineCore) -> None:
        self.config = core.config
        # the checkpoint's facts with vLLM's engine-level names (max_model_len, model, seed, ...) beside them, and
        # the EOS ids requests end on (the tokenizer's first)
        self.model_config = ServedModelConfig.of(core.model_config, core.config, input_processor.eos_token_ids)
        self.input_processor = input_processor
        self.core = core
        self.output_processor = OutputProcessor(input_processor.tokenizer, input_processor.decode_token)

    # The core's parts and counters, as attributes of the engine.
    runner = _core_attr("runner", "the model runner (RunnerInterface)")
    scheduler = _core_attr("scheduler", "the Scheduler")
    block_manager = _core_attr("block_manager", "the BlockManager (KV blocks, prefix cache)")
    structured = _core_attr("structured", "the StructuredOutputManager (grammars)")
    num_steps = _core_attr("num_steps", "steps whose results were processed")
    max_running_in_step = _core_attr("max_running_in_step", "the largest batch seen")
    last_step_num_reqs = _core_attr("last_step_num_reqs", "requests in the latest step's batch")
    last_step_num_new_tokens = _core_attr("last_step_num_new_tokens", "tokens the latest step generated")
    num_overlapped_steps = _core_attr("num_overlapped_steps", "steps launched before the previous was processed")
    _arrivals = _core_attr("_arrivals", "requests added (their arrival order)")
    _inflight = _core_attr("_inflight", "async scheduling: the launched, unprocessed step")
    _ahead = _core_attr("_ahead", "async scheduling: the step scheduled ahead")
    # The input processor's.
    tokenizer = _inputs_attr("tokenizer", "the tokenizer (None with skip_tokenizer_init)")
    reasoning_tokens = _inputs_attr("reasoning_tokens", "thinking_token_budget's span tokens (None: none)")
    eos_token_ids = _inputs_attr("eos_token_ids", "the ids requests end on as EOS (the tokenizer's first)")
    route_shape = _inputs_attr("route_shape", "trace_routed_experts' shape checks (None: a dense model)")

    # -- requests ----------------------------------------------------------------------------------
    def tokenize(self, prompt: str, add_special_tokens: bool = True, max_model_len: int | None = None
                 ) -> list[int]:
        return self.input_processor.tokenize(prompt, add_special_tokens, max_model_len)

    def decode_token(self, token: int) -> str | None:
        return self.input_processor.decode_token(token)

    def process_prompt(self, prompt, add_special_tokens: bool = True, truncate: int | None = None
                       ) -> tuple[str | None, list[int]]:
        return self.input_processor.process_prompt(prompt, add_special_tokens, truncate)

    def verify_params(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        return self.input_processor.verify_params(params, prompt_len)

    def prepare_request(self, prompt, params: SamplingParams) -> PreparedRequest:
        return self.input_processor.prepare_request(prompt, params)

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    prepared: PreparedRequest | None = None) -> None:
        """Validate and enqueue (or enqueue an already prepared request). A ValueError leaves nothing queued."""
        if prepared is None:
            self.core.check_accepting(request_id, self.output_processor)  # a refused request is not tokenized
            prepared = self.prepare_request(prompt, params if params is not None else SamplingParams())
        self.core.add_request(request_id, prepared, self.output_processor)

    def abort_request(self, request_id: str | Iterable[str]) -> bool:
        """Abort a request (all its children), or each of several ids (vLLM takes a list too); their KV blocks are
        freed at once. False if none was known and unfinished."""
        if not isinstance(request_id, str):
            return any([self.abort_request(rid) for rid in request_id])  # a list: every id, not up to the first
        return self.core.abort_request(request_id, self.output_processor)

    def take_rejected(self) -> list[tuple[str, ValueError]]:
        """(parent id, error) of the requests the engine failed since the last call (after step())."""
        return self.core.take_rejected()

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        """Requests added and not yet finished or aborted (a parent of n > 1 counts once), as vLLM's."""
        return len(self.output_processor.parents)

    def get_tokenizer(self):
        """The tokenizer, as LLM.get_tokenizer (None with skip_tokenizer_init)."""
        return self.tokenizer

    # -- weights and sleep mode: the core's ------------------------------------------------------------
    def load_weights(self, weights) -> int:
        """See EngineCore.load_weights: in place, all checked first, an idle engine; the tensor count."""
        return self.core.load_weights(weights)

    def reset_prefix_cache(self) -> bool:
        return self.core.reset_prefix_cache()

    def update_weights_from_disk(self, model_path: str) -> int:
        return self.core.update_weights_from_disk(model_path)

    def sleep(self, level: int = 1) -> None:
        """See EngineCore.sleep (enable_sleep_mode=True; level 1 keeps the weights in host memory)."""
        self.core.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.core.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.core.is_sleeping()

    def check_weights_awake(self, what: str) -> None:
        self.core.check_weights_awake(what)

    def shutdown(self) -> None:
        """Release everything the engine holds (idempotent): requests still queued or running are aborted, the
        grammar threads stop, the runner frees its device memory (graphs, KV cache, weights) and stops its
        tensor-parallel workers, and torch's CUDA cache is emptied so the memory goes back to the device. The
        engine takes no request afterwards."""
        if self.is_shut_down:
            return
        for rid in list(self.output_processor.parents):
            self.abort_request(rid)
        self.core.shutdown()

    @property
    def is_shut_down(self) -> bool:
        return self.core.is_shut_down

    # -- the loop --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step (EngineCore.step) and the RequestOutputs its finished step made."""
        outputs = self.core.step(self.output_processor)
        return [] if outputs is None else outputs
