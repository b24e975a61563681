"""`replayllm replay` and data parallelism on Ray (replayllm.entrypoints.distributed): per-token output (JSONL, parquet)
equal to LLM.generate's, replicas equal to one engine exactly (fp32) in input order, a killed replica's shards
retried, capture and diff on replicas, the errors without Ray; one replica on CUDA at the end (marker `gpu`)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys

import pytest
import torch

from replayllm import LLM, SamplingParams
from replayllm.entrypoints.cli.main import main
from replayllm.entrypoints.diff import TraceRecord, read_traces, write_traces
from replayllm.entrypoints.distributed import ScaleOut, replay

OPTS = {"device": "cpu", "dtype": "float32", "max_model_len": 96}
ENGINE_FLAGS = ["--device", "cpu", "--dtype", "float32", "--max-model-len", "96"]
K = 3  # top-k alternatives written per token
SHARD = 2  # requests per shard: 8 traces -> 4 shards


def _records() -> list[TraceRecord]:
    """8 traces of 3..6 tokens after distinct prompts (no shared prefix: no cache hit changes a prefill)."""
    rng = random.Random(0)
    records = [TraceRecord(id=f"r{i}", prompt_token_ids=[rng.randrange(1000, 150000) for _ in range(3 + i % 4)],
                           trace_token_ids=[rng.randrange(1000, 150000) for _ in range(3 + (i * 5) % 4)])
               for i in range(7)]
    records.append(TraceRecord(id="text", prompt="Once upon a time", trace_token_ids=[1052, 12163, 264, 882]))
    return records


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    path = tmp_path_factory.mktemp("replay") / "traces.jsonl"
    write_traces(path, _records(), provenance={"tool": "test"})
    return path


@contextlib.contextmanager
def _one_thread():
    """Ray runs each replica with 1 CPU thread; the reference does the same, so every float is computed alike."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def reference(traces, tmp_path_factory):
    """One engine in this process (no Ray): the rows of replay(shard_size=SHARD), 1 thread."""
    out = tmp_path_factory.mktemp("ref") / "ref.jsonl"
    with _one_thread():
        result = replay(traces, out, logprobs=K, shard_size=SHARD, **OPTS)
    assert result.data_parallel_size == 1 and result.retries == 0
    assert 0 < result.engine_seconds <= result.run_seconds  # the engine's share of the run, measured inside it
    return _rows(out)


def _rows(path) -> list[dict]:
    if str(path).endswith(".parquet"):
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    return [json.loads(line) for line in open(path, encoding="utf-8")]


def _order(rows: list[dict]) -> list[tuple[str, int]]:
    return [(r["request_id"], r["position"]) for r in rows]


def _expected_order() -> list[tuple[str, int]]:
    return [(r.id, i) for r in _records() for i in range(len(r.trace_token_ids))]


# -- one engine, no Ray --------------------------------------------------------------------------------------
def test_replay_rows_equal_llm_generate(traces, reference, tmp_path):
    """Every row is what LLM.generate reports for that trace token (same batches of SHARD), in input order;
    parquet holds the same rows as JSONL."""
    assert _order(reference) == _expected_order()
    records = _records()
    llm = LLM(enable_trace_replay=True, max_logprobs=K, **OPTS)
    expected = []
    with _one_thread():
        for start in range(0, len(records), SHARD):
            batch = records[start : start + SHARD]
            prompts = [{"prompt_token_ids": r.prompt_token_ids} if r.prompt_token_ids else r.prompt for r in batch]
            params = [SamplingParams(trace_decode_token_ids=r.trace_token_ids, logprobs=K) for r in batch]
            for out in llm.generate(prompts, params, use_tqdm=False):
                comp = out.outputs[0]
                for token, d in zip(comp.token_ids, comp.logprobs):
                    top = sorted((lp.rank, t, lp.logprob) for t, lp in d.items() if lp.rank <= K)
                    expected.append((token, d[token].logprob, d[token].rank, [t for _, t, _ in top],
                                     [v for _, _, v in top]))
    got = [(r["token_id"], r["logprob"], r["rank"], r["top_token_ids"], r["top_logprobs"]) for r in reference]
    assert got == expected
    pq_out = tmp_path / "ref.parquet"
    with _one_thread():
        replay(traces, pq_out, logprobs=K, shard_size=SHARD, **OPTS)
    assert _rows(pq_out) == reference


def test_replay_cli_without_top_k(traces, reference, tmp_path, capsys):
    out = tmp_path / "plain.jsonl"
    with _one_thread():
        rc = main(["replay", "--traces", str(traces), "--out", str(out), "--shard-size", str(SHARD), *ENGINE_FLAGS])
    assert rc == 0
    printed = capsys.readouterr().out
    assert f"wrote {len(reference)} tokens of 8 traces" in printed and "trace replay one-token" in printed
    rows = _rows(out)
    assert set(rows[0]) == {"request_id", "position", "token_id", "logprob", "rank"}
    assert rows == [{k: r[k] for k in rows[0]} for r in reference]


def test_replay_names_the_request_its_engine_refused(tmp_path, capsys):
    """A shard's refused request is named once, as the trace file places it (not "requests <a> .. <b>")."""
    path = tmp_path / "oov.jsonl"
    write_traces(path, [TraceRecord(id="ok", prompt_token_ids=[5, 6], trace_token_ids=[7]),
                        TraceRecord(id="bad", prompt_token_ids=[5, 6], trace_token_ids=[10**6])])
    rc = main(["replay", "--traces", str(path), "--out", str(tmp_path / "x.jsonl"), *ENGINE_FLAGS])
    err = capsys.readouterr().err
    assert rc == 2 and "request 'bad'" in err and "request 'ok'" not in err and "requests " not in err, err


def test_replay_warns_that_stored_routes_are_not_forced(tmp_path, capsys, caplog):
    """A capture of a MoE model stores each record's routed_experts; replay routes freely (the tokens alone are
    replayed): said on stderr, never silently (the replayed numbers may differ from a routes-forced replay)."""
    path = tmp_path / "routes.jsonl"
    routes = [[[0, 1]], [[1, 0]]]  # [prompt + trace - 1 positions, layers, top_k]: shape only, never read here
    write_traces(path, [TraceRecord(id="a", prompt_token_ids=[5, 6], trace_token_ids=[7], routed_experts=routes),
                        TraceRecord(id="b", prompt_token_ids=[5, 6], trace_token_ids=[7])])
    with caplog.at_level("WARNING"):
        assert main(["replay", "--traces", str(path), "--out", str(tmp_path / "x.jsonl"), *ENGINE_FLAGS]) == 0
    assert "1 of 2 traces store routed_experts: replay does not force them" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        write_traces(path, [TraceRecord(id="b", prompt_token_ids=[5, 6], trace_token_ids=[7])])
        assert main(["replay", "--traces", str(path), "--out", str(tmp_path / "x.jsonl"), *ENGINE_FLAGS]) == 0
    assert "routed_experts" not in caplog.text


def test_replay_of_token_id_traces_needs_no_tokenizer(tmp_path, capsys):
    """A checkpoint without tokenizer files replays traces whose prompts are all token ids (as diff does)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = tmp_path / "tiny-llama"
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(model)
    path = tmp_path / "ids.jsonl"
    write_traces(path, [TraceRecord(id="a", prompt_token_ids=[5, 6], trace_token_ids=[7, 8])])
    rc = main(["replay", str(model), "--traces", str(path), "--out", str(tmp_path / "x.jsonl"), *ENGINE_FLAGS])
    assert rc == 0, capsys.readouterr().err
    assert [r["token_id"] for r in _rows(tmp_path / "x.jsonl")] == [7, 8]


def test_shards_leave_in_input_order_and_early_ones_wait_on_disk():
    import numpy as np

    from replayllm.entrypoints.distributed.columns import TokenColumns
    from replayllm.entrypoints.distributed.merge import OrderedMerge

    def cols(i: int) -> TokenColumns:
        n = i + 1
        return TokenColumns(np.array([n]), np.arange(n) + 10 * i, np.full(n, -0.5 * i, np.float32), np.ones(n, int),
                            np.zeros((n, 2), int), np.zeros((n, 2), np.float32))

    got = []
    merge = OrderedMerge(lambda index, c: got.append((index, c.token_ids.tolist(), c.logprobs.tolist())))
    for i in (2, 0, 3):
        merge.put(i, cols(i))
    assert [g[0] for g in got] == [0] and merge.waiting  # 2 and 3 wait (as files) for 1
    spilled = [item.path for item in merge.waiting.values()]
    merge.put(1, cols(1))
    assert got == [(i, list(range(10 * i, 10 * i + i + 1)), [-0.5 * i] * (i + 1)) for i in range(4)]
    assert not merge.waiting and not any(os.path.exists(p) for p in spilled)
    with pytest.raises(RuntimeError, match="twice"):
        merge.put(2, cols(2))
    merge.close()


def test_packed_traces_give_back_every_prompt_and_trace_and_ship_small():
    """A replay shard travels to its replica as PackedTraces: the same prompts (token ids or text) and traces,
    and without the per-token Python objects (nor a captured file's reference logprobs) in its pickle."""
    import pickle

    from replayllm.entrypoints.distributed.packed import PackedTraces

    records = _records()
    records[2] = TraceRecord(id="empty-ish", prompt_token_ids=[5], trace_token_ids=[7], line=9)
    packed = PackedTraces.of(records)
    assert len(packed) == len(records)
    for record, (prompt, trace, where) in zip(records, packed.requests()):
        want = record.prompt if record.prompt_token_ids is None else {"prompt_token_ids": record.prompt_token_ids}
        assert prompt == want and trace == record.trace_token_ids and where == record.where
        assert all(type(t) is int for t in trace)  # plain ints, as SamplingParams wants
    # A captured trace file's records: reference logprobs and top-2 dicts per token, which a replay never reads.
    big = [TraceRecord(id=str(i), prompt_token_ids=list(range(64)), trace_token_ids=list(range(2048)),
                       logprobs=[-t / 7 for t in range(2048)],
                       top_logprobs=[{t: -t / 7, t + 1: -t / 3} for t in range(2048)]) for i in range(4)]
    shipped = pickle.dumps(PackedTraces.of(big))
    assert len(shipped) < 8 * 4 * (64 + 2048) + 4096 < len(pickle.dumps(big)) / 3  # the ids' bytes, little more


def test_the_first_parquet_write_imports_nothing(tmp_path):
    """pyarrow imports modules on first use (pyarrow.compute, numpy.ma); the writer pays them when it is made,
    before a run is timed, not on the first shard (in a Ray driver no engine imported them before). A fresh
    process, so this one's imports do not hide any; the throw-away table made then is not written."""
    code = (
        "import sys, numpy as np\n"
        "import pyarrow.parquet as pq\n"
        "from replayllm.entrypoints.distributed.columns import TokenColumns\n"
        "from replayllm.entrypoints.distributed.writers import TokenWriter\n"
        "w = TokenWriter(sys.argv[1], 'parquet', 2)\n"
        "before = set(sys.modules)\n"
        "w.write(['a', 'b'], TokenColumns(np.array([2, 1]), np.array([7, 8, 9]), np.zeros(3, np.float32),\n"
        "        np.ones(3, np.int64), np.zeros((3, 2), np.int64), np.zeros((3, 2), np.float32)))\n"
        "w.close()\n"
        "print(sorted(set(sys.modules) - before))\n"
        "t = pq.read_table(sys.argv[1]).to_pydict()\n"
        "print(t['request_id'], t['position'], t['token_id'])\n")
    out = tmp_path / "o.parquet"
    done = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["[]", "['a', 'a', 'b'] [0, 1, 0] [7, 8, 9]"]


def test_scale_out_options_are_validated(traces, tmp_path, capsys):
    for bad in ({"data_parallel_size": 0}, {"shard_size": 0}, {"ray_address": "not an address"}):
        with pytest.raises(ValueError):
            ScaleOut(**bad)
    with pytest.raises(ValueError, match="enable_trace_replay=False"):
        replay(traces, tmp_path / "out.jsonl", enable_trace_replay=False, **OPTS)
    with pytest.raises(ValueError, match="output format"):
        replay(traces, tmp_path / "out.csv", **OPTS)
    assert main(["replay", "--traces", str(traces), "--out", str(tmp_path / "o.jsonl"), "-dp", "0"]) == 2
    assert "data_parallel_size must be an integer >= 1" in capsys.readouterr().err


def test_without_ray_the_flags_say_how_to_install_it(traces, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    for cmd in (["replay", "--traces", str(traces), "--out", str(tmp_path / "o.jsonl")],
                ["capture", "--prompts", str(tmp_path / "p.txt"), "--out", str(tmp_path / "t.jsonl")],
                ["diff", "--traces", str(traces), "--a", "default", "--b", "file"]):
        (tmp_path / "p.txt").write_text("hello\n")
        rc = main([*cmd, "--data-parallel-size", "2"])
        assert rc == 2
        assert "pip install 'replayllm[ray]'" in capsys.readouterr().err


# -- Ray: one local cluster for the module, 2 replicas per run ----------------------------------------------
@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray", reason="ray is in the test extra: pip install -e '.[test]'")
    ray.init(num_cpus=2, include_dashboard=False)
    yield ray
    ray.shutdown()


def test_two_replicas_equal_one_engine_exactly_in_input_order(ray_cluster, traces, reference, tmp_path, capsys):
    """The CLI on the module's Ray session (the pool joins it), parquet output."""
    out = tmp_path / "dp2.parquet"
    assert main(["replay", "--traces", str(traces), "--out", str(out), "--logprobs", str(K), "--shard-size",
                 str(SHARD), "--data-parallel-size", "2", *ENGINE_FLAGS]) == 0
    assert f"wrote {len(reference)} tokens of 8 traces to {out} (parquet; 2 replicas" in capsys.readouterr().out
    assert _rows(out) == reference  # bit for bit (fp32), in the input order


def test_a_killed_replica_loses_no_trace(ray_cluster, traces, reference, tmp_path, monkeypatch):
    from replayllm.entrypoints.distributed.ray_pool import RayPool

    killed = []

    def kill_one(pool):  # after the first shard result: kill a replica whose shard has not finished yet
        if killed:
            return
        refs = list(pool.in_flight)
        _, running = ray_cluster.wait(refs, num_returns=len(refs), timeout=0)
        if running:
            killed.append(pool.actors[pool.in_flight[running[0]][0]])
            ray_cluster.kill(killed[0], no_restart=True)

    monkeypatch.setattr(RayPool, "after_result", staticmethod(kill_one))
    out = tmp_path / "killed.jsonl"
    result = replay(traces, out, logprobs=K, shard_size=SHARD, data_parallel_size=2, **OPTS)
    assert killed and result.retries >= 1
    assert 0 < result.engine_seconds <= 2 * result.run_seconds  # summed over 2 replicas (lost shards: not)
    assert (result.num_requests, result.num_tokens, result.data_parallel_size) == (8, len(reference), 2)
    assert _rows(out) == reference  # every trace exactly once, in order, same values


def test_capture_and_diff_on_replicas(ray_cluster, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\nThe capital of France is\nHello there\nOne two three\n")
    captured = tmp_path / "captured.jsonl"
    assert main(["capture", "--prompts", str(prompts), "--out", str(captured), "--max-tokens", "4", "--top-k", "2",
                 "--shard-size", "2", "-dp", "2", *ENGINE_FLAGS]) == 0
    records = read_traces(captured)
    assert [r.id for r in records] == ["0", "1", "2", "3"] and all(len(r.trace_token_ids) == 4 for r in records)
    with _one_thread():  # greedy: the same tokens as one engine, logprobs equal to float32 rounding of the batch
        plain = LLM(max_logprobs=2, **OPTS).generate(prompts.read_text().splitlines(),
                                                      SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    assert [r.trace_token_ids for r in records] == [o.outputs[0].token_ids for o in plain]

    report = tmp_path / "report"
    assert main(["diff", "--traces", str(captured), "--a", "dtype=float32,device=cpu,max_model_len=96", "--b", "file",
                 "--batch-size", "2", "-dp", "2", "--trace-replay-chunk-size", "1",  # as the capture decoded
                 "--out", str(report)]) == 0
    diff = json.loads((report / "diff.json").read_text())
    assert [r["id"] for r in diff["requests"]] == ["0", "1", "2", "3"]
    assert diff["num_tokens"] == 16 and diff["overall"]["max_abs_delta"] == 0.0  # same batches as the capture


# -- On CUDA (marker `gpu`; bench/gpu_check.sh runs it where ray is installed): one replica through Ray (an actor
# holding a GPU) writes the same rows, bit for bit, as the in-process engine given the same shards. ---------------
@pytest.mark.gpu
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
