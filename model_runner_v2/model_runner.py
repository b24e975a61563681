"""ModelRunner (V2 style): persistent slots, staged writes, input prep, forward, sampling, one output copy."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from ..config import EngineConfig
from ..sampling.sampler import MultiPositionRows, Sampler
from ..step_io import GrammarBitmask, NewRequestData, PromptLogprobsChunk, SchedulerOutput
from .async_output import AsyncModelRunnerOutput
from .compile_ahead_steps import compile_eager_steps
from .cuda_graph import CudaGraphRunner
from .forced_routes import ForcedRoutes
from .forward_context import ForwardContext, set_forward_context
from .input_batch import InputBatch, prepare_inputs
from .kv_cache import allocate_kv_caches, determine_num_blocks, kv_cache_specs
from .loader import load_model
from .models.weight_update import applied_count, apply_update, plan_update
from .piecewise_graph import PiecewiseGraphRunner
from .prompt_logprobs import compute_prompt_logprobs
from .recurrent_state import allocate_states, bind_states, state_specs
from .request_states import RequestStates
from .routed_experts import RoutedExperts
from .runner_interface import RunnerInterface
from .sleep_mode import SleepMode
from .step_upload import StepUpload

logger = logging.getLogger(__name__)


class ModelRunner(RunnerInterface):
    """One rank's runner: owns the model, the KV cache, the per-slot request state and the sampler."""

    def __init__(self, config: EngineConfig):
        self.config = config
        mc = config.model_config
        self.device = config.torch_device
        start = time.perf_counter()
        free_at_start = None  # the device's free bytes before this engine took any: its gpu_memory_utilization share
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # an earlier engine's cached blocks in this process: free, not this engine's
            free_at_start = torch.cuda.mem_get_info(self.device)[0]
        self.model = load_model(mc, self.device, config.load_format, config.seed, quantization=config.quantization,
                                fp32_lm_head=config.enable_fp32_lm_head,
                                batch_invariant=config.batch_invariant, max_model_len=config.max_model_len)
        # Sleep mode: the weights move into regions whose memory can go back to the device (sleep_mode.py).
        self.sleep_mode = SleepMode(self.model, self.device) if config.enable_sleep_mode else None
        if self.sleep_mode is not None and self.device.type == "cuda":
            torch.cuda.empty_cache()  # the weights' first copies: free memory again before the KV budget is read
        self.num_blocks = determine_num_blocks(config, free_at_start)  # what the BlockManager hands out
        # One more block than that: the sink that padded CUDA-graph rows read and write (never a request's).
        # A hybrid model's recurrent state beside the cache (recurrent_state.py), bound to its linear layers.
        if self.sleep_mode is not None:
            tensors = self.sleep_mode.allocate_kv(kv_cache_specs(config, self.num_blocks + 1) + state_specs(config))
            self.kv_caches, states = tensors[:mc.num_kv_layers], tensors[mc.num_kv_layers:]
        else:
            self.kv_caches, states = allocate_kv_caches(config, self.num_blocks + 1), allocate_states(config)
        bind_states(self.model, states)
        logger.info("model loaded (%s weights) and %d KV blocks allocated in %.1f s", config.load_format,
                    self.num_blocks, time.perf_counter() - start)
        # MoE routes of every KV slot (the sink block's too), with enable_return_routed_experts (routed_experts.py).
        self.routed_experts = (RoutedExperts((self.num_blocks + 1) * config.block_size, mc.num_layers,
                                             mc.num_experts_per_tok, config.block_size, self.device)
                               if config.enable_return_routed_experts else None)
        # Routing replay: the slots' SamplingParams.trace_routed_experts, for MoE models (forced_routes.py).
        self.forced_routes = (ForcedRoutes(mc.num_layers, mc.num_experts_per_tok, self.device) if mc.is_moe
                              else None)
        n = config.max_num_seqs
        self.req_states = RequestStates(n, config.max_model_len, config.max_blocks_per_seq, self.device,
                                        pad_block=self.num_blocks)  # padding rows of the graphs: the sink
        self._slot_tokens = self.req_states.slot_tokens()  # what the sampler reads of the slots
        # The sampler keeps its own per-slot state (sampling options; the trace buffer with enable_trace_replay).
        self.sampler = Sampler(n, config.max_model_len, self.device, config.enable_trace_replay)
        self.eos_token_ids = mc.eos_token_ids
        self.num_prompt_logprobs = np.full(n, -1, dtype=np.int64)  # host, per slot
        self._upload = StepUpload(self.device)  # each step's staged writes, one copy (step_upload.py)
        routes = None if self.routed_experts is None else self.routed_experts.buffer  # graphs write it too
        # A fresh machine's Triton compiles on a thread pool before capture and warm-up meet them one by one.
        compile_eager_steps(self.model, self.kv_caches, config, sink_block=self.num_blocks,
                            token_ids_width=self.req_states.token_ids.shape[1])
        self.graph_runner = (CudaGraphRunner(self.model, self.kv_caches, config, sink_block=self.num_blocks,
                                             states=self.req_states, routed_experts=routes)
                             if config.use_full_cuda_graphs else None)
        # Every other step of up to max_piecewise_capture_size tokens: per-layer graphs around eager attention.
        self.piecewise = (PiecewiseGraphRunner(self.model, self.kv_caches, config, sink_block=self.num_blocks,
                                               routed_experts=routes)
                          if config.use_piecewise_cuda_graphs else None)
        self._executed: _ExecutedStep | None = None  # launched by execute_model, sampled by sample_tokens

    # -- slot lifecycle ---------------------------------------------------------------------------
    def _add_request(self, new: NewRequestData) -> None:
        # The trace goes to the sampler's trace rows only; fast replay reads upcoming input ids there.
        slot = self.req_states.add_request(new.request_id, new.token_ids, new.num_prompt_tokens, new.block_ids)
        self.sampler.add_request(slot, new.params, new.seed, self.eos_token_ids, new.bad_words_token_ids,
                                 new.reasoning_tokens, new.token_ids)
        p = new.params.prompt_logprobs
        self.num_prompt_logprobs[slot] = -1 if p is None else p
        if self.forced_routes is not None:
            self.forced_routes.add(slot, new.params.trace_routed_experts)

    def _remove_request(self, request_id: str) -> None:
        slot = self.req_states.remove_request(request_id)
        if slot is not None:
            self.sampler.remove_request(slot)
            if self.forced_routes is not None:
                self.forced_routes.remove(slot)

    def free_requests(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._remove_request(rid)

    def _apply_staged_writes(self) -> None:
        """Every writer's staged arrays to the device in one pinned, non-blocking copy (step_upload.py)."""
        self.req_states.apply_staged_writes(self._upload)
        self.sampler.apply_staged_writes(self._upload)
        self._upload.flush()

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> int:
        plan = plan_update(self.model, weights)
        apply_update(self.model, plan)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the caller may change its tensors next
        return applied_count(plan)

    def read_routed_experts(self, block_ids: list[int], num_positions: int) -> np.ndarray:
        if self.routed_experts is None:
            raise ValueError("routed experts are not captured: build the engine with enable_return_routed_experts")
        return self.routed_experts.read(block_ids, num_positions)

    def sleep(self, level: int) -> None:
        if self.sleep_mode is None:
            raise ValueError("sleep mode is off: build the engine with enable_sleep_mode=True")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # no step may still read the weights or the KV cache
        self.sleep_mode.sleep(level)

    def wake_up(self, tags: list[str]) -> None:
        if self.sleep_mode is None:
            raise ValueError("sleep mode is off: build the engine with enable_sleep_mode=True")
        self.sleep_mode.wake_up(tags)

    def shutdown(self) -> None:
        """Release the device memory this runner holds: CUDA graphs (and their private pools), the KV cache, the
        weights, the slot and sampler state (idempotent; the runner runs no step afterwards). Done explicitly,
        not left to the garbage collector, so an engine gives its memory back the moment it is shut down."""
        for graphs in (self.graph_runner, self.piecewise):
            if graphs is not None:
                graphs.release()
        self.graph_runner = self.piecewise = None
        self.kv_caches = []
        self.model = None
        self.req_states = self.sampler = self._slot_tokens = self.routed_experts = self.forced_routes = None
        self._upload = None  # its pinned staging buffers
        self._executed = None  # a launched step's logits
        if getattr(self, "sleep_mode", None) is not None:
            self.sleep_mode.free()  # the regions' memory and address ranges (nothing views them any more)
            self.sleep_mode = None

    # -- one step: execute_model, then sample_tokens ----------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> None:
        """Slots, inputs, forward, the sampling rows' logits and prompt logprobs, all launched; kept for
        `sample_tokens` (the engine fills grammar bits on the host meanwhile, docs/structured_outputs.md)."""
        self._update_slots(sched)
        rows, req_states = sched.rows, self.req_states
        slots = np.array([req_states.req_id_to_slot[r.request_id] for r in rows], dtype=np.int64)
        num_computed = np.array([r.num_computed_tokens for r in rows], dtype=np.int64)
        num_scheduled = np.array([r.num_scheduled_tokens for r in rows], dtype=np.int64)
        num_sampled = np.array([r.num_sampled_tokens for r in rows], dtype=np.int64)
        # Routing replay (MoE): a step with forced routes runs eagerly, the graphs being captured without them.
        forced = None
        if self.forced_routes is not None:
            qsl = np.concatenate(([0], np.cumsum(num_scheduled)))
            forced = self.forced_routes.for_step(slots, num_computed, qsl)
        batch = None
        if forced is None and self.graph_runner is not None and slots.shape[0] and num_scheduled.max() == 1:
            size = self.graph_runner.decode_size(slots.shape[0])  # a decode step: its graph's buffers directly
            if size is not None:
                batch = self.graph_runner.prepare_decode(slots, num_computed, num_sampled, size)
        if batch is None:
            batch = prepare_inputs(req_states, slots, num_computed, num_scheduled, num_sampled,
                                   self.config.block_size, self.sampler.trace)

        hidden = self._forward(batch, forced)  # [T, H]

        sample_rows = batch.host_sample_rows  # ascending row indices: all of them in a decode step
        req_ids = ([r.request_id for r in rows] if len(sample_rows) == len(rows)
                   else [rows[i].request_id for i in sample_rows.tolist()])
        step = _ExecutedStep(req_ids, self._prompt_logprobs(rows, batch, hidden))
        if len(batch.host_sample_rows) > 0:
            sampled_hidden = hidden if batch.every_token_sampled else hidden[batch.logits_indices]  # [S, H]
            step.logits = self.model.compute_logits(sampled_hidden)  # [S, V] model dtype or fp32
            step.sample_slots, step.host_sample_slots = batch.sample_slots, batch.host_sample_slots  # [S]
            # Fast replay or speculative rows: several positions (None: one each).
            step.multi_position = batch.multi_position
            if step.multi_position is not None and any(r.draft_token_ids for r in rows):
                step.multi_position = dataclasses.replace(step.multi_position,
                                                   draft_token_ids=_draft_checks(rows, batch, self.device))
        self._executed = step

    @torch.inference_mode()
    def sample_tokens(self, grammar: GrammarBitmask | None) -> AsyncModelRunnerOutput:
        """Sample the step `execute_model` launched and append its tokens on the device; its results start on
        their way to the host (`.get()` waits for them). No sampling row: the output is complete at once."""
        step, self._executed = self._executed, None
        if step is None:
            raise RuntimeError("sample_tokens needs a step launched by execute_model")
        if step.logits is None:
            return AsyncModelRunnerOutput(step.req_ids, step.prompt_logprobs)
        sampler_output = self.sampler(step.logits, step.sample_slots, step.host_sample_slots, self._slot_tokens,
                                      step.multi_position, grammar)
        self.req_states.append_sampled_device(step.sample_slots, sampler_output.sampled, step.multi_position,
                                              sampler_output.num_accepted)
        return AsyncModelRunnerOutput(step.req_ids, step.prompt_logprobs, sampler_output, step.host_sample_slots,
                                      self.req_states, step.multi_position)

    def _update_slots(self, sched: SchedulerOutput) -> None:
        """Free the slots of finished/preempted requests, add new ones, append blocks (and drafts) of running
        ones, then write everything staged to the device once."""
        self.free_requests(sched.freed_request_ids)
        req_states = self.req_states
        for row in sched.rows:
            if row.new_request is not None:
                self._add_request(row.new_request)
            elif row.new_block_ids or row.draft_token_ids:  # most decode rows: neither (no lookup, no call)
                slot = req_states.req_id_to_slot[row.request_id]
                req_states.append_blocks(slot, row.new_block_ids)
                if row.draft_token_ids:
                    req_states.stage_drafts(slot, row.draft_token_ids)
        self._apply_staged_writes()

    def _forward(self, batch: InputBatch, forced: torch.Tensor | None) -> torch.Tensor:
        """hidden [T, H]: a decode graph (a step from prepare_decode), a verify graph, piecewise graphs or eager.
        forced: routing replay's forced experts of the step's tokens, or None."""
        if batch.graph_size is not None:
            return self.graph_runner.run(batch, batch.graph_size)
        if forced is None:
            graph_size = self.graph_runner.padded_size(batch) if self.graph_runner is not None else None
            if graph_size is not None:  # a uniform verify step: replay the captured graph of that size
                return self.graph_runner.run(batch, graph_size)
            piece_size = self.piecewise.padded_size(batch) if self.piecewise is not None else None
            if piece_size is not None:  # any other step up to the largest piecewise size: graphs around attention
                return self.piecewise.run(batch, piece_size)
        routes = None if self.routed_experts is None else self.routed_experts.buffer
        with set_forward_context(ForwardContext(batch.attn, self.kv_caches, self.config.attention_backend,
                                                routed_experts=routes, forced_experts=forced)):
            return self.model(batch.input_ids, batch.positions)

    def _prompt_logprobs(self, rows, batch, hidden: torch.Tensor) -> dict[str, PromptLogprobsChunk]:
        result: dict[str, PromptLogprobsChunk] = {}
        wanted = np.flatnonzero(self.num_prompt_logprobs[batch.host_slots] >= 0)
        for i in wanted:  # only rows of requests that asked for prompt logprobs
            slot = int(batch.host_slots[i])
            start = int(batch.host_positions_start[i])
            prompt_len = int(self.req_states.prompt_len.host[slot])
            n = min(rows[i].num_scheduled_tokens, prompt_len - 1 - start)  # positions whose next is prompt
            if n <= 0:
                continue
            targets_np = self.req_states.host_token_ids[slot, start + 1 : start + 1 + n]
            targets = torch.from_numpy(targets_np.astype(np.int64)).to(self.device)
            k = int(self.num_prompt_logprobs[slot])
            lp, rank, ids, tlp = compute_prompt_logprobs(self.model, hidden, targets,
                                                         int(batch.host_query_start_loc[i]), n, k)
            result[rows[i].request_id] = PromptLogprobsChunk(start, targets_np.copy(), lp, rank, ids, tlp)
        return result


@dataclass
class _ExecutedStep:
    """What execute_model launched and sample_tokens needs: R sampling rows, S sampled positions."""

    req_ids: list[str]  # [R] the sampling rows' requests, in batch order
    prompt_logprobs: dict[str, PromptLogprobsChunk]
    logits: torch.Tensor | None = None  # [S, V]; None: no row samples this step
    sample_slots: torch.Tensor | None = None  # [S] int64 device, the slot of each sampled position
    host_sample_slots: np.ndarray | None = None  # [S] the same on the host
    multi_position: MultiPositionRows | None = None  # rows sampling several positions (None: one each)


def _draft_checks(rows, batch, device: torch.device) -> torch.Tensor:
    """[S] int64 device: for each sampled position, the draft fed right after it (what its sample must equal to
    be accepted), -1 at each row's last position. Rows without drafts have that one position."""
    checks = []
    for i in batch.host_sample_rows:
        drafts = rows[i].draft_token_ids
        checks.extend(drafts or ())
        checks.append(-1)
    return torch.tensor(checks, dtype=torch.int64).to(device, non_blocking=True)
