"""Every attention path with a score modifier (GPT-OSS's sinks, BLOOM's ALiBi, a sliding window, Llama 4's chunks),
and a dense fp64 reference to check them against (tests/kernels/test_attention_sinks.py, tests/kernels/test_alibi.py,
tests/kernels/test_chunked_attention.py): 4 q heads on 2 KV heads of 16, 4-token blocks."""

from __future__ import annotations

import torch

from replayllm.kernels import decode_launch as dl
from replayllm.kernels.batch_invariant_attention import (
    paged_attention_invariant_torch,
    paged_attention_invariant_triton,
)
from replayllm.kernels.paged_attention import paged_decode_attention_triton, paged_prefill_attention_triton
from replayllm.model_runner_v2.attention import paged_attention_torch

HQ, HKV, D, BS = 4, 2, 16, 4


def dense_reference(q, kv, md, scale: float, window: int = 0, sinks: torch.Tensor | None = None,
                    alibi: torch.Tensor | None = None, chunk: int = 0) -> torch.Tensor:
    """Every query token's attention, one request at a time, in fp64: keys 0..p (and > p - window; with chunk,
    only those k with k // chunk == p // chunk); sinks: a
    column of one logit per head appended to the scores, its probability dropped; alibi: slope * key position
    added to the scaled scores (transformers' BLOOM form)."""
    out = torch.empty(q.shape, dtype=torch.float64)
    qsl, seq_lens = md.query_start_loc.tolist(), md.seq_lens.tolist()
    flat = kv.double().reshape(2, -1, HKV, D)
    for b, n in enumerate(seq_lens):
        slots = [int(md.block_tables[b, j // BS]) * BS + j % BS for j in range(n)]
        k, v = (flat[c][slots].repeat_interleave(HQ // HKV, 1) for c in (0, 1))  # [n, Hq, D]
        rows = q[qsl[b]:qsl[b + 1]].double()
        positions = torch.arange(n - rows.shape[0], n)
        kj = torch.arange(n)
        s = torch.einsum("qhd,khd->hqk", rows, k) * scale  # [Hq, Q, n]
        if alibi is not None:
            s = s + alibi.double().view(HQ, 1, 1) * kj
        seen = kj[None] <= positions[:, None]
        if window:
            seen &= kj[None] > positions[:, None] - window
        if chunk:
            seen &= kj[None] // chunk == positions[:, None] // chunk
        s = s.masked_fill(~seen, float("-inf"))
        if sinks is not None:
            column = sinks.double().view(HQ, 1, 1).expand(-1, s.shape[1], 1)
            p = torch.cat((s, column), -1).softmax(-1)[..., :-1]
        else:
            p = s.softmax(-1)
        out[qsl[b]:qsl[b + 1]] = torch.einsum("hqk,khd->qhd", p, v)
    return out


def every_path(q, kv, md, scale: float, monkeypatch, device: str, window: int = 0, **mods) -> dict[str, torch.Tensor]:
    """Each path's output on `device` (the torch ones on the CPU only): the prefill kernel, the batch-invariant
    kernel, and for one-token rows the decode kernel with one split, four splits (the reduce kernel) and the fused
    reduce. mods: `sinks=` / `alibi=` tensors, moved to the device; `chunk=` an int."""
    on = {"device": device}
    q_, kv_ = q.to(**on), kv.to(**on)
    mods_ = {k: v.to(**on) if isinstance(v, torch.Tensor) else v for k, v in mods.items()}
    tables, lens, qsl = md.block_tables.to(**on), md.seq_lens.to(**on), md.query_start_loc.to(**on)
    outs = {"prefill": paged_prefill_attention_triton(q_, kv_, qsl, lens, tables, scale, md.max_query_len,
                                                      window=window, **mods_),
            "invariant-triton": paged_attention_invariant_triton(q_, kv_, qsl, lens, tables, scale,
                                                                 md.max_query_len, window, **mods_)}
    if device == "cpu":
        outs["torch"] = paged_attention_torch(q, kv, md, scale, window=window, **mods)
        outs["invariant-torch"] = paged_attention_invariant_torch(q, kv, md.token_req_idx, md.positions,
                                                                  md.block_tables, scale, md.max_seq_len, window,
                                                                  **mods)
    if md.max_query_len == 1:
        for splits in (1, 4):
            outs[f"decode-{splits}"] = paged_decode_attention_triton(q_, kv_, lens, tables, scale, md.max_seq_len,
                                                                     splits, window=window, **mods_)
        monkeypatch.setattr(dl, "FUSED_REDUCE", True)
        monkeypatch.setattr(dl, "_COUNTERS", {})
        outs["decode-fused-reduce"] = paged_decode_attention_triton(q_, kv_, lens, tables, scale, md.max_seq_len,
                                                                    4, window=window, **mods_)
    return {name: out.cpu() for name, out in outs.items()}
