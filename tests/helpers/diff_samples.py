"""A DiffResult built by hand for report tests: markup in ids and token texts, a flip, None values, top-k."""

from __future__ import annotations

from replayllm.entrypoints.diff import DiffResult, DiffStats, RequestDiff, TokenDiff, parse_spec
from replayllm.entrypoints.diff.results import Flip, noise_threshold

EVIL = "<script>alert(1)</script>"


def synthetic_result() -> DiffResult:
    """Two requests whose ids and token texts are markup; one flip; top-k alternatives with markup text."""
    texts = {7: EVIL, 8: "&amp; \"quoted\" 'x'", 9: "", 10: "</script><img src=x onerror=alert(2)>"}
    tokens = {
        "<b>r0</b>": [TokenDiff("<b>r0</b>", i, token=7 + i % 3, text=texts[7 + i % 3], logprob_a=-1.0,
                                logprob_b=-1.0 + 0.01 * i, rank_a=1, rank_b=1, top1_a=7, top1_b=7, kl=0.001,
                                top_a=((7, -1.0), (10, -2.0)), top_b=((7, -0.9), (10, -2.5))) for i in range(4)],
        "r1": [TokenDiff("r1", 0, token=10, text=texts[10], logprob_a=-0.5, logprob_b=-0.7, rank_a=1, rank_b=2,
                         top1_a=10, top1_b=8, kl=0.2, top_a=((10, -0.5),), top_b=((8, -0.6), (10, -0.7))),
               TokenDiff("r1", 1, token=11, text=None, logprob_a=-3.0, logprob_b=-3.0, rank_a=4, rank_b=4,
                         top1_a=None, top1_b=None, kl=0.0)],
    }
    all_tokens = [t for ts in tokens.values() for t in ts]
    noise = noise_threshold(all_tokens, 10.0)
    reqs = [RequestDiff(rid, ts, DiffStats.of(ts, 1e-3, noise)) for rid, ts in tokens.items()]
    flip = Flip("r1", 0, 10, texts[10], 10, 8, texts[10], texts[8], 1, 2, -0.2)
    return DiffResult(model="m<script>", a=parse_spec("dtype=float32"), b=parse_spec("dtype=bfloat16"), traces=None,
                      top_k=2, full_vocab=False, threshold=1e-3, kl_method="top-k estimate (k=1)", requests=reqs,
                      overall=DiffStats.of(all_tokens, 1e-3, noise), seconds_a=0.0, seconds_b=0.0,
                      noise_threshold=noise, flips=[flip], resolved_a={"dtype": "float32", "device": EVIL},
                      resolved_b={"dtype": "bfloat16", "device": "cpu"},
                      provenance={"model": EVIL, "capture": {"note": "</script>"}}, token_texts=texts)
