"""LLMEngine: add requests, step (schedule -> run -> update -> outputs), abort."""

from __future__ import annotations

import random
import weakref
from collections.abc import Iterable
from dataclasses import dataclass

from ..config import EngineConfig
from ..model_runner_v2.async_output import AsyncModelRunnerOutput
from ..model_runner_v2.loader import iterate_safetensors, safetensors_files
from ..model_runner_v2.model_runner import ModelRunner
from ..model_runner_v2.runner_interface import RunnerInterface
from ..model_runner_v2.sleep_mode import TAGS as SLEEP_TAGS
from ..model_runner_v2.tp_workers import TensorParallelRunner
from ..model_runner_v2.weight_update import named_tensors
from ..model_source import resolve_model_path
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from ..step_io import DeferredGrammar, GrammarBitmask, ModelRunnerOutput, SchedulerOutput
from .block_manager import BlockManager
from .input_processor import InputProcessor, PreparedRequest, check_prompt_token_ids  # noqa: F401 (re-exported)
from .output_processor import OutputProcessor
from .request import Request, RequestStatus, child_request_id
from .scheduler import Scheduler
from .structured_outputs import StructuredOutputManager
from .warm_up import warm_up

_SEED_MASK = (1 << 63) - 1  # seeds live in an int64 device tensor


class LLMEngine(InputProcessor):
    """The input checks (InputProcessor) plus the scheduler, the model runner and the output processor."""

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        # tensor_parallel_size > 1: rank 0's runner driving one worker process per extra rank (tp_workers.py).
        self.runner: RunnerInterface = (ModelRunner(config) if config.tensor_parallel_size == 1
                                        else TensorParallelRunner(config))
        # Releases the runner's device memory (and stops its workers) when the engine is shut down or collected;
        # it holds the runner, never the engine, so it does not keep the engine alive.
        self._finalizer = weakref.finalize(self, _release, self.runner, config.torch_device.type == "cuda")
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.max_model_len, config.enable_chunked_prefill, config.speculative_config)
        self.output_processor = OutputProcessor(self.tokenizer, self.decode_token)
        if config.enable_return_routed_experts:
            self.scheduler.on_finish = self._read_routed_experts
        # Structured outputs: grammars compiled per request (lazily: nothing is built until one asks).
        self.structured = StructuredOutputManager(self.tokenizer, self.model_config.vocab_size,
                                                  self.model_config.eos_token_ids,
                                                  pin_memory=config.torch_device.type == "cuda",
                                                  compile_timeout_s=config.structured_outputs_compile_timeout,
                                                  cache_mb=config.structured_outputs_cache_mb)
        # Requests failed since the last take_rejected(): (parent id, ValueError); their drivers report them.
        self.rejected: list[tuple[str, ValueError]] = []
        weakref.finalize(self, self.structured.shutdown)
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
        if config.torch_device.type == "cuda":
            warm_up(self)  # compiles what a run needs now, not inside the first request (engine/warm_up.py)

    # -- requests ----------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    prepared: PreparedRequest | None = None) -> None:
        """Validate and enqueue (or enqueue an already prepared request). A ValueError leaves nothing queued."""
        if self.is_shut_down:
            raise RuntimeError("this engine has been shut down; build a new one")
        if self._asleep:
            raise ValueError(f"the engine is asleep ({', '.join(sorted(self._asleep))} released by sleep()): call "
                             "wake_up() before generating")
        if request_id in self.output_processor.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        if prepared is None:
            prepared = self.prepare_request(prompt, params if params is not None else SamplingParams())
        p = prepared.params
        children = []
        for i in range(p.n):
            child_id = child_request_id(request_id, i, p.n)
            seed = (p.seed + i) & _SEED_MASK if p.seed is not None else self._rng.getrandbits(63)
            req = Request(child_id, prepared.prompt_token_ids, p, seed, self.model_config.eos_token_ids,
                          self._arrivals)
            req.bad_words_token_ids = prepared.bad_words_token_ids
            req.reasoning_tokens = prepared.reasoning_tokens
            if p.structured_outputs is not None:
                req.grammar = self.structured.add_request(p.structured_outputs, request_id)  # in the background
            self._arrivals += 1
            children.append(req)
        self.output_processor.add_request(request_id, prepared.prompt, prepared.prompt_token_ids,
                                          [c.request_id for c in children], p)
        for req in children:
            self.scheduler.add_request(req)

    def abort_request(self, request_id: str | Iterable[str]) -> bool:
        """Abort a request (all its children), or each of several ids (vLLM takes a list too); their KV blocks are
        freed at once. False if none was known and unfinished."""
        if not isinstance(request_id, str):
            return any([self.abort_request(rid) for rid in request_id])  # a list: every id, not up to the first
        parent = self.output_processor.abort(request_id)
        if parent is None:
            return False
        for cid in parent.child_ids:
            req = self.scheduler.requests.get(cid)
            if req is not None:
                self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
        return True

    def load_weights(self, weights) -> int:
        """Update the model's weights in place (vLLM's `load_weights`): `weights` is an nn.Module (its
        state_dict), a mapping or an iterable of (HF name, tensor), any dtype and device, any subset of the
        model's tensors. All are checked before any is copied (an unknown name or a shape that does not fit is a
        ValueError naming it, and the engine is unchanged); CUDA graphs stay valid (same storage); the prefix
        cache is dropped (its KV came from the old weights). Returns the number of tensors applied."""
        if self.is_shut_down:
            raise RuntimeError("this engine has been shut down; build a new one")
        if self.config.quantization is not None:
            raise ValueError(f"load_weights does not support quantization={self.config.quantization!r} yet: the "
                             "engine's weights are quantized copies, not the checkpoint's tensors")
        if self.has_unfinished_requests():
            raise ValueError("load_weights needs an idle engine: requests in flight would mix KV from the old and "
                             "the new weights (wait for them, or abort them)")
        if "weights" in self._asleep:
            raise ValueError("the weights are asleep: call wake_up(tags=['weights']) before load_weights")
        weights = list(named_tensors(weights))
        self.runner.load_weights(weights)
        self.block_manager.reset_prefix_cache()
        return len(weights)

    def update_weights_from_disk(self, model_path: str) -> int:
        """load_weights from a checkpoint folder's safetensors files (SGLang's name; the server's
        /update_weights_from_disk): same architecture and shapes, in place. Returns the number of tensors."""
        if not isinstance(model_path, str) or not model_path:
            raise ValueError(f"model_path must be a checkpoint folder, got {model_path!r}")
        try:
            files = safetensors_files(resolve_model_path(model_path))
        except (OSError, ValueError) as e:  # no such folder, no weights in it, a shard missing
            raise ValueError(f"cannot load weights from {model_path!r}: {e}") from None
        return self.load_weights(iterate_safetensors(files, self.model_config.dtype))

    # -- sleep mode (vLLM's; docs/rl.md) ------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        """Give the GPU memory of the KV cache and the weights back (enable_sleep_mode=True): level 1 keeps the
        weights in pinned host memory, level 2 discards them (load_weights after wake_up). Needs an idle engine;
        the prefix cache is dropped. Until wake_up, requests are refused."""
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

    def _read_routed_experts(self, req: Request) -> None:
        """A finishing request's MoE routes, read through its block table before its blocks are freed: every
        position whose forward ran (all but the last token). With a step in flight (async scheduling) the read
        waits for it; that step writes none of these positions (its row for this request, if any, is the next)."""
        req.routed_experts = self.runner.read_routed_experts(req.block_ids, req.num_tokens - 1)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    def shutdown(self) -> None:
        """Release everything the engine holds (idempotent): requests still queued or running are aborted, the
        grammar threads stop, the runner frees its device memory (graphs, KV cache, weights) and stops its
        tensor-parallel workers, and torch's CUDA cache is emptied so the memory goes back to the device. The
        engine takes no request afterwards."""
        if self.is_shut_down:
            return
        for rid in list(self.output_processor.parents):
            self.abort_request(rid)
        self._inflight = None
        self._drop_ahead()
        self.structured.shutdown()
        self._finalizer()

    @property
    def is_shut_down(self) -> bool:
        return not self._finalizer.alive

    # -- the loop --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self.last_step_num_new_tokens = 0
        if self.structured.failed:
            self._reject_failed_grammars()
        if self.config.async_scheduling:
            return self._step_async()
        sched = self._schedule().sched
        if sched.is_empty:
            self.runner.free_requests(sched.freed_request_ids)  # slots must not outlive their requests
            return []
        return self._finish_step(sched, self.runner.execute(sched))

    def _reject_failed_grammars(self) -> None:
        """Requests whose grammar did not compile (timed out, rejected by xgrammar) are aborted and queued in
        `rejected` with the error (a ValueError naming structured_outputs: an HTTP 400), never admitted."""
        for grammar in self.structured.take_failed():
            if grammar.parent_id is not None and self.abort_request(grammar.parent_id):
                error = grammar.error
                if not isinstance(error, ValueError):
                    error = ValueError(f"structured_outputs: the grammar could not be compiled: {error}")
                self.rejected.append((grammar.parent_id, error))

    def take_rejected(self) -> list[tuple[str, ValueError]]:
        """(parent id, error) of the requests the engine failed since the last call (after step())."""
        out, self.rejected = self.rejected, []
        return out

    def _schedule(self, prev: _LaunchedStep | None = None, ahead: bool = False) -> _LaunchedStep:
        """The scheduler's batch (as a step not launched yet), with the grammar bitmask of its structured rows
        (structured outputs). `prev`: the step still on the device (async scheduling). Its tokens are not in the
        matchers yet, so a batch with structured rows then gets a DeferredGrammar: the runner fills it after
        launching this step's forward, by finishing `prev`'s scheduler update (the matchers accept its tokens),
        then filling the bits on the fill thread while `prev`'s outputs are made and the step after this one is
        scheduled (`ahead`: that early scheduling, which must not block on compiling grammars)."""
        step = _LaunchedStep(self.scheduler.schedule())
        sched, requests = step.sched, self.scheduler.requests
        if sched.is_empty:
            if not ahead:
                self.structured.wait_for_compile(self.scheduler.waiting)  # only grammars compiling: do not spin
        elif prev is not None and self.structured.has_grammar_rows(sched, requests):
            def fill() -> GrammarBitmask | None:
                self._update_step(prev)
                bits = self.structured.start_grammar_bitmask(sched, requests)
                # While the fill thread writes this step's bits (no GIL), the engine thread makes `prev`'s outputs
                # (detokenizing, stop strings) and schedules the next step: host costs that overlap, not add up.
                try:
                    self._finish_launched(prev)
                    if self._ahead is None and not self.scheduler.running_needs_host_tokens():
                        self._schedule_ahead(step)
                finally:
                    grammar = bits()  # the fill must end before anything else may touch its matchers
                return grammar
            sched.grammar = DeferredGrammar(fill)
        else:
            sched.grammar = self.structured.grammar_bitmask(sched, requests)
        return step

    def _schedule_ahead(self, step: _LaunchedStep) -> None:
        """Schedule the step after `step` now (see _schedule). An empty batch is not kept: the slots it would
        free go back to the scheduler, for whichever step is scheduled next."""
        self._ahead = self._schedule(step, ahead=True)
        if self._ahead.sched.is_empty:
            self._drop_ahead()

    def _drop_ahead(self) -> None:
        if self._ahead is not None:
            self.scheduler.return_freed(self._ahead.sched.freed_request_ids)
            self._ahead = None

    def _step_async(self) -> list[RequestOutput]:
        """Launch step N+1, then process step N while the device runs N+1; the scheduler counts N's tokens as
        pending. Finishes N first when a running request's sampler reads its tokens on the host (penalties,
        min_tokens, bad words): those must see N's token. Structured rows keep the overlap: only N+1's sampler
        needs the bitmask, so the runner launches N+1's forward, then (DeferredGrammar) waits for N's tokens,
        updates the scheduler with them, starts the fill on the grammar workers' fill thread, and meanwhile
        processes N's outputs and schedules N+2 (`_ahead`, launched by the next call), then launches the sampler;
        the device runs N+1's forward all along."""
        prev, self._inflight = self._inflight, None
        outputs: list[RequestOutput] = []
        if prev is not None and self.scheduler.running_needs_host_tokens():
            outputs, prev = self._finish_launched(prev), None
        step, self._ahead = self._ahead, None
        if step is None:
            step = self._schedule(prev)
        sched = step.sched
        if sched.is_empty:
            self.runner.free_requests(sched.freed_request_ids)  # slots must not outlive their requests
        else:
            try:
                step.handle = self.runner.execute_async(sched)
            except BaseException:
                self._drop_ahead()  # scheduled after a step that never launched: never to be launched either
                raise
            self._inflight = step
        if prev is not None:
            self.num_overlapped_steps += self._inflight is not None
            outputs = self._finish_launched(prev)  # already made if N+1's grammar was filled
        return outputs

    def _update_step(self, step: _LaunchedStep) -> None:
        """Wait for a launched step's results and apply them to the scheduler (once)."""
        if step.produced is None:
            step.out = step.handle.get()
            step.produced = self._update(step.sched, step.out)

    def _finish_launched(self, step: _LaunchedStep) -> list[RequestOutput]:
        """A launched step's outputs, made once (a structured next step makes them while its bits are filled)."""
        if step.outputs is None:
            self._update_step(step)
            step.outputs = self.output_processor.process(step.produced, step.out, self.scheduler)
        return step.outputs

    def _finish_step(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> list[RequestOutput]:
        """Step results -> scheduler (tokens, stops) -> outputs."""
        return self.output_processor.process(self._update(sched, out), out, self.scheduler)

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
    """A scheduled step; async_scheduling: once launched its handle, and once its results are in the scheduler,
    what they produced and its outputs."""

    sched: SchedulerOutput
    handle: AsyncModelRunnerOutput | None = None
    out: ModelRunnerOutput | None = None
    produced: list[Request] | None = None
    outputs: list[RequestOutput] | None = None
