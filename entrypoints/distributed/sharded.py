"""capture and diff under data parallelism: the same work as entrypoints/diff/'s, spread over replicas by
shard."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from typing import Any

from ..diff.capture import capture_provenance, check_prompts
from ..diff.sides import DiffRequest, SideScores
from ..diff.spec import SideSpec, engine_kwargs
from ..diff.trace_file import PROVENANCE_KEY
from .jobs import CaptureJob, ScoreJob, Shard
from .options import ScaleOut
from .pool import default_max_num_seqs, make_pool


def shards_of(items: Sequence[Any], size: int):
    for index, start in enumerate(range(0, len(items), size)):
        yield Shard(index, start, list(items[start : start + size]))


def capture_to_file(prompts: Sequence[str | dict[str, Any]], out: str | os.PathLike, scale_out: ScaleOut, *,
                    model: str | None = None, max_tokens: int = 64, temperature: float = 0.0, top_k: int = 5,
                    on_request: Callable[[], None] | None = None, **engine_options: Any) -> tuple[int, int]:
    """`replayllm capture` on replicas: the trace file (provenance header first) is written shard by shard in
    prompt order. With temperature > 0 prompt i samples with seed `seed + i`, whatever the sharding. Returns
    (traces, tokens) written."""
    from replayllm.config import EngineConfig

    items = check_prompts(prompts)
    engine_options.setdefault("max_logprobs", max(top_k, 0))
    seed = engine_options.get("seed", EngineConfig.seed)
    size = scale_out.shard_size_for(len(items), default_max_num_seqs(engine_options))
    counts = [0, 0]
    with make_pool(scale_out, model, engine_options) as pool, open(os.fspath(out), "w", encoding="utf-8") as f:
        provenance = capture_provenance(pool.resolved(), max_tokens, temperature, top_k)
        provenance["capture"]["data_parallel_size"] = scale_out.data_parallel_size
        f.write(json.dumps({PROVENANCE_KEY: provenance}, ensure_ascii=False, allow_nan=False) + "\n")

        def deliver(_index: int, records: list) -> None:
            for record in records:
                f.write(json.dumps(record.to_json(), ensure_ascii=False, allow_nan=False) + "\n")
                counts[0] += 1
                counts[1] += len(record.trace_token_ids)

        pool.run(CaptureJob(max_tokens, temperature, top_k, seed), shards_of(items, size), deliver,
                 on_shard=_ticks(on_request))
    return counts[0], counts[1]


def score_side(spec: SideSpec, requests: list[DiffRequest], scale_out: ScaleOut, *, model: str | None, top_k: int,
               full_vocab: bool, batch_size: int, on_request: Callable[[], None] | None = None) -> list[SideScores]:
    """One engine side of a diff on replicas: SideScores per request, in order (shards of batch_size)."""
    options = engine_kwargs(spec, model, top_k)
    model = options.pop("model")
    size = scale_out.shard_size or batch_size
    scores: list[SideScores] = []
    with make_pool(scale_out, model, options) as pool:
        pool.run(ScoreJob(top_k, full_vocab), shards_of(requests, size), lambda _i, part: scores.extend(part),
                 on_shard=_ticks(on_request))
    return scores


def _ticks(on_request: Callable[[], None] | None):
    if on_request is None:
        return None

    def on_shard(shard: Shard) -> None:
        for _ in range(len(shard)):
            on_request()

    return on_shard
