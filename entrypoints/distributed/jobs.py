"""What a replica does with one shard: replay traces (ReplayJob), capture completions (CaptureJob) or score a
diff side (ScoreJob). Jobs and shards are small picklable dataclasses; Ray ships them to the actors."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..diff.capture import capture_inputs, capture_params, records_from_outputs
from ..diff.sides import score_batch
from .columns import TokenColumns
from .packed import PackedTraces


@dataclass(frozen=True)
class Shard:
    """Consecutive requests of the input: items[i] is request start + i of the whole set."""

    index: int  # 0, 1, ... in input order: results are merged by it
    start: int
    items: Any  # a list (capture, score), or PackedTraces (replay): len() and nothing else is assumed

    def __len__(self) -> int:
        return len(self.items)


OnShard = Callable[[Shard], None]  # a shard finished (in any order): progress


@dataclass(frozen=True)
class ReplayJob:
    """Replay each trace of a shard of PackedTraces; return the shard's tokens as TokenColumns (top-k: logprobs)."""

    logprobs: int

    def run(self, llm, shard: Shard) -> TokenColumns:
        from replayllm.sampling_params import SamplingParams

        packed: PackedTraces = shard.items
        prompts, traces, where = zip(*packed.requests())
        params = [SamplingParams(trace_decode_token_ids=t, logprobs=self.logprobs, detokenize=False) for t in traces]
        try:
            outputs = llm.generate(list(prompts), params, use_tqdm=False)
        except ValueError as e:
            raise ValueError(f"{_culprit(llm, prompts, params, where)}: {e}") from e
        for trace_token_ids, w, out in zip(traces, where, outputs):
            if out.outputs[0].token_ids != trace_token_ids:
                raise ValueError(f"{w}: the engine replayed {len(out.outputs[0].token_ids)} of "
                                 f"{len(trace_token_ids)} trace tokens (max_model_len too small?)")
        return TokenColumns.from_outputs(outputs, self.logprobs)


def _culprit(llm, prompts, params, where) -> str:
    """Which request a refused batch refused: the first whose own checks fail (the place each names), else the
    span."""
    for prompt, p, w in zip(prompts, params, where):
        try:
            llm.llm_engine.prepare_request(prompt, p)
        except ValueError:
            return w
    return f"{where[0]} .. {where[-1]}" if len(where) > 1 else where[0]


@dataclass(frozen=True)
class CaptureJob:
    """Generate a completion per prompt object; return TraceRecords. With temperature > 0 request i of the
    whole set samples with seed `seed + i`, so the traces do not depend on how the set was sharded."""

    max_tokens: int
    temperature: float
    top_k: int
    seed: int

    def run(self, llm, shard: Shard) -> list:
        if self.temperature > 0:
            params = [capture_params(self.max_tokens, self.temperature, self.top_k, self.seed + shard.start + i)
                      for i in range(len(shard))]
        else:
            params = capture_params(self.max_tokens, self.temperature, self.top_k)
        outputs = llm.generate(capture_inputs(shard.items), params, use_tqdm=False)
        return records_from_outputs(shard.items, outputs, self.top_k)


@dataclass(frozen=True)
class ScoreJob:
    """Score one engine side of a diff on a shard of DiffRequests; return their SideScores in order."""

    top_k: int
    full_vocab: bool

    def run(self, llm, shard: Shard) -> list:
        return score_batch(llm, shard.items, self.top_k, self.full_vocab)
