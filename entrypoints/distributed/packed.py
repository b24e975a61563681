"""PackedTraces: what a replay shard's replica needs of its TraceRecords, as a few flat arrays (cheap to ship)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from ..diff.trace_file import TraceRecord


@dataclass(frozen=True)
class PackedTraces:
    """R traces of one shard. Ray pickles a shard to send it: as TraceRecords that is one Python int object per
    token (~15 ms for W3's 64 x 2,112 ids on the 2-core CPU machine, each way), plus the reference logprobs and
    top-k dicts of a captured trace file, which a replay never reads; as arrays it is a copy of the bytes.

    Token ids stay int64 (a trace's out-of-range id must reach the engine's own error unchanged)."""

    where: list[str]  # [R] TraceRecord.where, for error messages
    prompts: list[str | None]  # [R] the prompt text of records without prompt_token_ids, else None
    prompt_lengths: np.ndarray  # [R] int64, tokens of each prompt_token_ids (0 where the prompt is text)
    prompt_ids: np.ndarray  # [sum(prompt_lengths)] int64, the prompts' token ids, record after record
    trace_lengths: np.ndarray  # [R] int64
    trace_token_ids: np.ndarray  # [sum(trace_lengths)] int64, the traces, record after record

    @classmethod
    def of(cls, records: Sequence[TraceRecord]) -> PackedTraces:
        prompts = [r.prompt if r.prompt_token_ids is None else None for r in records]
        prompt_lists = [r.prompt_token_ids or () for r in records]
        return cls([r.where for r in records], prompts,
                   np.array([len(p) for p in prompt_lists], dtype=np.int64), _flat(prompt_lists),
                   np.array([len(r.trace_token_ids) for r in records], dtype=np.int64),
                   _flat([r.trace_token_ids for r in records]))

    def __len__(self) -> int:
        return len(self.where)

    def requests(self) -> Iterator[tuple[dict | str, list[int], str]]:
        """(engine prompt: {"prompt_token_ids": [...]} or the text, the trace as a list, where) per record."""
        p_end = np.cumsum(self.prompt_lengths).tolist()
        t_end = np.cumsum(self.trace_lengths).tolist()
        p_start = t_start = 0
        for i, where in enumerate(self.where):
            text = self.prompts[i]
            prompt = text if text is not None else {"prompt_token_ids": self.prompt_ids[p_start:p_end[i]].tolist()}
            yield prompt, self.trace_token_ids[t_start:t_end[i]].tolist(), where
            p_start, t_start = p_end[i], t_end[i]


def _flat(lists: Sequence[Sequence[int]]) -> np.ndarray:
    total = sum(len(x) for x in lists)
    return np.fromiter((t for x in lists for t in x), dtype=np.int64, count=total)
