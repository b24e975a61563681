"""`replayllm replay` on CUDA: one replica through Ray (an actor holding a GPU) writes the same rows, bit for bit,
as the in-process engine given the same shards (bench/gpu_check.sh runs it where ray is installed)."""

from __future__ import annotations

import json
import random

import pytest

from replayllm.entrypoints.diff import TraceRecord
from replayllm.entrypoints.distributed import replay

pytestmark = pytest.mark.gpu


def test_one_ray_replica_equals_the_in_process_engine_on_cuda(tmp_path):
    pytest.importorskip("ray", reason="ray is not installed (bench/ray_wheel.py builds a wheel for the device)")
    rng = random.Random(0)
    records = [TraceRecord(id=str(i), prompt_token_ids=[rng.randrange(1000, 150000) for _ in range(5 + i)],
                           trace_token_ids=[rng.randrange(1000, 150000) for _ in range(40 + 7 * i)])
               for i in range(12)]
    opts = {"device": "cuda", "dtype": "bfloat16", "max_model_len": 256, "logprobs": 4, "shard_size": 5}
    local = replay(records, tmp_path / "local.jsonl", **opts)
    through_ray = replay(records, tmp_path / "ray.jsonl", ray_address="local", **opts)
    assert (local.data_parallel_size, through_ray.num_tokens) == (1, local.num_tokens)
    assert through_ray.resolved["device"].startswith("cuda")
    rows = [[json.loads(line) for line in open(tmp_path / name)] for name in ("local.jsonl", "ray.jsonl")]
    assert len(rows[0]) == sum(len(r.trace_token_ids) for r in records)
    assert rows[0] == rows[1]
