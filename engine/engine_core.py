"""EngineCore: schedule -> execute -> update, the half of the engine that owns the model (runner, KV blocks,
scheduler, grammars); its step's results go to an OutputSink, the front end's output processor."""

from __future__ import annotations

import logging
import random
import weakref
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

from ..config import EngineConfig
from ..model_runner_v2.async_output import AsyncModelRunnerOutput
from ..model_runner_v2.loader import checkpoint_tensors, weight_files
from ..model_runner_v2.model_runner import ModelRunner
from ..model_runner_v2.models.weight_update import named_tensors
from ..model_runner_v2.runner_interface import RunnerInterface
from ..model_runner_v2.sleep_mode import TAGS as SLEEP_TAGS
from ..model_runner_v2.tp_workers import TensorParallelRunner
from ..model_source import resolve_model_path
from ..sampling_params import SamplingParams
from ..step_io import GrammarBitmask, ModelRunnerOutput, SchedulerOutput
from .block_hash import salted_by
from .block_manager import BlockManager
from .input_processor import PreparedRequest
from .request import Request, RequestStatus, child_request_id
from .scheduler import Scheduler
from .structured_output_manager import StructuredOutputManager

logger = logging.getLogger(__name__)

_SEED_MASK = (1 << 63) - 1  # seeds live in an int64 device tensor
T_co = TypeVar("T_co", covariant=True)


@runtime_checkable
class OutputSink(Protocol[T_co]):
    """Where the core's requests are registered and its step results go: the parent requests (one prompt, n
    children) and what a step makes of its produced requests. In process the front end's OutputProcessor
    (RequestOutputs); in the engine core process the CoreOutputCollector (CoreOutputs for the API server)."""

    parents: dict[str, Any]  # parent id -> its state (with `child_ids`)

    def add_request(self, parent_id: str, prompt: str | None, prompt_token_ids: list[int], child_ids: list[str],
                    p: SamplingParams) -> None: ...

    def abort(self, parent_id: str) -> Any | None: ...

    def process(self, produced: list[Request], out: ModelRunnerOutput, scheduler: Scheduler) -> T_co: ...


class EngineCore:
    """The scheduler, the model runner and the grammars of one engine. `step(sink)` runs one step (async
    scheduling: launches one and finishes the one before) and returns what `sink.process` made of the finished
    step's results, or None when no step finished."""

    def __init__(self, config: EngineConfig, tokenizer):
        """tokenizer: the model's tokenizer, None (skip_tokenizer_init), or a Future of it still loading (waited
        for by the first grammar: input_processor.load_in_background, load_tokenizer_into)."""
        self.config = config
        self.model_config = config.model_config
        # tensor_parallel_size > 1: rank 0's runner driving one worker process per extra rank (tp_workers.py).
        self.runner: RunnerInterface = (ModelRunner(config) if config.tensor_parallel_size == 1
                                        else TensorParallelRunner(config))
        # Releases the runner's device memory (and stops its workers) when the core is shut down or collected;
        # it holds the runner, never the core, so it does not keep the core alive.
        self._finalizer = weakref.finalize(self, _release, self.runner, config.torch_device.type == "cuda")
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.max_model_len, config.enable_chunked_prefill, config.speculative_config)
        if config.enable_return_routed_experts:
            self.scheduler.on_finish = self._read_routed_experts
        # Structured outputs: grammars compiled per request (lazily: nothing is built until one asks); a tokenizer
        # still loading (a Future) is waited for by the first grammar compile.
        self.structured = StructuredOutputManager(tokenizer, self.model_config.vocab_size,
                                                  self.model_config.eos_token_ids,
                                                  pin_memory=config.torch_device.type == "cuda",
                                                  compile_timeout_s=config.structured_outputs_compile_timeout,
                                                  cache_mb=config.structured_outputs_cache_mb)
        weakref.finalize(self, self.structured.shutdown)
        # Requests failed since the last take_rejected(): (parent id, ValueError); their drivers report them.
        self.rejected: list[tuple[str, ValueError]] = []
        self._rng = random.Random(config.seed)  # seeds for requests that gave none
        self._arrivals = 0
        self.num_steps = 0
        self.max_running_in_step = 0  # the largest batch seen (continuous batching evidence)
        self.last_step_num_reqs = 0  # requests in the latest step's batch (the server's batch-size histogram)
        # Tokens the latest step generated (one per request that sampled, several per fast-replay row). Counted
        # here, not from the outputs: with output_kind FINAL_ONLY or DELTA they do not show per-step progress.
        self.last_step_num_new_tokens = 0
        # async_scheduling: the launched step whose results have not been processed yet.
        self._inflight: _LaunchedStep | None = None
        # async_scheduling with structured rows: the step after the in-flight one, scheduled early (while the
        # in-flight step's grammar bits were filled); the next step() launches it instead of scheduling.
        self._ahead: _LaunchedStep | None = None
        self.num_overlapped_steps = 0  # steps launched before the previous step's results were processed
        self._asleep: set[str] = set()  # sleep mode: the parts (SLEEP_TAGS) whose memory is given back

    # -- requests ----------------------------------------------------------------------------------
    def add_request(self, parent_id: str, prepared: PreparedRequest, sink: OutputSink) -> None:
        """Enqueue a checked request as its n children (each with a resolved seed), registered with `sink`."""
        self.check_accepting(parent_id, sink)
        p = prepared.params
        children, eos = [], prepared.eos_token_ids or self.model_config.eos_token_ids
        for i in range(p.n):
            seed = (p.seed + i) & _SEED_MASK if p.seed is not None else self._rng.getrandbits(63)
            req = Request(child_request_id(parent_id, i, p.n), prepared.prompt_token_ids, p, seed,
                          eos, self._arrivals)
            req.bad_words_token_ids = prepared.bad_words_token_ids
            req.reasoning_tokens = prepared.reasoning_tokens
            if prepared.cache_salt is not None:  # its blocks hash apart from every other salt's (and no salt's)
                req.block_hash_seed = salted_by(req.block_hash_seed, prepared.cache_salt)
            if p.structured_outputs is not None:
                req.grammar = self.structured.add_request(p.structured_outputs, parent_id, eos)  # in the background
                req.grammar.waits_for = prepared.grammar_waits_for  # reasoning first (EngineConfig.reasoning_parser)
            self._arrivals += 1
            children.append(req)
        sink.add_request(parent_id, prepared.prompt, prepared.prompt_token_ids, [c.request_id for c in children], p)
        for req in children:
            self.scheduler.add_request(req)

    def check_accepting(self, parent_id: str, sink: OutputSink) -> None:
        """Raises unless request `parent_id` may be added now: the engine is up and awake, and the id is free."""
        if self.is_shut_down:
            raise RuntimeError("this engine has been shut down; build a new one")
        if self._asleep:
            raise ValueError(f"the engine is asleep ({', '.join(sorted(self._asleep))} released by sleep()): call "
                             "wake_up() before generating")
        if parent_id in sink.parents:
            raise ValueError(f"request id {parent_id!r} is already in use")

    def abort_request(self, parent_id: str, sink: OutputSink) -> bool:
        """Abort a request registered with `sink` (all its children; their KV blocks are freed at once). False if
        it was not known and unfinished."""
        parent = sink.abort(parent_id)
        if parent is None:
            return False
        for cid in parent.child_ids:
            req = self.scheduler.requests.get(cid)
            if req is not None:
                self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
        return True

    def _reject_failed_grammars(self, sink: OutputSink) -> None:
        """Requests whose grammar did not compile (timed out, rejected by xgrammar) are aborted and queued in
        `rejected` with the error (a ValueError naming structured_outputs: an HTTP 400), never admitted."""
        for grammar in self.structured.take_failed():
            if grammar.parent_id is not None and self.abort_request(grammar.parent_id, sink):
                error = grammar.error
                if not isinstance(error, ValueError):
                    error = ValueError(f"structured_outputs: the grammar could not be compiled: {error}")
                self.rejected.append((grammar.parent_id, error))

    def take_rejected(self) -> list[tuple[str, ValueError]]:
        """(parent id, error) of the requests the engine failed since the last call (after step())."""
        out, self.rejected = self.rejected, []
        return out

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    def _read_routed_experts(self, req: Request) -> None:
        """A finishing request's MoE routes, read through its block table before its blocks are freed: every
        position whose forward ran (all but the last token). With a step in flight (async scheduling) the read
        waits for it; that step writes none of these positions (its row for this request, if any, is the next)."""
        req.routed_experts = self.runner.read_routed_experts(req.block_ids, req.num_tokens - 1)

    # -- weights and sleep mode (vLLM's; docs/rl.md) --------------------------------------------------
    def load_weights(self, weights) -> int:
        """Update the weights in place (vLLM's `load_weights`) from an nn.Module (its state_dict), a mapping or
        (HF name, tensor) pairs, any dtype and device, any subset. All are checked before any is copied (a bad one
        is a ValueError naming it, the engine unchanged); CUDA graphs stay valid (same storage); the prefix cache
        is dropped. Returns the number of tensors applied (a tied lm_head.weight, rotary caches: not counted)."""
        if self.is_shut_down:
            raise RuntimeError("this engine has been shut down; build a new one")
        if self.config.quantization is not None:
            raise ValueError(f"load_weights does not support quantization={self.config.quantization!r} yet: the "
                             "engine's weights are quantized copies, not the checkpoint's tensors")
        if self.has_unfinished_requests():
            raise ValueError("load_weights needs an idle engine: requests in flight would mix KV from the old and "
                             "the new weights (wait for them, or abort them)")
        self.check_weights_awake("load_weights")
        applied = self.runner.load_weights(list(named_tensors(weights)))
        self.block_manager.reset_prefix_cache()
        return applied

    def reset_prefix_cache(self) -> bool:
        """vLLM's: forget every cached prompt block (e.g. when the weights changed by a path other than
        load_weights, which drops them itself). False, and nothing reset, while requests hold blocks (as vLLM)."""
        if self.has_unfinished_requests():
            return False
        self.block_manager.reset_prefix_cache()
        return True

    def update_weights_from_disk(self, model_path: str) -> int:
        """load_weights from a checkpoint folder's weight files (safetensors, else PyTorch .bin; SGLang's name; the
        server's /update_weights_from_disk): same architecture and shapes, in place. Returns the number of tensors."""
        if not isinstance(model_path, str) or not model_path:
            raise ValueError(f"model_path must be a checkpoint folder, got {model_path!r}")
        try:
            files = weight_files(resolve_model_path(model_path))
        except (OSError, ValueError) as e:  # no such folder, no weights in it, a shard missing
            raise ValueError(f"cannot load weights from {model_path!r}: {e}") from None
        return self.load_weights(checkpoint_tensors(self.model_config, files, self.config.torch_device))

    def sleep(self, level: int = 1) -> None:
        """Give the GPU memory of the KV cache and the weights back (enable_sleep_mode=True): level 1 keeps the
        weights in pinned host memory, level 2 discards them (load_weights after wake_up). Needs an idle engine;
        the prefix cache is dropped. Until wake_up, requests are refused. While any part is still asleep, a
        sleep does nothing but log a warning (vLLM's)."""
        if self.is_shut_down:
            raise RuntimeError("this engine has been shut down; build a new one")
        if not self.config.enable_sleep_mode:
            raise ValueError("sleep mode is off: build the engine with enable_sleep_mode=True "
                             "(--enable-sleep-mode)")
        if isinstance(level, bool) or level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (weights kept in host memory) or 2 (weights discarded), "
                             f"got {level!r}")
        if level == 2 and self.config.quantization is not None:
            raise ValueError("sleep level 2 discards the weights, and load_weights cannot bring back the quantized "
                             f"weights of quantization={self.config.quantization!r}: use level 1")
        if self._asleep:  # vLLM's executor: a warning, nothing done (a second sleep used to lose the weights)
            logger.warning("sleep(level=%d) ignored: the engine is already asleep (%s); wake_up() first",
                           level, ", ".join(sorted(self._asleep)))
            return
        if self.has_unfinished_requests():
            raise ValueError("sleep needs an idle engine: wait for the requests in flight, or abort them")
        self.runner.sleep(level)
        self.block_manager.reset_prefix_cache()  # the cached blocks' KV is gone
        self._asleep = {"weights", "kv_cache"}

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take the memory back (vLLM's tags: "weights", "kv_cache"; None: both). Waking only the weights lets a
        trainer's load_weights run before the KV cache takes its memory. Waking what is awake does nothing."""
        if self.is_shut_down:
            raise RuntimeError("this engine has been shut down; build a new one")
        tags = list(SLEEP_TAGS) if tags is None else tags
        if isinstance(tags, str) or not all(t in SLEEP_TAGS for t in tags):
            raise ValueError(f"wake_up tags must be a list of {list(SLEEP_TAGS)}, got {tags!r}")
        wanted = [t for t in SLEEP_TAGS if t in tags and t in self._asleep]
        if wanted:
            self.runner.wake_up(wanted)
            self._asleep -= set(wanted)

    def is_sleeping(self) -> bool:
        """True while any part (weights or KV cache) is asleep."""
        return bool(self._asleep)

    def check_weights_awake(self, what: str) -> None:
        """ValueError while sleep() holds the weights (their tensors have no memory: a read would crash)."""
        if "weights" in self._asleep:
            raise ValueError(f"the weights are asleep: call wake_up(tags=['weights']) before {what}")

    def shutdown(self) -> None:
        """Release everything the core holds (idempotent): requests still queued or running are aborted, the
        grammar threads stop, the runner frees its device memory (graphs, KV cache, weights) and stops its
        tensor-parallel workers, and torch's CUDA cache is emptied so the memory goes back to the device."""
        if self.is_shut_down:
            return
        for req in list(self.scheduler.requests.values()):
            self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
        self._inflight = None
        self._drop_ahead()
        self.structured.shutdown()
        self._finalizer()

    @property
    def is_shut_down(self) -> bool:
        return not self._finalizer.alive

    # -- the step -------------------------------------------------------------------------------------
    def step(self, sink: OutputSink[T_co]) -> T_co | None:
        """One step: schedule -> execute -> update -> `sink.process`. None: no step's results this call."""
        self.last_step_num_new_tokens = 0
        if self.structured.failed:
            self._reject_failed_grammars(sink)
        if self.config.async_scheduling:
            return self._step_async(sink)
        sched = self._schedule().sched
        if sched.is_empty:
            self.runner.free_requests(sched.freed_request_ids)  # slots must not outlive their requests
            return None
        # Nothing in flight: the matchers have accepted every earlier token, the bits can be filled now.
        sched.grammar = self.structured.grammar_bitmask(sched, self.scheduler.requests)
        out = self.runner.execute(sched)
        return sink.process(self._update(sched, out), out, self.scheduler)

    def _step_async(self, sink: OutputSink[T_co]) -> T_co | None:
        """Launch step N+1, then process step N while the device runs N+1; the scheduler counts N's tokens as
        pending. Finishes N first when a running request's sampler reads its tokens on the host (penalties,
        min_tokens, bad words): those must see N's token. In order: schedule N+1 (or take the one scheduled
        ahead) -> execute_model (N+1's forward queued) -> its grammar bits, filled on the host meanwhile
        (`_grammar`: with structured rows it waits for N, updates with it, makes N's outputs and schedules N+2
        while the fill thread runs) -> sample_tokens -> N's update and outputs (made once)."""
        prev, self._inflight = self._inflight, None
        outputs = None
        if prev is not None and self.scheduler.running_needs_host_tokens():
            outputs, prev = self._outputs_of(prev, sink), None
        step, self._ahead = self._ahead, None
        if step is None:
            step = self._schedule(after=prev)
        if step.sched.is_empty:
            self.runner.free_requests(step.sched.freed_request_ids)  # slots must not outlive their requests
        else:
            try:
                self.runner.execute_model(step.sched)
                grammar = self._grammar(step, sink)
                step.handle = self.runner.sample_tokens(grammar)
            except BaseException:
                self._drop_ahead()  # scheduled after a step that never launched: never to be launched either
                raise
            step.after = None  # its grammar is filled: no chain of finished steps kept alive
            self._inflight = step
        if prev is not None:
            self.num_overlapped_steps += self._inflight is not None
            outputs = self._outputs_of(prev, sink)  # already made if N+1's grammar was filled
        return outputs

    def _grammar(self, step: _LaunchedStep, sink: OutputSink) -> GrammarBitmask | None:
        """The bits of `step`'s structured rows, filled while its forward runs. Scheduled behind a step still
        unprocessed (`step.after`), the matchers must first accept that step's tokens: wait for it, update the
        scheduler, start the fill on the fill thread and, while it runs (no GIL), make that step's outputs and
        schedule the step after this one (`_ahead`; not blocking on compiling grammars): host costs that
        overlap, not add up (docs/structured_outputs.md, "Async scheduling")."""
        sched, requests, prev = step.sched, self.scheduler.requests, step.after
        if prev is None or not self.structured.has_grammar_rows(sched, requests):
            return self.structured.grammar_bitmask(sched, requests)
        self._update_step(prev)
        bits = self.structured.start_grammar_bitmask(sched, requests)
        try:
            self._outputs_of(prev, sink)
            if self._ahead is None and not self.scheduler.running_needs_host_tokens():
                self._ahead = self._schedule(after=step, ahead=True)
                if self._ahead.sched.is_empty:
                    self._drop_ahead()
        finally:
            grammar = bits()  # the fill must end before anything else may touch its matchers
        return grammar

    def _schedule(self, after: _LaunchedStep | None = None, ahead: bool = False) -> _LaunchedStep:
        """The scheduler's batch, as a step not launched yet, behind `after` (the step still unprocessed, if
        any). An empty batch while requests wait only for their grammars blocks briefly on the compile (no
        spinning), unless it is scheduled `ahead`."""
        step = _LaunchedStep(self.scheduler.schedule(), after=after)
        if step.sched.is_empty and not ahead:
            self.structured.wait_for_compile(self.scheduler.waiting)
        return step

    def _drop_ahead(self) -> None:
        """Forget the step scheduled ahead; the slots it would free go back to the scheduler, for whichever step
        is scheduled next."""
        if self._ahead is not None:
            self.scheduler.return_freed(self._ahead.sched.freed_request_ids)
            self._ahead = None

    def _update_step(self, step: _LaunchedStep) -> None:
        """Wait for a launched step's results and apply them to the scheduler (once)."""
        if step.produced is None:
            step.out = step.handle.get()
            step.produced = self._update(step.sched, step.out)

    def _outputs_of(self, step: _LaunchedStep, sink: OutputSink[T_co]) -> T_co:
        """A launched step's outputs, made once (a structured next step makes them while its bits are filled)."""
        if step.outputs is None:
            self._update_step(step)
            step.outputs = sink.process(step.produced, step.out, self.scheduler)
        return step.outputs

    def _update(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> list[Request]:
        """Step results -> scheduler (tokens, stops, grammar matchers); returns the requests that produced."""
        produced = self.scheduler.update(sched, out.sampled_by_request())
        self.num_steps += 1
        self.last_step_num_reqs = len(sched.rows)
        self.last_step_num_new_tokens = self.scheduler.num_new_tokens
        self.max_running_in_step = max(self.max_running_in_step, len(sched.rows))
        return produced


def _release(runner: RunnerInterface, cuda: bool) -> None:
    """The runner's resources (device memory, workers), then the freed blocks of torch's CUDA cache back to
    the device, so the next engine (or a trainer sharing the GPU) can have them."""
    runner.shutdown()
    if cuda:
        import torch

        # cuBLAS workspaces stay: another engine's (or a trainer's) CUDA graphs may replay kernels that use them.
        torch.cuda.empty_cache()


@dataclass
class _LaunchedStep:
    """A scheduled step, behind `after` (async scheduling: the step still unprocessed when it was scheduled);
    once launched its handle, and once its results are in the scheduler, what they produced and its outputs."""

    sched: SchedulerOutput
    after: _LaunchedStep | None = None
    handle: AsyncModelRunnerOutput | None = None
    out: ModelRunnerOutput | None = None
    produced: list[Request] | None = None
    outputs: Any = None  # what the sink's process made of them
