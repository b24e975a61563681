"""Structured outputs' host cost per decode step, without a model: the engine's grammar calls on 256 JSON-schema rows.

Usage: python3 bench/grammar_host_cost.py [--rows 256 --steps 256 --threads 1,2,4 --start string --pick random]
       [--impl workers|xgrammar-pool]

Builds the engine's StructuredOutputManager with the embedded model's Qwen tokenizer (151,936-wide logits, as
bench/structured_bench.py) and one grammar per row for that bench's schema, then runs `--steps` steps of what the
engine does on the host per structured decode step: `grammar_bitmask` (the Python row pass, then the fill),
the sampler's host->tensor buffer work (torch.from_numpy; the copy and the mask kernel run on the device there),
a token per row drawn under the mask (stands in for the model, not timed), and the scheduler's `accept_tokens`
plus its per-row end check. Prints ms/step and us/row per part, per thread count.
--start string: every row starts inside a JSON string ('{"name": "'), xgrammar's slow fill path (nearly every
token allowed), where greedy decoding on random weights can stay for the whole run; --start "" starts at '{'.
--pick random: a uniformly random allowed token; greedy: the argmax of a fixed random logit row under the mask.
--impl xgrammar-pool: the fill and accept as before this bench (one xgrammar BatchGrammarMatcher with its own
per-call thread pool of --threads, the public accept wrapper, is_terminated on every row), for comparison."""

from __future__ import annotations

import argparse
import json
import time
from types import SimpleNamespace

import numpy as np
import torch
from transformers import AutoTokenizer

from replayllm.embedded_model import materialize
from replayllm.engine.structured_output_manager import StructuredOutputManager, accept_tokens
from replayllm.step_io import ScheduledRow, SchedulerOutput
from replayllm.structured_outputs import StructuredOutputsParams

SCHEMA = {  # bench/structured_bench.py's
    "type": "object",
    "properties": {"name": {"type": "string"}, "score": {"type": "number"},
                   "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "score", "tags"],
}
VOCAB = 151936  # Qwen3's logits width (the tokenizer has 151,669 entries: the rest are never allowed)
EOS = (151645, 151643)  # <|im_end|>, <|endoftext|>


def _allowed(bits_row: np.ndarray) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(bits_row.view(np.uint8), bitorder="little")[:VOCAB])


class Picker:
    """One token per row, allowed by the row's bits (what the device's masked sampler returns)."""

    def __init__(self, kind: str, rows: int, seed: int):
        self.kind, self.rng = kind, np.random.default_rng(seed)
        if kind == "greedy":  # fixed per-row preferences: [rows, 4096] token ids, best first, then a full fallback
            logits = self.rng.standard_normal((rows, VOCAB), dtype=np.float32)
            top = np.argpartition(-logits, 4096, axis=1)[:, :4096]
            self.order = np.take_along_axis(top, np.argsort(-np.take_along_axis(logits, top, 1), axis=1), 1)
            self.logits = logits

    def pick(self, bits: np.ndarray) -> list[int]:
        g = bits.shape[0]
        cand = self.rng.integers(0, VOCAB, (g, 64)) if self.kind == "random" else self.order
        ok = (bits[np.arange(g)[:, None], cand >> 5] >> (cand & 31)) & 1  # [g, K] whether each candidate is allowed
        first = ok.argmax(axis=1)
        tokens = cand[np.arange(g), first]
        for r in np.flatnonzero(ok[np.arange(g), first] == 0):  # few tokens allowed (e.g. after '{'): exact pick
            allowed = _allowed(bits[r])
            tokens[r] = (self.rng.choice(allowed) if self.kind == "random"
                         else allowed[np.argmax(self.logits[r, allowed])])
        return tokens.tolist()


def _old_fill(batch, manager, sched, requests):
    """grammar_bitmask as before: one xgrammar BatchGrammarMatcher call with its own thread pool."""
    rows = [i for i, r in enumerate(sched.rows) if requests[r.request_id].grammar is not None]
    matchers = [requests[sched.rows[i].request_id].grammar.matcher for i in rows]
    row_ids, bitmask = manager._buffers(len(rows))
    row_ids[:] = rows
    start = time.perf_counter()
    batch.batch_fill_next_token_bitmask(matchers, bitmask)
    manager.workers.stats.fill_seconds += time.perf_counter() - start  # the xgrammar call alone, as the workers
    return SimpleNamespace(rows=row_ids, bitmask=bitmask)


def run(args, threads: int, tokenizer) -> dict:
    import xgrammar as xgr

    manager = StructuredOutputManager(tokenizer, VOCAB, EOS, num_threads=threads if args.impl == "workers" else 1)
    spec = StructuredOutputsParams(json=SCHEMA)
    grammars = [manager.add_request(spec) for _ in range(args.rows)]
    for g in grammars:
        g.wait(600)
        if args.start:
            assert g.matcher.accept_string(args.start), args.start
    requests = {f"r{i}": SimpleNamespace(grammar=g) for i, g in enumerate(grammars)}
    sched = SchedulerOutput(rows=[ScheduledRow(rid, 0, 1, [], 1) for rid in requests])
    old_batch = xgr.BatchGrammarMatcher(max_threads=threads) if args.impl == "xgrammar-pool" else None
    picker = Picker(args.pick, args.rows, args.seed)
    parts = dict(row_pass=0.0, fill=0.0, buffers=0.0, accept_python=0.0, accept=0.0, end_check=0.0)
    stats = manager.workers.stats
    live = list(requests.values())
    allowed_sum = ended = 0
    for _ in range(args.steps):
        fill0, accept0 = stats.fill_seconds, stats.accept_seconds
        t0 = time.perf_counter()
        if old_batch is None:
            bits = manager.grammar_bitmask(sched, requests)
        else:
            bits = _old_fill(old_batch, manager, sched, requests)
        t1 = time.perf_counter()
        torch.from_numpy(bits.rows), torch.from_numpy(bits.bitmask)  # the sampler's views (then .to(device))
        t2 = time.perf_counter()
        tokens = picker.pick(bits.bitmask)
        allowed_sum += int(np.unpackbits(bits.bitmask[:8].view(np.uint8)).sum()) // 8  # a sample of 8 rows
        t3 = time.perf_counter()
        gs = [r.grammar for r in live]
        if old_batch is None:
            accepted = accept_tokens(gs, tokens)
        else:
            accepted = xgr.BatchGrammarMatcher.batch_accept_token([g.matcher for g in gs], tokens)
            stats.accept_seconds += time.perf_counter() - t3  # the public wrapper: all of it counts as the call
        t4 = time.perf_counter()
        if old_batch is None:
            done = [not a or g.ended_by(t) for g, t, a in zip(gs, tokens, accepted)]
        else:
            done = [not a or g.is_terminated() for g, a in zip(gs, accepted)]
        t5 = time.perf_counter()
        if not all(accepted):
            raise RuntimeError("a token drawn under the mask was rejected")
        if any(done):  # a grammar ended: its request leaves the batch (as the scheduler finishes it)
            ended += sum(done)
            keep = {id(r) for r, d in zip(live, done) if not d}
            live = [r for r in live if id(r) in keep]
            sched = SchedulerOutput(rows=[r for r in sched.rows if id(requests[r.request_id]) in keep])
            if not live:
                break
        fill, accept = stats.fill_seconds - fill0, stats.accept_seconds - accept0
        for k, dt in zip(parts, (t1 - t0 - fill, fill, t2 - t1, t4 - t3 - accept, accept, t5 - t4)):
            parts[k] += dt
    manager.shutdown()
    steps = args.steps
    out = {k: 1e3 * v / steps for k, v in parts.items()}
    out["total"] = sum(out.values())
    out["us_per_row"] = 1e3 * out["total"] / args.rows
    out["mean_allowed"] = allowed_sum / steps
    out["grammars_ended"] = ended
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--threads", default="1,2,4", help="comma-separated thread counts to run")
    ap.add_argument("--start", default='{"name": "', help="text every grammar accepts first ('' = none)")
    ap.add_argument("--pick", choices=["random", "greedy"], default="random")
    ap.add_argument("--impl", choices=["workers", "xgrammar-pool"], default="workers")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(materialize("replayllm/tiny-qwen3"))
    results = {}
    for threads in [int(t) for t in args.threads.split(",")]:
        r = results[threads] = run(args, threads, tokenizer)
        print(f"impl={args.impl} threads={threads} start={args.start!r} pick={args.pick}: "
              f"{r['total']:.2f} ms/step ({r['us_per_row']:.2f} us/row) = row pass {r['row_pass']:.3f} + fill "
              f"{r['fill']:.2f} + buffers {r['buffers']:.3f} + accept (Python {r['accept_python']:.3f} + xgrammar "
              f"{r['accept']:.2f}) + end check {r['end_check']:.3f} ms; "
              f"~{r['mean_allowed']:,.0f} tokens allowed per row, {r['grammars_ended']} grammars ended", flush=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
