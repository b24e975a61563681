"""`replayllm diff` on a MoE model (issue 30, docs/diff.md "MoE models"): router agreement per layer between the
sides, the first (request, position, layer) where routes part, `--fix-routes`, routes in trace files, the errors.
A tiny random Qwen3-MoE (3 layers, layer 1 dense) on the CPU."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers

from replayllm.entrypoints.cli.main import main
from replayllm.entrypoints.diff import (
    SpecError,
    TraceFileError,
    TraceRecord,
    capture_run,
    compare,
    read_trace_file,
    write_report,
    write_traces,
)
from replayllm.entrypoints.diff.report import headline, to_json, to_markdown
from replayllm.entrypoints.diff.routes import RouterRecorder
from replayllm.entrypoints.diff.routing import routing_diff
from replayllm.entrypoints.diff.routing_report import routing_line
from replayllm.entrypoints.diff.trace_file import parse_trace_line

VOCAB, LAYERS, TOP_K, SPARSE = 300, 3, 2, (0, 2)
FP32, BF16 = "dtype=float32,device=cpu", "dtype=bfloat16,device=cpu"


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory) -> str:
    """A tiny random Qwen3-MoE checkpoint: 8 experts, top-2 renormalised, layers 0 and 2 sparse. initializer_range
    0.5 makes its distributions peaked, so bf16 moves some routes."""
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, initializer_range=0.5, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2, num_experts=8, num_experts_per_tok=TOP_K, num_hidden_layers=LAYERS,
        mlp_only_layers=[1], norm_topk_prob=True, tie_word_embeddings=False)
    path = str(tmp_path_factory.mktemp("moe_diff"))
    transformers.Qwen3MoeForCausalLM(cfg).to(torch.float32).save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def dense_path(tmp_path_factory) -> str:
    """A tiny random dense Qwen3 (no tokenizer: nothing slow to load)."""
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16, num_hidden_layers=2,
                                   max_position_embeddings=256)
    path = str(tmp_path_factory.mktemp("dense_diff"))
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def captured(moe_path, tmp_path_factory):
    """Greedy fp32 captures of three token-id prompts with their routes: (trace file path, the Capture)."""
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(3, VOCAB, n).tolist()} for n in (5, 9, 12)]
    run = capture_run(prompts, model=moe_path, max_tokens=8, top_k=3, device="cpu", dtype="float32",
                      max_model_len=128, enable_return_routed_experts=True)
    path = tmp_path_factory.mktemp("moe_traces") / "traces.jsonl"
    write_traces(path, run.records, run.provenance)
    return path, run


@pytest.fixture(scope="module")
def random_traces() -> list[TraceRecord]:
    """Random (not greedy) traces: on this model bf16 moves routes whose forwards score trace tokens."""
    rng = np.random.default_rng(0)
    return [TraceRecord(str(i), rng.integers(3, VOCAB, 8).tolist(), prompt_token_ids=rng.integers(3, VOCAB, 6).tolist())
            for i in range(3)]


def _parting_is_consistent(routing) -> None:
    """first_parting names a (request, position, layer) whose sets differ, after none in file order."""
    p = routing.first_parting
    assert p is not None and set(p.experts_a) != set(p.experts_b) and p.layer in SPARSE
    before = [r for r in routing.requests[: [r.request_id for r in routing.requests].index(p.request_id)]]
    assert all(r.agreement == 1.0 and r.first_parting is None for r in before)
    assert next(r for r in routing.requests if r.request_id == p.request_id).first_parting == p.position


# -- the agreement itself ----------------------------------------------------------------------------------------
def test_routing_diff_counts_sets_per_sparse_layer_and_finds_the_first_parting():
    a = np.full((4, 3, 2), -1, dtype=np.int16)  # [positions, layers, top_k]; layer 1 dense
    a[:, 0], a[:, 2] = [[0, 1], [2, 3], [4, 5], [6, 7]], [[1, 0], [1, 2], [3, 4], [5, 6]]
    b = a.copy()
    b[0, 0] = [1, 0]  # the same set in another order: agrees
    b[2, 2] = [3, 7]  # parts at position 2, layer 2
    b[3, 0] = [6, 5]  # and at position 3, layer 0
    r = routing_diff(["x", "y"], [3, 2], [a, a], [a, b], fixed=None)
    assert r.compared and r.sparse_layers == (0, 2) and r.top_k == 2 and r.num_positions == 8
    assert [(x.layer, x.agreement) for x in r.layers] == [(0, 7 / 8), (2, 7 / 8)]
    assert r.agreement == 14 / 16 and r.position_agreement == 6 / 8
    assert [(x.request_id, x.agreement, x.first_parting) for x in r.requests] == [("x", 1.0, None), ("y", 6 / 8, 2)]
    p = r.first_parting
    assert (p.request_id, p.position, p.trace_position, p.layer, p.experts_a, p.experts_b) == ("y", 2, 1, 2, (3, 4),
                                                                                               (3, 7))


def _recorded(hf, ids: list[int], layers, softmax_top_k: bool, logits_only: bool = False):
    """(RouterRecorder's routes of one forward, each sparse layer's router output). logits_only: as a router that
    returns its logits alone (older transformers) would have been recorded."""
    recorder = RouterRecorder(hf, layers, softmax_top_k)
    with recorder, torch.no_grad():
        hf(torch.tensor([ids]))
    outputs = dict(recorder.outputs)
    if logits_only:
        recorder.outputs = {layer: out[0] for layer, out in outputs.items()}
    return recorder.routes(TOP_K, LAYERS, len(ids) - 1), outputs


def test_hf_routes_are_the_experts_transformers_routes_to(moe_path):
    """The experts transformers' own routers sent each token to (mlp.gate's third output): as recorded, and from a
    router that returns its logits alone, the top-k of their softmax where that is the model's rule, else none."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(moe_path, dtype=torch.float32).eval()
    ids = list(range(3, 20))
    routes, outputs = _recorded(hf, ids, SPARSE, softmax_top_k=False)
    assert routes.shape == (len(ids) - 1, LAYERS, TOP_K) and routes.dtype == np.int16
    assert (routes[:, 1] == -1).all()
    for layer in SPARSE:
        assert np.array_equal(routes[:, layer], outputs[layer][2][: len(ids) - 1].numpy())
    from_logits, _ = _recorded(hf, ids, SPARSE, softmax_top_k=True, logits_only=True)
    assert np.array_equal(from_logits, routes)
    assert _recorded(hf, ids, SPARSE, softmax_top_k=False, logits_only=True)[0] is None
    assert RouterRecorder(hf, (0, 1, 2), True).missing == [1]  # layer 1 is dense: no router to record


def test_hf_routes_of_a_grouped_sigmoid_router_are_its_own_choice(tmp_path, random_traces):
    """DeepSeek-V3's (and GLM-4-MoE's) router picks on sigmoid scores plus a correction bias inside the best groups:
    the recorded routes are its ids, which the top-k of softmax(logits) would not give; `replayllm diff` between
    transformers and an fp32 engine then finds their routes the same."""
    torch.manual_seed(0)
    cfg = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=TOP_K, n_group=2, topk_group=1,
        first_k_dense_replace=1, initializer_range=0.5)
    hf = transformers.DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        hf.model.layers[1].mlp.gate.e_score_correction_bias.uniform_(-0.3, 0.3)
    ids = list(range(3, 40))
    routes, outputs = _recorded(hf, ids, (1,), softmax_top_k=False)
    chosen = outputs[1][2][: len(ids) - 1]
    assert np.array_equal(routes[:, 1], chosen.numpy()) and (routes[:, 0] == -1).all()
    by_softmax = outputs[1][0][: len(ids) - 1].softmax(-1).topk(TOP_K, dim=-1).indices
    assert not torch.equal(by_softmax.sort(-1).values, chosen.sort(-1).values)
    hf.save_pretrained(str(tmp_path))
    result = compare(random_traces, "hf:dtype=float32,device=cpu", FP32, model=str(tmp_path), top_k=3)
    assert result.routing.compared and result.routing.agreement >= 0.95  # near-ties may flip under rounding


# -- engine sides ------------------------------------------------------------------------------------------------
def test_identical_engine_sides_agree_exactly_and_report_it(moe_path, captured, tmp_path):
    result = compare(captured[0], FP32, FP32, model=moe_path, top_k=3)
    files = write_report(result, tmp_path / "same", plots=False)
    routing = json.loads(files.json.read_text())["routing"]
    assert routing["compared"] and routing["agreement"] == 1.0 and routing["position_agreement"] == 1.0
    assert routing["layers"] == [{"layer": 0, "agreement": 1.0}, {"layer": 2, "agreement": 1.0}]
    assert routing["first_parting"] is None and routing["fix_routes"] is None
    rows = sum(len(r.prompt_token_ids) + len(r.trace_token_ids) - 1 for r in captured[1].records)
    assert routing["num_positions"] == rows and routing["sparse_layers"] == list(SPARSE)
    line = f"routing: identical (the top-2 expert sets at {rows} positions × 2 sparse layers all agree)"
    assert headline(result)[1] == line  # the console's second line (after the argmax flips)
    summary = files.summary.read_text()
    assert f"- {line}" in summary
    assert "## Router agreement" in summary and "| 0 | 100.0% |\n| 2 | 100.0% |\n| all | 100.0% |" in summary
    assert "<h2 id=\"routing\">Router agreement</h2>" in files.html.read_text()


def test_fp32_vs_bf16_routes_part_and_the_first_parting_is_consistent(moe_path, random_traces):
    r = compare(random_traces, FP32, BF16, model=moe_path, top_k=3).routing
    assert r.compared and r.fixed is None
    values = [x.agreement for x in r.layers]
    assert all(0.0 <= v <= 1.0 for v in values) and 0.0 <= r.position_agreement <= r.agreement < 1.0
    assert r.agreement == pytest.approx(sum(values) / len(values))  # every layer counts the same positions
    _parting_is_consistent(r)
    p = r.first_parting
    assert (r.routes_a[0].shape, r.routes_b[0].shape) == ((6 + 8 - 1, LAYERS, TOP_K),) * 2
    parted = next(i for i, x in enumerate(r.requests) if x.request_id == p.request_id)
    assert tuple(r.routes_a[parted][p.position, p.layer]) == p.experts_a
    assert tuple(r.routes_b[parted][p.position, p.layer]) == p.experts_b
    line = routing_line(r)
    assert line.startswith(f"routing: {100 * r.agreement:.1f}% of routes agree (top-2 expert sets at 39 positions")
    assert f"first parting in request {p.request_id!r} at prompt+trace position {p.position} (" in line
    assert f"), layer {p.layer}: A {list(p.experts_a)}, B {list(p.experts_b)}" in line


def test_fix_routes_from_hf_on_bf16_engine(moe_path, random_traces):
    """The important case: transformers' routes replayed on a bf16 engine; the routes then agree, the engine's
    captured routes are transformers' own, and the logprobs differ by the numerics alone (less than with the
    engine's own routes)."""
    free = compare(random_traces, "hf:dtype=float32,device=cpu", BF16, model=moe_path, top_k=3)
    fixed = compare(random_traces, "hf:dtype=float32,device=cpu", BF16, model=moe_path, top_k=3, fix_routes="a")
    assert 0.0 <= free.routing.agreement < 1.0 and all(0.0 <= x.agreement <= 1.0 for x in free.routing.layers)
    _parting_is_consistent(free.routing)
    r = fixed.routing
    assert r.agreement == 1.0 and r.first_parting is None and (r.fixed, r.forced_side) == ("a", "b")
    assert all(np.array_equal(a, b) for a, b in zip(r.routes_a, r.routes_b, strict=True))
    assert fixed.overall.mean_abs_delta < free.overall.mean_abs_delta
    assert routing_line(r).startswith("routing (fixed: side A's routes replayed on side B): identical")


def test_fix_routes_b_runs_b_first_and_forces_its_routes_on_a(moe_path, random_traces):
    result = compare(random_traces, BF16, FP32, model=moe_path, top_k=3, fix_routes="b")
    r = result.routing
    assert r.agreement == 1.0 and (r.fixed, r.forced_side) == ("b", "a")
    assert all(np.array_equal(a, b) for a, b in zip(r.routes_a, r.routes_b, strict=True))
    assert result.seconds_a > 0 and result.seconds_b > 0
    assert "Routes fixed: side B's routes were replayed on side A" in to_markdown(result)


# -- trace files -------------------------------------------------------------------------------------------------
def test_capture_file_round_trip_keeps_routes_and_the_file_side_has_them(moe_path, captured):
    path, run = captured
    assert run.provenance["capture"]["routed_experts"] is True
    back = read_trace_file(path)
    for rec, orig in zip(back.records, run.records):
        routes = np.asarray(rec.routed_experts)
        assert routes.shape == (len(rec.prompt_token_ids) + len(rec.trace_token_ids) - 1, LAYERS, TOP_K)
        assert rec.routed_experts == orig.routed_experts and (routes[:, 1] == -1).all()
    same = compare(path, "file", FP32, model=moe_path, top_k=3)  # the capturing config replays its own routes
    assert same.routing.agreement == 1.0 and same.overall.max_abs_delta == 0.0
    fixed = compare(path, "file", BF16, model=moe_path, top_k=3, fix_routes="a")
    assert fixed.routing.agreement == 1.0 and fixed.routing.fixed == "a"


def test_old_files_stay_valid_and_bad_routes_are_named():
    line = {"id": 1, "prompt_token_ids": [3, 4], "trace_token_ids": [5, 6]}
    assert parse_trace_line(json.dumps(line)).routed_experts is None
    good = [[[0, 1]], [[1, 2]], [[2, 3]]]  # 2 + 2 - 1 rows, 1 layer, top-2
    assert parse_trace_line(json.dumps({**line, "routed_experts": good})).routed_experts == good
    for bad, msg in (([[[0, 1]], [[1, 2]]], "one row per routed position.*= 3, got a list of 2"),
                     ([[[0, 1]], [[1]], [[2, 3]]], "rectangular"), ([[[0, 1.5]], [[1, 2]], [[2, 3]]], "non-integer"),
                     ([[[0, -2]], [[1, 2]], [[2, 3]]], "expert id -2"), ([], "non-empty")):
        with pytest.raises(TraceFileError, match=msg):
            parse_trace_line(json.dumps({**line, "routed_experts": bad}))


def test_file_routes_are_checked_against_the_model_before_any_side_runs(moe_path, captured, tmp_path):
    """Stored routes of another model are refused up front, naming the record: an expert past num_experts (they
    were reported as a route difference), ids on the dense layer 1 (counted as a routed layer), another top_k."""
    path, run = captured

    def past_experts(routes):
        routes[0, 0, 0] = 8
        return routes

    def on_dense_layer(routes):
        routes[1, 1] = [3, 4]
        return routes

    cases = ((past_experts, False, r"outside \[0, 8\) on a sparse layer \(e.g. 8\)"),
             (on_dense_layer, False, "routes the dense layer 1"),
             (lambda routes: routes[:, :, :1], True, r"rows are \[3\]\[1\] .*the model has 3 layers, top_k 2"))
    for change, every, msg in cases:
        records = [TraceRecord(rec.id, rec.trace_token_ids, prompt_token_ids=rec.prompt_token_ids,
                               logprobs=rec.logprobs,
                               routed_experts=(change(np.array(rec.routed_experts)) if every or i == 1
                                               else np.array(rec.routed_experts)).tolist())
                   for i, rec in enumerate(run.records)]
        bad = tmp_path / "bad.jsonl"
        write_traces(bad, records)
        for fix in (None, "a"):  # (a SpecError / TraceFileError here: no side ran)
            with pytest.raises(TraceFileError, match=("request '0'" if every else "request '1'") + ".*" + msg):
                compare(bad, "file", FP32, model=moe_path, top_k=3, fix_routes=fix)


# -- errors ------------------------------------------------------------------------------------------------------
def test_fix_routes_errors(moe_path, dense_path, captured, tmp_path, capsys):
    path, run = captured
    plain = tmp_path / "plain.jsonl"  # the same traces without routes
    write_traces(plain, [TraceRecord(r.id, r.trace_token_ids, prompt_token_ids=r.prompt_token_ids,
                                     logprobs=r.logprobs) for r in run.records])
    dense = [TraceRecord("d", [5, 6], prompt_token_ids=[3, 4], logprobs=[-1.0, -1.0])]
    cases = [(dict(traces=path, a=FP32, b="hf:device=cpu", fix_routes="a"), "cannot be given routes.*--fix-routes b"),
             (dict(traces=path, a="hf:device=cpu", b=FP32, fix_routes="b"), "transformers' forward, which cannot"),
             (dict(traces=path, a=FP32, b="file", fix_routes="a"), "reads stored logprobs"),
             (dict(traces=plain, a="file", b=FP32, fix_routes="a"), "side A .* has no routes.*no 'routed_experts'"),
             (dict(traces=path, a=f"{FP32},enable_return_routed_experts=false", b=BF16, fix_routes="a"),
              "enable_return_routed_experts=false"),
             (dict(traces=path, a=FP32, b=BF16, fix_routes="c"), "must be 'a' or 'b'"),
             (dict(traces=path, a=FP32, b=BF16, fix_routes="a", localize=2), "--localize"),
             (dict(traces=dense, a=FP32, b=BF16, fix_routes="a", model=dense_path), "the model is dense")]
    for kwargs, msg in cases:
        with pytest.raises(SpecError, match=msg):
            compare(kwargs.pop("traces"), kwargs.pop("a"), kwargs.pop("b"), **{"model": moe_path, **kwargs})
    rc = main(["diff", moe_path, "--traces", str(path), "--a", FP32, "--b", "hf", "--fix-routes", "a"])
    assert rc == 2 and "error: --fix-routes a: side B ('hf')" in capsys.readouterr().err


def test_no_routing_section_without_routes(moe_path, dense_path, captured, tmp_path):
    dense = compare([TraceRecord("d", [5, 6], prompt_token_ids=[3, 4])], FP32, FP32, model=dense_path, top_k=3)
    assert dense.routing is None  # a dense model: no routing section at all, and the engine options as given
    assert dense.a.options == dense.b.options == {"dtype": "float32", "device": "cpu"}
    plain = tmp_path / "plain.jsonl"
    write_traces(plain, [TraceRecord(r.id, r.trace_token_ids, prompt_token_ids=r.prompt_token_ids,
                                     logprobs=r.logprobs) for r in captured[1].records])
    assert compare(plain, "file", "file", model=moe_path).routing is None  # no side runs a model or stores routes
    assert "routing" not in to_json(dense) and "routing" not in to_markdown(dense)


def test_report_names_a_side_without_routes(moe_path, tmp_path, captured):
    plain = tmp_path / "plain.jsonl"
    write_traces(plain, [TraceRecord(r.id, r.trace_token_ids, prompt_token_ids=r.prompt_token_ids,
                                     logprobs=r.logprobs) for r in captured[1].records])
    r = compare(plain, "file", FP32, model=moe_path, top_k=3).routing
    assert not r.compared and r.agreement is None
    assert r.note.startswith("side A ('file') reports no routes: request '0' (line 1) stores no 'routed_experts'")


def test_cli_parses_fix_routes_choices(capsys):
    with pytest.raises(SystemExit) as e:
        main(["diff", "--traces", "x.jsonl", "--a", "default", "--b", "default", "--fix-routes", "c"])
    assert e.value.code == 2 and "invalid choice: 'c'" in capsys.readouterr().err



def test_mixtral_engine_against_transformers(tmp_path, random_traces):
    """Mixtral (every layer sparse): an fp32 engine side routes every scored position as transformers' router does
    and its logprobs agree within fp32 rounding; bf16 moves some routes and `--fix-routes a` puts them back."""
    from helpers.tolerances import LOGPROB_TOL

    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=16, initializer_range=0.5, num_local_experts=4,
                                     num_experts_per_tok=TOP_K, num_hidden_layers=2, max_position_embeddings=256)
    transformers.MixtralForCausalLM(cfg).save_pretrained(str(tmp_path))
    same = compare(random_traces, "hf:dtype=float32,device=cpu", FP32, model=str(tmp_path), top_k=3)
    assert same.routing.agreement == 1.0 and [x.layer for x in same.routing.layers] == [0, 1]
    assert same.overall.max_abs_delta <= LOGPROB_TOL
    fixed = compare(random_traces, "hf:dtype=float32,device=cpu", BF16, model=str(tmp_path), top_k=3, fix_routes="a")
    assert fixed.routing.agreement == 1.0 and fixed.routing.first_parting is None


def test_a_failing_transformers_forward_is_a_clear_error(moe_path, captured, monkeypatch):
    """transformers' own kernels may refuse a checkpoint's shapes (grouped_mm's 16-byte strides for experts of width
    44 in bf16: a raw traceback before); the side and request are named, with the SPEC options that avoid it."""
    from replayllm.entrypoints.diff import sides

    def refuses(*args, **kwargs):
        raise RuntimeError("strides should be multiple of 16 bytes\nmore detail")

    monkeypatch.setattr(sides, "teacher_forced_logprobs", refuses)
    path, _ = captured
    with pytest.raises(ValueError, match=r"side 'hf:device=cpu': transformers' forward failed on request '0': strides "
                                         r"should be multiple of 16 bytes; .*experts_implementation=eager"):
        compare(path, FP32, "hf:device=cpu", model=moe_path, top_k=3)
