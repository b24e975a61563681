"""Prefix-cache block keys: the sha256 key (engine/block_hash.py) against the old `hash()` key, in one run.

Usage (CPU): python bench/block_hash_bench.py [--prompt-len 4096 --block-size 16 --repeats 200]
What is timed is what BlockManager._request_block_hashes does for one prompt (Qwen3-0.6B's serving shape:
16-token blocks): slice the token list per block and chain the keys. Prints one JSON line: microseconds per
block for each (the best of `repeats` passes over the whole prompt, so other jobs on the machine count least),
and the ratio.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from replayllm.engine.block_hash import ROOT, hash_block


def old_keys(ids: list[int], bs: int) -> list[int]:
    keys: list = []
    for i in range(len(ids) // bs):
        keys.append(hash((keys[-1] if i else None, tuple(ids[i * bs : (i + 1) * bs]))))
    return keys


def new_keys(ids: list[int], bs: int) -> list[bytes]:
    keys: list = []
    for i in range(len(ids) // bs):
        keys.append(hash_block(keys[-1] if i else ROOT, ids[i * bs : (i + 1) * bs]))
    return keys


def best_us_per_block(fn, ids: list[int], bs: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn(ids, bs)
        best = min(best, time.perf_counter() - t)
    return best / (len(ids) // bs) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    ids = [random.Random(0).randrange(151_936) for _ in range(args.prompt_len)]  # Qwen3's vocabulary
    old = best_us_per_block(old_keys, ids, args.block_size, args.repeats)
    new = best_us_per_block(new_keys, ids, args.block_size, args.repeats)
    print(json.dumps({"blocks": args.prompt_len // args.block_size, "hash_us_per_block": round(old, 3),
                      "sha256_us_per_block": round(new, 3), "ratio": round(new / old, 2),
                      "sha256_us_per_prompt": round(new * (args.prompt_len // args.block_size), 1)}))


if __name__ == "__main__":
    main()
