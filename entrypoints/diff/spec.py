"""SPEC parsing: which side to run — engine options `k=v,k=v`, `hf[:k=v,...]` (transformers) or `file`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ENGINE, HF, FILE = "engine", "hf", "file"
# Engine defaults: `default` (or an empty option list) is the engine with none of its options changed.
DEFAULT_SPEC = "default"
# Options of the transformers side. `model` defaults to the diff's MODEL, `dtype` to "auto" (the checkpoint's
# dtype, as the engine resolves it), `device` to "auto" (cuda when available, else cpu), `attn_implementation`
# to transformers' own choice (sdpa where available), `experts_implementation` (a MoE model's experts: "eager" is
# transformers' per-expert loop, the model's definition) to transformers' own choice (grouped_mm in 5.x).
HF_OPTIONS = ("model", "dtype", "device", "attn_implementation", "experts_implementation")
HF_ATTN_IMPLEMENTATIONS = ("eager", "sdpa")
HF_EXPERTS_IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")
# The diff always replays traces; these are set for every engine side and may not be turned off.
_FORCED = {"enable_trace_replay": True}


class SpecError(ValueError):
    """A SPEC string is malformed or names an unknown option."""


@dataclass(frozen=True)
class SideSpec:
    """One side of a diff. `options` are typed values: EngineConfig fields (engine) or HF_OPTIONS (hf)."""

    kind: str  # ENGINE | HF | FILE
    options: dict[str, Any] = field(default_factory=dict)
    text: str = DEFAULT_SPEC  # as given on the command line

    def __str__(self) -> str:
        return self.text


def parse_spec(text: str) -> SideSpec:
    """`dtype=bfloat16,max_model_len=512` | `default` | `hf` | `hf:dtype=bfloat16` | `file` -> SideSpec.

    Engine option values are parsed as the command line parses the same flags (entrypoints/cli/engine_args.py):
    typed from the EngineConfig field (`true`/`false` for bools, `none` for optional fields, a Literal's
    choices checked); the rest is validated by EngineConfig itself, so every option the engine accepts
    (including ones added later) works here without changes.
    """
    if not isinstance(text, str):
        raise SpecError(f"a SPEC must be a string, got {type(text).__name__}")
    spec = text.strip()
    if not spec:
        raise SpecError(f"empty SPEC; use {DEFAULT_SPEC!r} for the engine with default options")
    head, sep, rest = spec.partition(":")
    if head == FILE:
        if sep:
            raise SpecError(f"SPEC {text!r}: 'file' takes no options (it reads the logprobs stored in the traces)")
        return SideSpec(FILE, {}, spec)
    if head == HF:
        options = _pairs(text, rest) if sep else {}
        unknown = sorted(set(options) - set(HF_OPTIONS))
        if unknown:
            raise SpecError(f"SPEC {text!r}: unknown option(s) {', '.join(unknown)} for 'hf'; "
                            f"allowed: {', '.join(HF_OPTIONS)}")
        for key, allowed in (("attn_implementation", HF_ATTN_IMPLEMENTATIONS),
                             ("experts_implementation", HF_EXPERTS_IMPLEMENTATIONS)):
            if options.get(key) is not None and options[key] not in allowed:
                raise SpecError(f"SPEC {text!r}: {key}={options[key]!r} is not one of {', '.join(allowed)}")
        return SideSpec(HF, options, spec)
    if spec == DEFAULT_SPEC:
        return SideSpec(ENGINE, {}, spec)
    if "=" not in spec:
        raise SpecError(f"SPEC {text!r} is not understood: expected comma-separated engine options "
                        f"(e.g. 'dtype=bfloat16,max_model_len=512'), {DEFAULT_SPEC!r}, 'hf', 'hf:dtype=...' or 'file'")
    return SideSpec(ENGINE, _engine_options(text, _pairs(text, spec)), spec)


def engine_kwargs(spec: SideSpec, model: str | None, top_k: int) -> dict[str, Any]:
    """LLM(...) keyword arguments for an engine side: the spec's options over the diff's defaults (prompts
    arrive as token ids, so no tokenizer; max_logprobs = the diff's top-k)."""
    kwargs: dict[str, Any] = {"model": model, "skip_tokenizer_init": True, "max_logprobs": top_k}
    kwargs.update(spec.options)
    kwargs.update(_FORCED)
    return kwargs


def _pairs(text: str, body: str) -> dict[str, str]:
    """`k=v,k=v` -> {k: v} (raw strings). Dashes in keys become underscores (`max-model-len` works too)."""
    out: dict[str, str] = {}
    for part in body.split(","):
        part = part.strip()
        key, eq, value = part.partition("=")
        key = key.strip().replace("-", "_")
        if not part or not eq or not key:
            raise SpecError(f"SPEC {text!r}: {part!r} is not of the form key=value")
        if key in out:
            raise SpecError(f"SPEC {text!r}: option {key!r} is given twice")
        out[key] = value.strip()
    return out


def _engine_options(text: str, raw: dict[str, str]) -> dict[str, Any]:
    """Raw `k=v` strings -> typed EngineConfig options, parsed as the command line parses the same flags
    (entrypoints/cli/engine_args.py: one typed path for flags, --config files and SPECs)."""
    from replayllm.entrypoints.cli.config_options import closest
    from replayllm.entrypoints.cli.engine_args import engine_options

    options = {opt.name: opt for opt in engine_options()}
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in options:
            hint = closest(key, list(options))
            raise SpecError(f"SPEC {text!r}: unknown engine option {key!r}"
                            + (f" (did you mean {hint!r}?)" if hint else "")
                            + f"; engine options: {', '.join(options)}")
        try:
            out[key] = options[key].parse(value)
        except ValueError as e:
            raise SpecError(f"SPEC {text!r}: option {key}={value!r}: {e}") from None
    for key, forced in _FORCED.items():
        if key in out and out[key] != forced:
            raise SpecError(f"SPEC {text!r}: {key} cannot be {out[key]!r} (the diff replays traces)")
    return out
