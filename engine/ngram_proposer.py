"""NgramProposer: drafts for one decoding request by prompt lookup (vLLM's "ngram" speculative method)."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..speculative_config import SpeculativeConfig


class NgramProposer:
    """Host-side, numpy. For n from prompt_lookup_max down to prompt_lookup_min: the last n tokens of
    prompt + output are the pattern; its earliest earlier occurrence (vLLM's choice) proposes the up to k
    tokens that followed it. The first n with a match wins (longest first); none: no drafts."""

    def __init__(self, config: SpeculativeConfig):
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, token_ids: list[int], max_drafts: int) -> list[int]:
        """Up to min(k, max_drafts) drafted tokens to follow `token_ids` (possibly none). Cost: one
        [L - n, n] window comparison per n tried (views, no copies of the windows)."""
        limit = min(self.k, max_drafts)
        num_tokens = len(token_ids)
        if limit <= 0 or num_tokens <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)  # [L]
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            pattern = tokens[num_tokens - n :]  # [n]
            # Windows starting at 0 .. L-n-1: each is followed by at least one token, and none is the suffix.
            windows = sliding_window_view(tokens[: num_tokens - 1], n)  # [L - n, n]
            hits = np.flatnonzero((windows == pattern).all(axis=1))
            if hits.size:
                start = int(hits[0]) + n
                return tokens[start : start + limit].tolist()
        return []
