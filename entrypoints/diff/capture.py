"""capture(): run prompts through one engine config and turn the completions into trace records."""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .resolved import engine_resolved, versions
from .sides import free_device_memory
from .trace_file import TraceRecord

_PROMPT_KEYS = ("id", "prompt", "prompt_token_ids")


def check_out_file(path: str | os.PathLike) -> None:
    """The trace file can be written (capture runs it before generating, so a bad --out costs no engine time);
    nothing is created. Raises ValueError in one line."""
    name = os.fspath(path)
    parent = os.path.dirname(os.path.abspath(name))
    if os.path.isdir(name):
        raise ValueError(f"cannot write the trace file {name!r}: it is a folder")
    if not os.path.isdir(parent):
        raise ValueError(f"cannot write the trace file {name!r}: no folder {parent!r}")
    try:  # a probe file, not os.access: root passes os.access on read-only mounts and /proc
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as e:
        raise ValueError(f"cannot write the trace file {name!r}: {e.strerror or type(e).__name__}") from None


def read_prompts(path: str | os.PathLike) -> list[dict[str, Any]]:
    """A prompts file -> [{"id", "prompt" | "prompt_token_ids"}].

    `.txt`: one prompt per non-blank line (ids "0", "1", ... in order). `.jsonl`: one JSON value per non-blank
    line, either a string or an object with `prompt` (text) or `prompt_token_ids`, and optionally `id`.
    Raises ValueError naming the file and line.
    """
    name = os.fspath(path)
    ext = os.path.splitext(name)[1].lower()
    if ext not in (".txt", ".jsonl"):
        raise ValueError(f"prompts file {name!r}: expected a .txt (one prompt per line) or .jsonl file")
    try:
        with open(name, encoding="utf-8-sig") as f:  # a BOM (Windows editors) is not part of the first prompt
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read prompts file {name!r}: {e}") from e
    prompts: list[dict[str, Any]] = []
    seen: dict[str, str] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        if ext == ".txt":
            prompts.append({"id": str(len(prompts)), "prompt": line})
            continue
        try:
            prompts.append(_prompt_object(json.loads(line), len(prompts)))
        except (json.JSONDecodeError, ValueError) as e:
            msg = f"not valid JSON ({e.msg} at column {e.colno})" if isinstance(e, json.JSONDecodeError) else e
            raise ValueError(f"{name} line {number}: {msg}") from None
        _check_unique(prompts, seen, f"{name} line {number}", f"line {number}")
    if not prompts:
        raise ValueError(f"prompts file {name!r} holds no prompts")
    return prompts


def _check_unique(prompts: list[dict[str, Any]], seen: dict[str, str], where: str, label: str) -> None:
    """The last prompt's id is new (seen: id -> where it first came, e.g. "line 3"); a trace file's ids are unique."""
    rid = prompts[-1]["id"]
    if rid in seen:
        raise ValueError(f"{where}: duplicate prompt id {rid!r} (first on {seen[rid]})")
    seen[rid] = label


def _prompt_object(obj: Any, index: int) -> dict[str, Any]:
    if isinstance(obj, str):
        obj = {"prompt": obj}
    if not isinstance(obj, dict):
        raise ValueError(f"expected a string or an object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(_PROMPT_KEYS))
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(map(repr, unknown))}; allowed keys: {', '.join(_PROMPT_KEYS)}")
    if ("prompt" in obj) == ("prompt_token_ids" in obj):
        raise ValueError("needs exactly one of 'prompt' (text) and 'prompt_token_ids'")
    if "prompt" in obj and (not isinstance(obj["prompt"], str) or not obj["prompt"]):
        raise ValueError(f"'prompt' must be a non-empty string, got {obj['prompt']!r}")
    ids = obj.get("prompt_token_ids")
    if ids is not None and (not isinstance(ids, list) or not ids
                            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)):
        raise ValueError("'prompt_token_ids' must be a non-empty list of non-negative integer token ids")
    rid = obj.get("id", str(index))
    if isinstance(rid, bool) or not isinstance(rid, (str, int)) or rid == "":
        raise ValueError(f"'id' must be a non-empty string or an integer, got {rid!r}")
    return {**obj, "id": str(rid)}


@dataclass(frozen=True)
class Capture:
    """What capture_run returns: the trace records and their provenance (the trace file's header)."""

    records: list[TraceRecord]
    provenance: dict[str, Any]


def capture(prompts: Sequence[str | dict[str, Any]], *, model: str | None = None, max_tokens: int = 64,
            temperature: float = 0.0, top_k: int = 5, progress: bool = False,
            **engine_options: Any) -> list[TraceRecord]:
    """capture_run(...).records."""
    return capture_run(prompts, model=model, max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                       progress=progress, **engine_options).records


def capture_run(prompts: Sequence[str | dict[str, Any]], *, model: str | None = None, max_tokens: int = 64,
                temperature: float = 0.0, top_k: int = 5, progress: bool = False,
                **engine_options: Any) -> Capture:
    """Generate a completion for every prompt with one engine (`LLM(model, **engine_options)`) and return
    trace records holding the prompt token ids, the generated tokens, the engine's logprob of each (and its
    top-k alternatives when top_k > 0). Greedy by default; with temperature > 0 each request's sampling seed
    is drawn from the engine option `seed` (so a run is reproducible). The engine is freed before returning.
    The provenance records the model, the engine's resolved config, the versions and these settings.
    With enable_return_routed_experts=True (a MoE model) each record also stores its routed_experts.
    """
    from replayllm.entrypoints.llm import LLM

    items = check_prompts(prompts)
    engine_options.setdefault("max_logprobs", max(top_k, 0))
    llm = LLM(model, **engine_options)
    provenance = capture_provenance(engine_resolved(llm.llm_engine.config), max_tokens, temperature, top_k)
    if engine_options.get("enable_return_routed_experts"):  # the records store routes (a MoE model)
        provenance["capture"]["routed_experts"] = True
    try:
        outputs = llm.generate(capture_inputs(items), capture_params(max_tokens, temperature, top_k),
                               use_tqdm=progress)
    finally:
        del llm
        free_device_memory()
    return Capture(records_from_outputs(items, outputs, top_k), provenance)


def check_prompts(prompts: Sequence[str | dict[str, Any]]) -> list[dict[str, Any]]:
    """Prompts (strings or {"prompt" | "prompt_token_ids", "id"}) -> validated objects with unique string ids."""
    items: list[dict[str, Any]] = []
    seen: dict[str, str] = {}
    for i, p in enumerate(prompts):
        items.append(_prompt_object(p, i))
        _check_unique(items, seen, f"prompts[{i}]", f"prompts[{i}]")
    if not items:
        raise ValueError("capture needs at least one prompt")
    return items


def capture_provenance(engine: dict[str, Any], max_tokens: int, temperature: float, top_k: int) -> dict[str, Any]:
    """The trace file's header: the model, the engine's resolved config (resolved.engine_resolved), the
    versions and the settings."""
    return {
        "tool": "replayllm capture",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model": engine["model"],
        "engine": engine,
        "versions": versions(),
        "capture": {"max_tokens": max_tokens, "temperature": temperature, "seed": engine["seed"], "top_k": top_k},
    }


def capture_inputs(items: list[dict[str, Any]]) -> list:
    return [{"prompt_token_ids": p["prompt_token_ids"]} if "prompt_token_ids" in p else p["prompt"] for p in items]


def capture_params(max_tokens: int, temperature: float, top_k: int, seed: int | None = None):
    from replayllm.sampling_params import SamplingParams

    return SamplingParams(temperature=temperature, max_tokens=max_tokens, logprobs=top_k, seed=seed)


def records_from_outputs(items: list[dict[str, Any]], outputs, top_k: int) -> list[TraceRecord]:
    """One TraceRecord per (prompt object, RequestOutput): the completion as the trace, with its logprobs."""
    records = []
    for item, out in zip(items, outputs):
        comp = out.outputs[0]
        lps = comp.logprobs
        records.append(TraceRecord(
            id=item["id"], trace_token_ids=list(comp.token_ids), prompt=item.get("prompt"),
            prompt_token_ids=list(out.prompt_token_ids),
            logprobs=[d[t].logprob for t, d in zip(comp.token_ids, lps)],
            top_logprobs=[{t: lp.logprob for t, lp in d.items() if lp.rank <= top_k} for d in lps] if top_k else None,
            meta={"text": comp.text, "finish_reason": comp.finish_reason},
            # [prompt + trace - 1, num_layers, top_k] with enable_return_routed_experts on a MoE model, else None
            routed_experts=None if comp.routed_experts is None else comp.routed_experts.tolist(),
        ))
    return records
