"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL's multimodal checkpoints served as their language model (models/qwen_vl.py): the
engine built from `text_config`, the language model's tensors taken under the checkpoint's names and the module's
(`model.language_model.*`), the vision tower (`visual.*`) skipped; on text, M-RoPE is the ordinary rotary, so the
engine's logprobs meet transformers' own multimodal model's (its 3-D position ids, its mrope sections) on prompts
past the sections' widths; weight updates from the multimodal module."""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers.hf_reference import max_gap_to_transformers, save_both_namings, spread_norms, trace_logprobs
from helpers.tolerances import LOGPROB_TOL
from safetensors.torch import save_file

from replayllm import LLM, SamplingParams
from replayllm.config import ModelConfig

TEXT = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=256, pad_token_id=0,
            bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
MODELS = {  # name -> (config class, model class, text config, vision config); sections sum to head_dim / 2
    "qwen2_5_vl": (transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration,
                   dict(TEXT, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                               "mrope_section": [2, 3, 3]}),
                   dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                        fullatt_block_indexes=[0])),
    "qwen3_vl": (transformers.Qwen3VLConfig, transformers.Qwen3VLForConditionalGeneration,
                 dict(TEXT, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                             "mrope_interleaved": True}),
                 dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                      deepstack_visual_indexes=[0])),
    # Qwen3-VL-MoE: Qwen3-MoE's layers (8 experts of 24, top 2 always renormalised; layer 1 dense); its checkpoint
    # stores the experts fused and transposed
    "qwen3_vl_moe": (transformers.Qwen3VLMoeConfig, transformers.Qwen3VLMoeForConditionalGeneration,
                     dict(TEXT, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, mlp_only_layers=[1],
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                           "mrope_interleaved": True}),
                     dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                          deepstack_visual_indexes=[0])),
}
ENGINE = dict(device="cpu", dtype="float32", skip_tokenizer_init=True, enable_trace_replay=True, max_model_len=128)


@pytest.fixture(scope="module", params=list(MODELS))
def checkpoints(request, tmp_path_factory):
    """(save_pretrained's checkpoint; the same tensors under the module's own names; the transformers model)."""
    config_cls, model_cls, text, vision = MODELS[request.param]
    torch.manual_seed(0)
    config = config_cls(text_config=text, vision_config=vision)
    if request.param == "qwen3_vl_moe":
        config.text_config._experts_implementation = "eager"  # the per-expert loop that defines the model
    hf = model_cls(config).to(torch.float32).eval()
    spread_norms(hf)
    hub, module = tmp_path_factory.mktemp("hub"), tmp_path_factory.mktemp("module")
    state = save_both_namings(hf, hub, module)
    assert any(n.startswith("model.language_model.") for n in state)
    assert any(n.startswith(("model.visual.", "visual.")) for n in state)
    return str(hub), str(module), hf


def test_the_language_model_scores_what_transformers_scores(checkpoints):
    hub, module, hf = checkpoints
    mc = ModelConfig.from_pretrained(hub)
    assert (mc.num_layers, mc.hidden_size, mc.head_dim) == (3, 64, 16)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (4, 17, 60)]
    traces = [torch.randint(3, 300, (8,), generator=g).tolist() for _ in prompts]
    runs = [trace_logprobs(LLM(path, **ENGINE), prompts, traces) for path in (hub, module)]
    assert runs[0] == runs[1]  # both names of the same tensors: the same engine
    assert max_gap_to_transformers(hf, prompts, traces, runs[0]) <= LOGPROB_TOL


def test_weight_updates_from_the_multimodal_module(checkpoints):
    """LLM.load_weights takes the trainer's whole multimodal module, its vision tower's tensors skipped."""
    hub, _, hf = checkpoints
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True, skip_reading_prefix_cache=True)
    llm = LLM(hub, **{**ENGINE, "load_format": "dummy"})
    prompt = [{"prompt_token_ids": [5, 17, 99, 3, 42]}]
    dummy = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert llm.load_weights(hf) > 0
    loaded = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    built = LLM(hub, **ENGINE).generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert loaded.token_ids == built.token_ids and loaded.logprobs == built.logprobs
    assert loaded.logprobs != dummy.logprobs


def test_a_hub_form_config_reads_as_transformers_current_one(checkpoints, tmp_path):
    """Qwen2.5-VL's hub config.json (transformers 4.49's form): the text fields at the top level beside
    `vision_config`, the rope as `rope_scaling` {"type": "mrope", "mrope_section"} and `rope_theta`. The engine built
    from it computes what the current form's does, bit for bit."""
    import json
    from pathlib import Path

    hub, _, hf = checkpoints
    config = json.loads((Path(hub) / "config.json").read_text())
    if config["model_type"] != "qwen2_5_vl":
        pytest.skip("Qwen3-VL's hub configs nest text_config already (the current form)")
    text = config.pop("text_config")
    rope = text.pop("rope_parameters")
    config.update({k: v for k, v in text.items() if k not in ("model_type", "architectures")})
    config.update(rope_theta=rope.pop("rope_theta"), rope_scaling={**rope, "type": "mrope"})
    (tmp_path / "config.json").write_text(json.dumps(config))
    for f in Path(hub).iterdir():
        if f.name != "config.json":
            (tmp_path / f.name).symlink_to(f)
    prompts, traces = [[5, 17, 99, 3, 42] * 6], [[7, 8, 9, 10]]
    same = [trace_logprobs(LLM(path, **ENGINE), prompts, traces) for path in (hub, str(tmp_path))]
    assert same[0] == same[1]


def test_the_hubs_transposed_fused_experts_load_as_the_modules(checkpoints, tmp_path):
    """Qwen3-VL-MoE's released checkpoints store `mlp.experts.gate_up_proj` [E, H, 2I] and `down_proj` [E, I, H]
    (transposed from the module's): written so, they load to the same engine, bit for bit."""
    from pathlib import Path

    from safetensors.torch import load_file

    hub, _, hf = checkpoints
    if not hasattr(hf.config.text_config, "num_experts"):
        pytest.skip("a dense model: no fused experts")
    tensors = load_file(str(Path(hub) / "model.safetensors"))
    fused = [n for n in tensors if n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]
    assert fused
    save_file({n: t.transpose(1, 2).contiguous() if n in fused else t for n, t in tensors.items()},
              str(tmp_path / "model.safetensors"))
    for f in Path(hub).iterdir():
        if f.name != "model.safetensors":
            (tmp_path / f.name).symlink_to(f)
    prompts, traces = [[5, 17, 99, 3, 42] * 6], [[7, 8, 9, 10]]
    same = [trace_logprobs(LLM(path, **ENGINE), prompts, traces) for path in (hub, str(tmp_path))]
    assert same[0] == same[1]
