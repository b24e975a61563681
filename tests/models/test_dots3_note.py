"""Dots 3 Note beyond test_engine_architectures.py's checks (logprobs against transformers, weight updates from its
in-memory names, batch invariance, tensor parallelism) and test_multimodal_text.py's wrapper: the hub's config.json
form (its swa_* keys, no per_layer_config) with MTP tensors beside the layers, the context cap, the KV cache shapes,
what is refused, each kind of layer's rotary in bf16, and the multimodal checkpoint's top-level text config."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from helpers import engine_archs
from helpers.engine_archs import ARCHS, MISSING, _hf
from helpers.layer_plan_options import assert_options_refused
from helpers.recent_archs import _DOTS3
from helpers.tolerances import LOGPROB_TOL
from safetensors.torch import load_file, save_file
from test_engine_architectures import ENGINE
from test_recent_archs import _score

from replayllm import LLM
from replayllm.config import EngineConfig, ModelConfig

pytestmark = pytest.mark.skipif("dots3_note" in MISSING, reason=MISSING.get("dots3_note", ""))

# config.json as the released checkpoints write it: the text config at the top level (transformers' class reads it
# whole), the sliding layers' geometry and theta in swa_* keys, the dense layers by first_k_dense_replace, the layer
# kinds derived (layers 0, 1 and every 4th from 1 indexed; the others sliding)
_HUB_KEYS = dict(first_k_dense_replace=2, moe_shared_expert_intermediate_size=48, sliding_window_size=8,
                 rope_theta=1e6, swa_rope_theta=2e4, swa_num_attention_heads=2, swa_num_key_value_heads=2,
                 swa_q_lora_rank=20, swa_kv_lora_rank=28, swa_head_dim=32, swa_qk_nope_head_dim=24,
                 swa_v_head_dim=12)
_DERIVED = ("per_layer_config", "layer_types", "mlp_layer_types", "rope_parameters", "shared_experts_intermediate_size",
            "sliding_window")


def test_dots3_note_hub_config_form(tmp_path, monkeypatch):
    """A checkpoint whose config.json has the hub's keys (swa_*, first_k_dense_replace, rope_theta / swa_rope_theta)
    and whose safetensors carry an MTP layer (`model.layers.<num_hidden_layers>.*`, `model.mtp.*`) and the indexers:
    transformers reads it as the model saved, and the engine scores what transformers scores, with a KV cache shape
    per kind of layer and the context capped at index_topk."""
    legacy = {k: v for k, v in _DOTS3.items() if k not in _DERIVED}
    monkeypatch.setitem(ARCHS, "dots3_note-hub", (transformers.Dots3NoteTextConfig, transformers.Dots3NoteForCausalLM,
                                                  dict(legacy, **_HUB_KEYS)))
    monkeypatch.setattr(engine_archs, "EAGER_EXPERTS", engine_archs.EAGER_EXPERTS + ("dots3_note-hub",))
    hf = _hf("dots3_note-hub")
    assert hf.config.layer_types == ["indexed_attention", "indexed_attention", "sliding_attention",
                                     "sliding_attention"]
    hf.save_pretrained(str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**{k: v for k, v in config.items() if k not in _DERIVED},
                                                      **_HUB_KEYS}))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert "model.layers.0.self_attn.indexer.wq_b.weight" in tensors and "model.layers.3.mlp.experts.7.up_proj.weight" \
        in tensors  # the hub's per-expert tensors (transformers' save reverses its fusion)
    extra = {"model.layers.4.self_attn.q_a_proj.weight": torch.ones(24, 64), "model.mtp.norm.weight": torch.ones(64)}
    save_file({**tensors, **extra}, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    again = transformers.Dots3NoteForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    for key in ("layer_types", "mlp_layer_types", "rope_parameters"):
        assert getattr(again.config, key) == getattr(hf.config, key)
    assert all(torch.equal(again.state_dict()[k], v) for k, v in hf.state_dict().items())
    mc = ModelConfig.from_pretrained(str(tmp_path))
    assert mc.kv_layer_shapes == ((4, 24), (4, 24), (2, 32), (2, 32)) and mc.dense_attention_limit == 128
    assert mc.moe_layers == (2, 3) and mc.sliding_window == 8
    with pytest.raises(ValueError, match="index_topk=128"):
        EngineConfig(model=str(tmp_path), device="cpu", skip_tokenizer_init=True, max_model_len=129)
    assert _score(LLM(str(tmp_path), **ENGINE), hf, list(range(5, 25)), [3, 7, 11, 13]) \
        <= LOGPROB_TOL


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("dots3_note"))
    _hf("dots3_note").save_pretrained(path)
    return path


def test_dots3_note_engine_options(saved, tmp_path):
    """Piecewise CUDA graphs refused (the kinds' head shapes differ), a tensor-parallel size that does not divide the
    sliding layers' 2 heads refused; without indexed layers (use_dsa false) no context cap."""
    config = assert_options_refused(saved, [
        (dict(cudagraph_mode="PIECEWISE"), "head shapes differ"),
        (dict(tensor_parallel_size=4), "must divide every Dots 3 Note layer's heads and its shared experts' width, got "
                                       "\\[2\\]")])
    assert config.model_config.kv_layer_shapes == ((4, 24), (2, 32), (4, 24), (2, 32))
    _hf("dots3_note-full").save_pretrained(str(tmp_path))
    assert EngineConfig(model=str(tmp_path), device="cpu", skip_tokenizer_init=True,
                        max_model_len=256).model_config.dense_attention_limit is None


def _rewritten(saved: str, tmp_path, **changes) -> str:
    config = json.loads(open(f"{saved}/config.json").read())
    (tmp_path / "config.json").write_text(json.dumps({**config, **changes}))
    (tmp_path / "model.safetensors").symlink_to(f"{saved}/model.safetensors")
    return str(tmp_path)


@pytest.mark.parametrize("case", ["yarn", "per_layer_width"])
def test_dots3_note_refuses_what_it_cannot_honour(saved, tmp_path, case):
    """At load, a clear ValueError: rope scaling (transformers' attention keeps qk_head_dim^-0.5 under it, the
    engine's MLA would take YaRN's mscale), a per-layer key beyond the attention geometry (the sliding layers' MLP
    width). (Sliding layers of two geometries transformers' config refuses itself.)"""
    config = json.loads(open(f"{saved}/config.json").read())
    per_layer = config["per_layer_config"]
    changes, says = {
        "yarn": (dict(rope_parameters={**config["rope_parameters"], "sliding_attention": {
            "rope_type": "yarn", "rope_theta": 5e4, "factor": 2.0, "original_max_position_embeddings": 128}}),
            "rope_type 'yarn'"),
        "per_layer_width": (dict(per_layer_config={k: {**v, "intermediate_size": 80} for k, v in per_layer.items()}),
                            "per_layer_config sets \\['intermediate_size'\\]"),
    }[case]
    with pytest.raises(ValueError, match=says):
        ModelConfig.from_pretrained(_rewritten(saved, tmp_path, **changes))



@pytest.mark.parametrize("layer", [0, 1])
def test_dots3_note_rotary_per_kind_is_transformers_in_bf16(layer):
    """Each kind's rotary as transformers' attention applies it, in bf16, bit for bit over positions up to 255: the
    indexed layer 0's from fp32 tables in fp32, rounded once (transformers' tables come from the fp32 embeddings
    there), the sliding layer 1's from bf16 tables op by op, each with its kind's theta and width. Transformers lays
    the rotated pairs out de-interleaved ([evens | odds]); the engine rotates them in place (the same products)."""
    from transformers.models.dots3_note import modeling_dots3_note as modeling

    from replayllm.model_runner_v2.models.dots3_note import Dots3NoteForCausalLM

    config = _hf("dots3_note").config
    kind = config.layer_types[layer]
    attn = Dots3NoteForCausalLM(config).model.layers[layer].self_attn
    g = torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 1, 7, 100, 201, 255])
    q = (torch.randn(6, attn.num_heads, attn.head_dim, generator=g) * 3).to(torch.bfloat16)  # [T, H, rope | nope]
    k = (torch.randn(6, attn.num_heads, attn.head_dim, generator=g) * 3).to(torch.bfloat16)
    ours_q, ours_k = attn.rotary(positions, q, k)
    x = torch.zeros(1, 6, 64, dtype=torch.float32 if kind == "indexed_attention" else torch.bfloat16)
    cos, sin = modeling.Dots3NoteTextRotaryEmbedding(config)(x, positions[None], kind)
    rope = attn.rope
    ref_q, ref_k = modeling.apply_rotary_pos_emb_interleave(q[None, ..., :rope].transpose(1, 2),
                                                            k[None, ..., :rope].transpose(1, 2), cos, sin)
    for ours, ref, raw in ((ours_q, ref_q, q), (ours_k, ref_k, k)):
        ours = ours.view(6, attn.num_heads, attn.head_dim)
        assert torch.equal(torch.cat([ours[..., 0:rope:2], ours[..., 1:rope:2]], dim=-1),
                           ref.to(torch.bfloat16)[0].transpose(0, 1))
        assert torch.equal(ours[..., rope:], raw[..., rope:])


def test_dots3_note_multimodal_checkpoint_with_the_text_config_at_the_top(tmp_path):
    """The released multimodal checkpoints keep the text model's keys at config.json's top level (no text_config:
    transformers' Dots3NoteConfig builds one from them): served as the text model, the towers skipped, scoring what
    the wrapper scores."""
    from test_multimodal_text import _wrapper

    hf = _wrapper("dots3_note")
    hf.save_pretrained(str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    text = {k: v for k, v in config.pop("text_config").items()
            if k not in ("model_type", "architectures", "dtype", "transformers_version")}
    (tmp_path / "config.json").write_text(json.dumps({**config, **text}))
    mc = ModelConfig.from_pretrained(str(tmp_path))
    assert (mc.architecture, mc.text_of) == ("Dots3NoteForCausalLM", "Dots3NoteForConditionalGeneration")
    assert mc.kv_layer_shapes == ((4, 24), (2, 32), (4, 24), (2, 32))
    assert _score(LLM(str(tmp_path), **ENGINE), hf, list(range(5, 25)), [3, 7, 11, 13]) <= LOGPROB_TOL
