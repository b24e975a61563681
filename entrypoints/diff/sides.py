"""Running one side of a diff: engine replay in batches, transformers teacher-forced, or a trace file's logprobs."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from .routes import RouterRecorder, record_routes, softmax_top_k_routes
from .spec import ENGINE, FILE, HF, SideSpec, engine_kwargs
from .trace_file import TraceRecord

# With --full-vocab every scored position carries a [V] float32 row to the host; an engine batch is cut so
# these rows stay under this many bytes (a 150k vocabulary: ~3,500 positions per batch).
FULL_ROWS_BATCH_BYTES = 2 << 30


@dataclass(frozen=True)
class DiffRequest:
    """A trace with its prompt resolved to token ids: what every side scores."""

    id: str
    prompt_token_ids: list[int]
    trace_token_ids: list[int]
    record: TraceRecord  # the trace file's line (stored logprobs for the `file` side, error messages)
    # [len(prompt) + len(trace) - 1, num_layers, top_k] int16 routes an engine side is forced to replay
    # (SamplingParams.trace_routed_experts; --fix-routes); None: the model routes as usual.
    forced_routes: np.ndarray | None = field(default=None, compare=False)


@dataclass
class SideScores:
    """One request scored by one side; n = trace length, row i scores trace token i."""

    logprobs: np.ndarray  # [n] float64 (exact copies of the float32 the engine/transformers report)
    ranks: np.ndarray | None  # [n] int64, tokens with a logprob >= its own (vLLM's; None: unknown, `file`)
    top: list[dict[int, float]] | None  # [n] the side's top-k {token: logprob} (None: no top-k available)
    full: np.ndarray | None  # [n, V] float32 log-softmax rows (--full-vocab only)
    # [len(prompt) + n - 1, num_layers, top_k] int16 experts per routed position (MoE models; None: no routes)
    routes: np.ndarray | None = None


def run_side(spec: SideSpec, requests: list[DiffRequest], *, model: str | None, top_k: int, full_vocab: bool,
             batch_size: int, on_request: Callable[[], None] | None = None,
             facts: dict | None = None) -> Iterator[SideScores]:
    """Yield one SideScores per request, in order. Engines and transformers models are freed when done.
    facts: the side's resolved facts (resolved.py), completed with what only loading reveals (the attention
    implementation transformers picked)."""
    tick = on_request or (lambda: None)
    if spec.kind == ENGINE:
        return _run_engine(spec, requests, model, top_k, full_vocab, batch_size, tick)
    if spec.kind == HF:
        return _run_hf(spec, requests, model, top_k, full_vocab, tick, facts if facts is not None else {})
    if spec.kind == FILE:
        return _run_file(requests, tick)
    raise ValueError(f"unknown side kind {spec.kind!r}")


def free_device_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- engine ------------------------------------------------------------------------------------------------
def _run_engine(spec: SideSpec, requests: list[DiffRequest], model: str | None, top_k: int, full_vocab: bool,
                batch_size: int, tick: Callable[[], None]) -> Iterator[SideScores]:
    from replayllm.entrypoints.llm import LLM

    llm = LLM(**engine_kwargs(spec, model, top_k))
    try:
        vocab = llm.llm_engine.model_config.vocab_size
        for batch in batches(requests, batch_size, vocab * 4 if full_vocab else 0):
            for scores in score_batch(llm, batch, top_k, full_vocab):
                tick()
                yield scores
    finally:
        llm.llm_engine.shutdown()  # tensor-parallel workers (a no-op otherwise): the next side may start its own
        del llm
        free_device_memory()


def score_batch(llm, batch: list[DiffRequest], top_k: int, full_vocab: bool) -> list[SideScores]:
    """One engine batch: replay each request's trace, score every trace token (in batch order)."""
    from replayllm.sampling_params import SamplingParams

    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in batch]
    params = [SamplingParams(trace_decode_token_ids=r.trace_token_ids, logprobs=top_k, detokenize=False,
                             return_full_logprobs=full_vocab, trace_routed_experts=r.forced_routes) for r in batch]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    scores = []
    for req, out in zip(batch, outputs):
        comp = out.outputs[0]
        if comp.token_ids != req.trace_token_ids:
            raise ValueError(f"{req.record.where}: the engine replayed {len(comp.token_ids)} of "
                             f"{len(req.trace_token_ids)} trace tokens (max_model_len too small?)")
        scores.append(_engine_scores(comp, top_k))
    return scores


def batches(requests: list[DiffRequest], batch_size: int, row_bytes: int) -> Iterator[list[DiffRequest]]:
    """Consecutive batches of at most batch_size requests (and, for full rows, at most FULL_ROWS_BATCH_BYTES)."""
    batch: list[DiffRequest] = []
    used = 0
    for req in requests:
        need = row_bytes * len(req.trace_token_ids)
        if batch and (len(batch) == batch_size or used + need > FULL_ROWS_BATCH_BYTES):
            yield batch
            batch, used = [], 0
        batch.append(req)
        used += need
    if batch:
        yield batch


def _engine_scores(comp, top_k: int) -> SideScores:
    n = len(comp.token_ids)
    logprobs = np.empty(n, dtype=np.float64)
    ranks = np.empty(n, dtype=np.int64)
    top: list[dict[int, float]] | None = [] if top_k > 0 else None
    for i, (token, d) in enumerate(zip(comp.token_ids, comp.logprobs)):
        logprobs[i] = d[token].logprob
        ranks[i] = d[token].rank
        if top is not None:  # the top-k entries (the forced token too when it is among them)
            top.append({t: lp.logprob for t, lp in d.items() if lp.rank <= top_k})
    full = np.stack(comp.full_logprobs) if comp.full_logprobs is not None else None
    return SideScores(logprobs, ranks, top, full, comp.routed_experts)  # routes: with enable_return_routed_experts


# -- transformers ------------------------------------------------------------------------------------------
def _run_hf(spec: SideSpec, requests: list[DiffRequest], model: str | None, top_k: int, full_vocab: bool,
            tick: Callable[[], None], facts: dict) -> Iterator[SideScores]:
    mc, device = hf_settings(spec, model)
    hf = load_hf_model(mc, device, **hf_model_options(spec))
    facts["attn_implementation"] = getattr(hf.config, "_attn_implementation", None)
    if mc.is_moe:
        facts["experts_implementation"] = getattr(hf.config, "_experts_implementation", None)
    # a MoE model's routers record what they chose in each forward (routes.RouterRecorder)
    recorder = RouterRecorder(hf, mc.moe_layers, softmax_top_k_routes(mc)) if mc.is_moe else None
    try:
        with recorder or contextlib.nullcontext():
            for req in requests:  # one request per forward: no padding, the plain training-side computation
                try:
                    rows = teacher_forced_logprobs(hf, req.prompt_token_ids, req.trace_token_ids)
                except RuntimeError as e:  # transformers' own kernels (grouped_mm's stride rule in bf16, ...)
                    hint = ("; its experts' default grouped kernel may refuse these shapes: try the SPEC's "
                            "experts_implementation=eager or dtype=float32") if mc.is_moe else ""
                    raise ValueError(f"side {spec.text!r}: transformers' forward failed on request "
                                     f"{req.record.id!r}: {str(e).splitlines()[0]}{hint}") from e
                scores = scores_from_rows(rows, req.trace_token_ids, top_k, full_vocab)
                if recorder is not None:  # the routes of every position the engine reports (prompt + trace - 1)
                    rows_routed = len(req.prompt_token_ids) + len(req.trace_token_ids) - 1
                    scores.routes = recorder.routes(mc.num_experts_per_tok, mc.num_layers, rows_routed)
                del rows
                tick()
                yield scores
    finally:
        del hf
        free_device_memory()


def hf_settings(spec: SideSpec, model: str | None):
    """(ModelConfig, torch.device) of an `hf` side, validated without loading weights. The model defaults to
    the diff's MODEL, dtype "auto" follows the engine's rule (the checkpoint's dtype), device "auto" is cuda
    when available, else cpu. Raises ValueError for a bad model, dtype or device."""
    import torch

    from replayllm.config import ModelConfig
    from replayllm.embedded_model import DEFAULT_MODEL

    mc = ModelConfig.from_pretrained(spec.options.get("model") or model or DEFAULT_MODEL,
                                     dtype=spec.options.get("dtype", "auto"))
    device = spec.options.get("device", "auto")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        torch_device = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"device {device!r} is not a valid torch device") from e
    if torch_device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but CUDA is not available")
    return mc, torch_device


def hf_model_options(spec: SideSpec) -> dict[str, str]:
    """The `hf` side's options that choose transformers' implementations (load_hf_model's keyword arguments)."""
    return {k: spec.options[k] for k in ("attn_implementation", "experts_implementation") if k in spec.options}


def load_hf_model(mc, device, attn_implementation: str | None = None, experts_implementation: str | None = None):
    """The transformers causal LM of checkpoint `mc.path` in `mc.dtype`, on `device`, in eval mode, with
    transformers' attention `attn_implementation` ("eager", "sdpa"; None: transformers' default, except "eager" for
    a model with soft-capped attention scores (Gemma 2): only transformers' eager attention applies the cap, and
    some releases (5.17, session 33) default to another one, which scores another model; 5.25 picks eager), and a
    MoE model's experts `experts_implementation` ("eager": the per-expert loop that defines the model; None:
    transformers' default)."""
    import transformers

    if attn_implementation is None and getattr(mc.hf_config, "attn_logit_softcapping", None):
        attn_implementation = "eager"

    # transformers >= 4.56 names the argument `dtype`; older releases `torch_dtype`.
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    kwargs = {"dtype" if (major, minor) >= (4, 56) else "torch_dtype": mc.dtype}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if experts_implementation is not None:
        kwargs["experts_implementation"] = experts_implementation
    try:
        hf = transformers.AutoModelForCausalLM.from_pretrained(mc.path, **kwargs)
    except ValueError as e:  # a multimodal checkpoint transformers runs only as image-text-to-text (Qwen2-VL,
        if "Unrecognized configuration class" not in str(e):  # GLM-4.5V, ...): that class, fed text alone
            raise
        hf = transformers.AutoModelForImageTextToText.from_pretrained(mc.path, **kwargs)
    return hf.to(device).eval()


def teacher_forced_logprobs(model, prompt: list[int], trace: list[int]):
    """Teacher-forced log_softmax as a training framework computes it: one forward over prompt + trace;
    row i ([n, V] float32, on the model's device) is the distribution that scores trace[i]
    (logits at position len(prompt) - 1 + i, which sees prompt + trace[:i])."""
    import torch

    with torch.no_grad():
        ids = torch.tensor([prompt + trace], device=model.device)
        logits = model(ids).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(trace)]  # [n, V]
        return logits.float().log_softmax(-1)


def scores_from_rows(rows, trace: list[int], top_k: int, keep_full: bool) -> SideScores:
    """[n, V] log-softmax rows (torch, any device) -> SideScores; rank as the engine defines it."""
    import torch

    with torch.no_grad():
        ids = torch.tensor(trace, device=rows.device)[:, None]
        token_lp = rows.gather(1, ids)  # [n, 1]
        ranks = (rows >= token_lp).sum(-1)
        top = None
        if top_k > 0:
            values, indices = rows.topk(top_k, dim=-1)
            top = [dict(zip(i, v)) for i, v in zip(indices.cpu().tolist(), values.cpu().tolist())]
        full = rows.cpu().numpy() if keep_full else None
        return SideScores(token_lp[:, 0].double().cpu().numpy(), ranks.cpu().numpy(), top, full)


# -- trace file --------------------------------------------------------------------------------------------
def _run_file(requests: list[DiffRequest], tick: Callable[[], None]) -> Iterator[SideScores]:
    for req in requests:
        rec = req.record
        if rec.logprobs is None:  # checked before anything runs; kept here for direct callers
            raise ValueError(f"{rec.where}: the 'file' side needs stored 'logprobs'")
        tick()
        yield SideScores(np.asarray(rec.logprobs, dtype=np.float64), None, rec.top_logprobs, None,
                         record_routes(rec.routed_experts))
