"""Gemma 3n (models/gemma3n.py on gemma4.py's attention, KV sharing and per-layer inputs) beyond
test_engine_architectures.py[gemma3n] (logprobs against transformers with AltUp, Laurel, the sparse MLPs, widths per
layer, KV sharing and a per-layer table shorter than the vocabulary; weight updates; batch invariance) and
[gemma3n-dense] (tensor parallelism): the layer plan of the released shape, the KV cache per owning layer, the
released checkpoint's form (the multimodal wrapper with its towers, KV-shared layers' leftover k/v tensors) and the
options refused."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from helpers.engine_archs import ENGINE, MISSING, _hf
from helpers.hf_reference import gemma3n_reference_problem
from helpers.layer_plan_options import assert_options_refused
from helpers.localize_fault import assert_localize_finds_layer_1_attention
from safetensors.torch import load_file, save_file
from test_gemma4 import _replay  # two prompts' replayed logprobs

from replayllm import LLM, SamplingParams
from replayllm.gemma4_facts import layer_plans
from replayllm.model_runner_v2.kv_cache import kv_block_bytes

pytestmark = pytest.mark.skipif("gemma3n" in MISSING, reason=MISSING.get("gemma3n", ""))


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("gemma3n"))
    _hf("gemma3n").save_pretrained(out)
    return out


def test_the_layer_plan_of_the_released_shape():
    """gemma-3n-E2B's text config (30 layers, a full one every fifth, the last 10 sharing): one head shape, sliding
    consumers over layer 18's cache, full ones over layer 19's; each layer its listed MLP width."""
    kinds = ["full_attention" if i % 5 == 4 else "sliding_attention" for i in range(30)]
    widths = [8192] * 29 + [4096]
    e2b = SimpleNamespace(num_hidden_layers=30, layer_types=kinds, head_dim=256, num_key_value_heads=2,
                          num_kv_shared_layers=10, intermediate_size=widths, global_head_dim=None)
    plans = layer_plans("Gemma3nForConditionalGeneration", e2b)
    assert [p.kv_layer for p in plans[20:]] == [19 if k == "full_attention" else 18 for k in kinds[20:]]
    assert all(p.shares_kv for p in plans[20:]) and not any(p.shares_kv for p in plans[:20])
    assert {(p.head_dim, p.kv_heads, p.k_eq_v) for p in plans} == {(256, 2, False)}
    assert [p.mlp_width for p in plans] == widths
    with pytest.raises(ValueError, match="names 29 widths for 30 layers"):
        layer_plans("Gemma3nForCausalLM", SimpleNamespace(**{**vars(e2b), "intermediate_size": widths[:29]}))


def test_a_kv_cache_per_owning_layer(path):
    """Layers 0-2 own caches (2 KV heads of 16 each); layers 3 and 4 attend over layers 1's and 2's."""
    llm = LLM(path, **ENGINE)
    engine = llm.llm_engine
    assert engine.model_config.num_kv_layers == 3
    assert kv_block_bytes(engine.config) == 2 * 16 * 4 * 3 * (2 * 16)  # K and V, 16 tokens, fp32, 3 layers
    assert [layer.self_attn.attn.layer_idx for layer in engine.runner.model.model.layers] == [0, 1, 2, 1, 2]


def test_the_released_checkpoint_form(path, tmp_path):
    """The hub's files: Gemma3nForConditionalGeneration (`model.language_model.*` beside the vision and audio towers
    and their embedders, config.json's text_config) with k / v tensors kept in the KV-shared layers: the same
    logprobs as the text-only save of the same weights."""
    ref = _replay(LLM(path, **ENGINE))
    text_config = json.loads(open(f"{path}/config.json").read())
    released = tmp_path / "released"
    released.mkdir()
    (released / "config.json").write_text(json.dumps({
        "architectures": ["Gemma3nForConditionalGeneration"], "model_type": "gemma3n", "text_config": text_config,
        "vision_config": {"model_type": "gemma3n_vision", "hidden_size": 32},
        "audio_config": {"model_type": "gemma3n_audio", "hidden_size": 32}, "dtype": "float32"}))
    tensors = {name.replace("model.", "model.language_model.", 1): t
               for name, t in load_file(f"{path}/model.safetensors").items()}
    for layer, source in ((3, 1), (4, 2)):  # leftovers in the shared layers (transformers ignores them)
        for name in ("k_proj.weight", "v_proj.weight", "k_norm.weight"):
            own = f"model.language_model.layers.{source}.self_attn.{name}"
            tensors[own.replace(f"layers.{source}.", f"layers.{layer}.")] = tensors[own].clone()
    for name in ("model.vision_tower.timm_model.conv_stem.conv.weight", "model.audio_tower.conformer.0.ffw.weight",
                 "model.embed_vision.embedding.weight", "model.embed_audio.embedding_projection.weight"):
        tensors[name] = torch.randn(4, 4)
    save_file(tensors, released / "model.safetensors", metadata={"format": "pt"})
    assert _replay(LLM(str(released), **ENGINE)) == ref


def test_options_refused(path):
    """Piecewise graphs (the layers pass four streams: decode steps keep full graphs), and tensor parallelism over
    the sparse MLPs (a gate row's mean and std need the whole row; gemma3n-dense runs TP=2 in
    test_engine_architectures.py)."""
    assert_options_refused(path, [(dict(cudagraph_mode="PIECEWISE"), "four AltUp streams"),
                                  (dict(tensor_parallel_size=2), "activation sparsity")])


def test_prompt_ids_past_the_per_layer_table(path):
    """The per-layer table has 280 rows and the vocabulary 300: a prompt of ids past the table (row 0 in
    transformers) is served, its greedy tokens as transformers' own generate."""
    _skip_without_a_reference()
    hf = _hf("gemma3n")
    prompt = [281, 290, 299, 5, 285]
    out = LLM(path, **ENGINE).generate([{"prompt_token_ids": prompt}],
                                       SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False, min_new_tokens=5)[0, 5:].tolist()
    assert out[0].outputs[0].token_ids == want


def test_localize_refuses_altup(path):
    """`replayllm diff --localize` rebuilds one residual stream (embedding + sub-block outputs): AltUp's four streams
    are not it, so a clear error rather than a wrong answer."""
    _skip_without_a_reference()
    with pytest.raises(ValueError, match="--localize does not support .* AltUp"):
        assert_localize_finds_layer_1_attention(path, path)


def _skip_without_a_reference() -> None:
    problem = gemma3n_reference_problem()
    if problem:
        pytest.skip(problem)
