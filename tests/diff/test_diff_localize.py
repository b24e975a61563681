"""`replayllm diff --localize`: a fault planted in one layer of side B's weights is named, by layer and sub-block."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from helpers.tolerances import rounding_tol

from replayllm.entrypoints.cli.main import main
from replayllm.entrypoints.diff import SpecError, TraceRecord, compare, write_report
from replayllm.entrypoints.diff.localize import first_jump
from replayllm.entrypoints.diff.results import LayerDiff

LAYERS = 4
HIDDEN = 64
# Engine vs transformers on the same weights: each checkpoint's relative difference is rounding, up to LAYERS + 1
# chains of length-HIDDEN reductions (relative: scale 1). 3.8e-5; seen: ~1e-6.
REL_TOL = rounding_tol(1, terms=HIDDEN, steps=LAYERS + 1)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """A tiny random 4-layer Qwen3 and copies with one layer's MLP or attention output projection perturbed."""
    root = tmp_path_factory.mktemp("localize")
    cfg = transformers.Qwen3Config(vocab_size=512, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                                   initializer_range=0.5, max_position_embeddings=256, tie_word_embeddings=True,
                                   bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg).to(torch.float32).eval()
    out = {"clean": str(root / "clean")}
    model.save_pretrained(out["clean"])
    for name, weight in (("mlp2", "model.layers.2.mlp.down_proj.weight"),
                         ("attn1", "model.layers.1.self_attn.o_proj.weight")):
        faulty = transformers.Qwen3ForCausalLM.from_pretrained(out["clean"], dtype=torch.float32)
        param = dict(faulty.named_parameters())[weight]
        with torch.no_grad():
            param.add_(torch.randn_like(param) * param.std() * 0.3)  # a 30% perturbation of one matrix
        out[name] = str(root / name)
        faulty.save_pretrained(out[name])
    return out


def _records() -> list[TraceRecord]:
    g = torch.Generator().manual_seed(1)
    return [TraceRecord(str(i), torch.randint(3, 512, (12,), generator=g).tolist(),
                        prompt_token_ids=torch.randint(3, 512, (5,), generator=g).tolist()) for i in range(3)]


ENGINE = "dtype=float32,device=cpu,max_model_len=64"


@pytest.mark.parametrize("fault, side_b, expected", [
    ("mlp2", f"{ENGINE},model={{path}}", "layer 2 mlp"),
    ("attn1", "hf:dtype=float32,device=cpu,model={path}", "layer 1 attention"),
])
def test_a_planted_fault_is_named(models, tmp_path, fault, side_b, expected):
    result = compare(_records(), ENGINE, side_b.format(path=models[fault]), model=models["clean"], localize=3)
    loc = result.localization
    assert len(loc.positions) == 3
    flips = [(f.request_id, f.position) for f in sorted(result.flips, key=lambda f: f.position)]
    assert loc.positions[: len(flips)] == flips[:3]  # flips first
    names = [c.name for c in loc.checkpoints]
    assert names[:3] == ["embedding", "layer 0 attention", "layer 0 mlp"] and names[-2:] == ["final norm", "logits"]
    assert len(names) == 1 + 2 * LAYERS + 2
    assert loc.first_jump is not None and loc.first_jump.name == expected
    before = loc.checkpoints[: names.index(expected)]
    assert all(c.rel_diff < REL_TOL for c in before) and loc.first_jump.rel_diff > 1e-2
    if not side_b.startswith("hf:"):  # the same engine and the same weights up to the fault: bit for bit
        assert all(c.rel_diff == 0.0 for c in before)

    files = write_report(result, tmp_path / "r")
    report = json.loads(files.json.read_text())
    assert report["localization"]["first_jump"] == expected
    assert len(report["localization"]["checkpoints"]) == len(names)
    md = files.summary.read_text()
    assert f"the setups part at **{expected}**" in md and "## Where the setups part, by layer" in md
    assert (tmp_path / "r" / "rel_diff_by_layer.png").stat().st_size > 1000


def test_same_model_on_both_sides_names_no_layer_and_the_cli_flag(models, tmp_path, capsys):
    from replayllm.entrypoints.diff import write_traces

    traces = tmp_path / "t.jsonl"
    write_traces(traces, _records())
    rc = main(["diff", models["clean"], "--traces", str(traces), "--a", ENGINE, "--b", "hf:dtype=float32,device=cpu",
               "--localize", "2", "--out", str(tmp_path / "r")])
    stdout = capsys.readouterr().out
    assert rc == 0
    assert "layers: no checkpoint jumps above the earlier ones' floor (over 2 position(s)" in stdout
    report = json.loads((tmp_path / "r" / "diff.json").read_text())
    assert report["localization"]["first_jump"] is None
    assert max(c["rel_diff"] for c in report["localization"]["checkpoints"]) < REL_TOL


def test_first_jump_rule_and_file_sides_are_refused(models):
    d = lambda name, x: LayerDiff(name, None, "x", x)  # noqa: E731
    assert first_jump([d("e", 0.0), d("a", 1e-6), d("b", 5e-6), d("c", 1e-3), d("f", 1.0)]).name == "c"
    assert first_jump([d("e", 1e-3), d("a", 2e-3), d("b", 5e-3)]).name == "e"  # already apart at the first
    assert first_jump([d("e", 0.0), d("a", 5e-5)]) is None  # below the minimum: rounding, not a finding
    records = [TraceRecord("x", [5], prompt_token_ids=[3, 4], logprobs=[-1.0])]
    with pytest.raises(SpecError, match="--localize needs both sides to run a model; side A"):
        compare(records, "file", ENGINE, model=models["clean"], localize=1)
    with pytest.raises(ValueError, match="localize must be an integer >= 0"):
        compare(records, ENGINE, ENGINE, model=models["clean"], localize=-1)


@pytest.mark.parametrize("arch", ["qwen3", "olmo2", "granite", "glm4", "stablelm-parallel", "gpt_neox-sequential"])
def test_the_rebuilt_residual_stream_is_the_models(arch):
    """The recorder rebuilds the residual stream from the sub-blocks' contributions: self_attn and mlp outputs for
    pre-norm layers (StableLM's parallel ones too: x + attn + mlp), the post norms' outputs for OLMo2 and GLM-4
    (which norm each sub-block's output before the add), scaled
    by Granite's embedding and residual multipliers. After
    every layer it equals transformers' own hidden states, bit for bit (the same fp32 adds in the same order)."""
    from replayllm.entrypoints.diff.localize import _Recorder

    small = dict(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, initializer_range=0.5, max_position_embeddings=64, pad_token_id=0,
                 bos_token_id=1, eos_token_id=2)
    cls = {"qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
           "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM),
           "granite": (transformers.GraniteConfig, transformers.GraniteForCausalLM),
           "glm4": (transformers.Glm4Config, transformers.Glm4ForCausalLM),
           "stablelm-parallel": (transformers.StableLmConfig, transformers.StableLmForCausalLM),
           "gpt_neox-sequential": (transformers.GPTNeoXConfig, transformers.GPTNeoXForCausalLM)}[arch]
    extra = {"granite": dict(embedding_multiplier=1.7, residual_multiplier=0.3), "glm4": dict(head_dim=8),
             "stablelm-parallel": dict(use_parallel_residual=True),
             "gpt_neox-sequential": dict(use_parallel_residual=False)}.get(arch, {})
    torch.manual_seed(0)
    hf = cls[1](cls[0](**small, **extra)).to(torch.float32).eval()
    ids = torch.arange(3, 13)[None]
    rec = _Recorder(hf, ids.shape[1], engine=False)
    with torch.no_grad():
        states = hf(ids, output_hidden_states=True).hidden_states  # [embedding, after layer 0, ...]
    rec.close()
    for p in range(ids.shape[1]):
        rows = rec.rows(p)
        for layer in range(small["num_hidden_layers"] - 1):
            assert torch.equal(torch.from_numpy(rows[2 * layer + 2]), states[layer + 1][0, p]), (p, layer)
