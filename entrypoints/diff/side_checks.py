"""One side checked against the traces and the diff's options from its resolved config alone, before any side runs:
what the engine (or transformers) would otherwise reject only after side A has spent its time."""

from __future__ import annotations

from dataclasses import dataclass

from .resolved import engine_resolved, hf_resolved
from .sides import DiffRequest, hf_settings
from .spec import ENGINE, FILE, HF, SideSpec, SpecError, engine_kwargs
from .trace_file import TraceFileError

# model_source's message for a model that is neither a folder nor a reachable hub id (its cause runs to lines).
_NOT_FOUND = "was not found: it is not a local directory"


@dataclass(frozen=True)
class CheckedSide:
    """What a side resolved to (resolved.py) and its vocabulary size (None: the `file` side)."""

    facts: dict
    vocab_size: int | None


def model_not_found(model: str, e: Exception) -> ValueError | None:
    """A one-line error for a model that is neither a local folder nor a cached / reachable hub model (the
    loader's own message carries the hub client's multi-line cause); None for any other error."""
    if _NOT_FOUND not in str(e):
        return None
    return ValueError(f"no such local folder {model!r}, and not a hub model found online or in the Hugging Face "
                      "cache")


def check_side(name: str, spec: SideSpec, requests: list[DiffRequest], model: str | None, top_k: int,
               full_vocab: bool) -> CheckedSide:
    """Validate one side against the traces; return what it resolved to."""
    where = f"side {name} ({spec.text!r})"
    if spec.kind == FILE:
        _check_file_side(where, requests, full_vocab)
        return CheckedSide({"source": "the trace file's stored logprobs (see the trace file's provenance)"}, None)
    try:
        if spec.kind == ENGINE:
            facts, limit, what, vocab = _engine_side(spec, model, top_k)
        elif spec.kind == HF:
            mc, device = hf_settings(spec, model)
            limit, what, vocab = mc.max_position_embeddings, "max_position_embeddings", mc.vocab_size
            facts = hf_resolved(mc, device, spec.options.get("attn_implementation"))
        else:
            raise SpecError(f"unknown kind {spec.kind!r}")
        if top_k > vocab:  # the engine would refuse `logprobs`, transformers' topk would fail, after side A ran
            raise SpecError(f"--top-k {top_k} is more than the model's vocabulary ({vocab} tokens)")
    except (TypeError, ValueError) as e:
        from replayllm.embedded_model import DEFAULT_MODEL

        short = model_not_found(spec.options.get("model") or model or DEFAULT_MODEL, e)
        raise SpecError(f"{where}: {short or e}") from e
    _check_lengths(where, requests, limit, what, vocab)
    return CheckedSide(facts, vocab)


def check_vocab_sizes(checked: tuple[CheckedSide, CheckedSide], sides: tuple[SideSpec, SideSpec]) -> None:
    """--full-vocab compares [V] rows position by position: both sides need the same V."""
    va, vb = (c.vocab_size for c in checked)
    if va is not None and vb is not None and va != vb:
        raise SpecError(f"--full-vocab needs one vocabulary on both sides: side A ({sides[0].text!r}) has {va} "
                        f"tokens, side B ({sides[1].text!r}) {vb} (drop --full-vocab for a top-k KL estimate)")


def _check_file_side(where: str, requests: list[DiffRequest], full_vocab: bool) -> None:
    if full_vocab:
        raise SpecError(f"{where}: --full-vocab needs both sides to compute whole distributions; a trace "
                        "file stores only per-token logprobs (drop --full-vocab for a top-k KL estimate)")
    missing = [r.record.where for r in requests if r.record.logprobs is None]
    if missing:
        raise TraceFileError(f"{where}: the 'file' side reads stored 'logprobs', which {missing[0]} lacks"
                             + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))


def _engine_side(spec: SideSpec, model: str | None, top_k: int):
    """(facts, context limit, its name, vocabulary size) of an engine side; ValueError for what its engine would
    refuse once running."""
    from replayllm.config import EngineConfig

    config = EngineConfig(**engine_kwargs(spec, model, top_k))
    if config.max_logprobs < top_k:  # each request asks for top_k alternatives (logprobs=top_k)
        raise SpecError(f"max_logprobs={config.max_logprobs} is less than the --top-k {top_k} the diff reads per "
                        f"position (raise max_logprobs or lower --top-k)")
    blocks = config.num_gpu_blocks_override
    if blocks is not None and blocks < config.max_blocks_per_seq:  # the engine's own rule (kv_cache.py)
        raise SpecError(f"num_gpu_blocks_override={blocks} blocks of {config.block_size} tokens are fewer than one "
                        f"sequence of max_model_len={config.max_model_len} needs ({config.max_blocks_per_seq}); "
                        f"raise num_gpu_blocks_override or lower max_model_len")
    return engine_resolved(config), config.max_model_len, "max_model_len", config.model_config.vocab_size


def _check_lengths(where: str, requests: list[DiffRequest], limit: int, what: str, vocab: int) -> None:
    for r in requests:
        n = len(r.prompt_token_ids) + len(r.trace_token_ids)
        if n > limit:
            raise TraceFileError(f"{r.record.where}: prompt + trace = {n} tokens exceed {what}={limit} of {where}")
        bad = [t for t in (*r.prompt_token_ids, *r.trace_token_ids) if t >= vocab]
        if bad:
            raise TraceFileError(f"{r.record.where}: token ids outside the vocabulary (size {vocab}) of {where}")
