"""TokenColumns: one shard's replayed tokens as compact numpy arrays (what replicas send back and writers write)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TokenColumns:
    """R requests, T tokens in all (request after request), k alternatives per token (0: none asked).

    No per-token Python objects: a shard travels through Ray's object store as these few arrays and an
    out-of-order shard waits on disk as one .npz file."""

    lengths: np.ndarray  # [R] int64, tokens of each request (its trace length)
    token_ids: np.ndarray  # [T] int64, the trace token at each position
    logprobs: np.ndarray  # [T] float32, its logprob under the model's raw logits
    ranks: np.ndarray  # [T] int64, its 1-based rank (1 + tokens with a strictly larger logprob)
    top_ids: np.ndarray  # [T, k] int64, the k most likely tokens, best first
    top_logprobs: np.ndarray  # [T, k] float32, their logprobs

    @property
    def num_requests(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @classmethod
    def from_outputs(cls, outputs, k: int) -> TokenColumns:
        """RequestOutputs of trace-replayed requests (logprobs=k) -> columns, read from FlatLogprobs' flat
        storage without building a dict per token."""
        cols = [out.outputs[0].logprobs.columns() for out in outputs]
        lengths = np.array([len(c.token_ids) for c in cols], dtype=np.int64)
        t = int(lengths.sum())
        top_ids = np.fromiter((x for c in cols for x in c.topk_ids), dtype=np.int64, count=t * k)
        top_lps = np.fromiter((x for c in cols for x in c.topk_logprobs), dtype=np.float32, count=t * k)
        return cls(lengths,
                   np.fromiter((x for c in cols for x in c.token_ids), dtype=np.int64, count=t),
                   np.fromiter((x for c in cols for x in c.logprobs), dtype=np.float32, count=t),
                   np.fromiter((x for c in cols for x in c.ranks), dtype=np.int64, count=t),
                   top_ids.reshape(t, k), top_lps.reshape(t, k))

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "wb") as f:
            np.savez(f, **{name: getattr(self, name) for name in _FIELDS})

    @classmethod
    def load(cls, path: str | os.PathLike) -> TokenColumns:
        with np.load(path) as z:
            return cls(**{name: z[name] for name in _FIELDS})


_FIELDS = ("lengths", "token_ids", "logprobs", "ranks", "top_ids", "top_logprobs")
