"""Gemma 4 (models/gemma4.py, gemma4_facts.py) beyond test_engine_architectures.py[gemma4] (logprobs against
transformers with every dense feature: KV sharing, K = V full layers of their own head dim, the proportional rope,
per-layer inputs, layer scalars; weight updates; batch invariance): the layer plan of the released shapes, the KV
cache per layer, the released checkpoints' forms (the multimodal wrapper with its towers, config.json's
global_head_dim, KV-shared layers' leftover k/v tensors) and the options refused."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import transformers
from helpers.engine_archs import ENGINE, MISSING, _hf
from helpers.layer_plan_options import assert_options_refused
from safetensors.torch import load_file, save_file

from replayllm import LLM, SamplingParams
from replayllm.gemma4_facts import gemma4_layers
from replayllm.model_runner_v2.kv_cache import kv_block_bytes

pytestmark = pytest.mark.skipif("gemma4" in MISSING, reason=MISSING.get("gemma4", ""))


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("gemma4"))
    _hf("gemma4").save_pretrained(out)
    return out


def _replay(llm: LLM) -> list:
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (4, 21)]
    params = [SamplingParams(trace_decode_token_ids=torch.randint(3, 300, (6,), generator=g).tolist(), logprobs=2)
              for _ in prompts]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[{t: (lp.logprob, lp.rank) for t, lp in d.items()} for d in o.outputs[0].logprobs] for o in outs]


def test_the_layer_plan_of_the_released_shapes():
    """gemma-4-E2B's plan (35 layers, a full one every fifth, the last 20 sharing): sliding consumers attend over
    layer 13's cache, full ones over layer 14's, with double-wide MLPs; 31B's full layers their own head dim and KV
    heads (K = V); both config spellings (released global_head_dim, transformers' per_layer_config)."""
    kinds = ["full_attention" if i % 5 == 4 else "sliding_attention" for i in range(35)]
    e2b = SimpleNamespace(num_hidden_layers=35, layer_types=kinds, head_dim=256, num_key_value_heads=1,
                          global_head_dim=512, attention_k_eq_v=False, num_kv_shared_layers=20,
                          use_double_wide_mlp=True, intermediate_size=6144)
    plans = gemma4_layers(e2b)
    assert [p.kv_layer for p in plans[15:]] == [14 if k == "full_attention" else 13 for k in kinds[15:]]
    assert all(p.shares_kv and p.mlp_width == 12288 for p in plans[15:])
    assert [(p.head_dim, p.kv_heads) for p in plans[:5]] == [(256, 1)] * 4 + [(512, 1)]
    big = dict(num_hidden_layers=6, layer_types=kinds[:5] + ["full_attention"], head_dim=256,
               num_key_value_heads=16, attention_k_eq_v=True, num_kv_shared_layers=0, intermediate_size=21504)
    for form in (dict(global_head_dim=512, num_global_key_value_heads=4),
                 dict(per_layer_config={"04": {"head_dim": 512, "num_key_value_heads": 4},
                                        "05": {"head_dim": 512, "num_key_value_heads": 4}})):
        plans = gemma4_layers(SimpleNamespace(**big, **form))
        assert [(p.head_dim, p.kv_heads, p.k_eq_v) for p in plans] == [(256, 16, False)] * 4 + [(512, 4, True)] * 2
    with pytest.raises(ValueError, match="shares the KV cache"):
        gemma4_layers(SimpleNamespace(**{**big, "layer_types": kinds[:4] + ["full_attention"] * 2,
                                         "num_kv_shared_layers": 2, "global_head_dim": 512}))


def test_a_kv_cache_per_owning_layer_in_its_own_shape(path):
    """Layers 0-2 own caches (two 2 x 16 sliding, one 1 x 32 full); layers 3 and 4 none; a block's bytes sum them."""
    llm = LLM(path, **ENGINE)
    engine = llm.llm_engine
    assert engine.model_config.num_kv_layers == 3
    assert [tuple(c.shape[3:]) for c in engine.runner.kv_caches] == [(2, 16), (2, 16), (1, 32)]
    assert kv_block_bytes(engine.config) == 2 * 16 * 4 * (2 * 16 + 2 * 16 + 32)  # K and V, 16 tokens, fp32


def test_the_released_checkpoint_forms(path, tmp_path):
    """The hub's files: Gemma4ForConditionalGeneration (`model.language_model.*` beside vision and audio towers and
    their embedders), config.json naming global_head_dim / num_global_key_value_heads, and k / v tensors kept for
    the KV-shared layers: the same logprobs as transformers' text-only save of the same weights."""
    ref = _replay(LLM(path, **ENGINE))
    text = transformers.AutoModelForCausalLM.from_pretrained(path)
    vision = transformers.Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=2, head_dim=16, patch_size=4,
                                             pooling_kernel_size=2, position_embedding_size=64)
    audio = transformers.Gemma4AudioConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                           subsampling_conv_channels=[8, 4], output_proj_dims=48)
    mm = transformers.Gemma4ForConditionalGeneration(transformers.Gemma4Config(
        text_config=text.config.to_dict(), vision_config=vision, audio_config=audio, image_token_id=250,
        video_token_id=251, audio_token_id=252, boi_token_id=253, eoi_token_id=254, boa_token_id=255,
        eoa_token_index=249)).eval()
    mm.model.language_model.load_state_dict(text.model.state_dict())
    mm.save_pretrained(tmp_path / "mm")
    tensors = load_file(tmp_path / "mm" / "model.safetensors")
    assert {k.split(".")[1] for k in tensors} >= {"vision_tower", "audio_tower", "embed_audio", "embed_vision"}
    assert _replay(LLM(str(tmp_path / "mm"), **ENGINE)) == ref

    released = tmp_path / "released"
    released.mkdir()
    config = json.loads(open(f"{path}/config.json").read())
    config.pop("per_layer_config")
    config.update(global_head_dim=32, num_global_key_value_heads=1)
    (released / "config.json").write_text(json.dumps(config))
    tensors = load_file(f"{path}/model.safetensors")
    for layer, source in ((3, 1), (4, 2)):  # leftovers in the shared layers (transformers ignores them)
        for name in ("k_proj.weight", "k_norm.weight"):
            own = f"model.layers.{source}.self_attn.{name}"
            tensors[own.replace(f"layers.{source}.", f"layers.{layer}.")] = tensors[own].clone()
    save_file(tensors, released / "model.safetensors", metadata={"format": "pt"})
    assert _replay(LLM(str(released), **ENGINE)) == ref


def test_options_gemma4_refuses(path):
    assert_options_refused(path, [
        (dict(cudagraph_mode="FULL_AND_PIECEWISE"), "head dims differ"),
        (dict(tensor_parallel_size=2), "must divide every Gemma 4 layer's KV heads, got \\[1\\]")])


def test_moe_routes_match_transformers_and_replay_bit_for_bit(tmp_path):
    """gemma-4-26B-A4B's form: every layer's top 2 of 4 experts as transformers' router chooses them; replayed bit
    for bit."""
    from helpers.moe_routes import assert_routes_match_transformers_and_replay

    hf = _hf("gemma4-moe")
    hf.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), **ENGINE, enable_return_routed_experts=True)
    assert llm.llm_engine.model_config.moe_layers == (0, 1, 2)
    assert_routes_match_transformers_and_replay(
        llm, hf, dense_layers=(), sparse_layers=(0, 1, 2),
        router=lambda m, i: (m.model.layers[i].router, lambda out: out[2]))
