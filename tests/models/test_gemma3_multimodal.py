"""Gemma-3-4B / 12B / 27B's multimodal checkpoints (Gemma3ForConditionalGeneration) served as their language model:
the engine built from `text_config`, the language model's tensors taken under both of their names (transformers >=
4.52's module names `model.language_model.*` and the checkpoints' `language_model.model.*`, which save_pretrained
still writes), the vision tower's skipped; its logprobs against transformers' own multimodal model on text; `replayllm
diff --localize` against it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from helpers.hf_reference import max_gap_to_transformers, save_both_namings, trace_logprobs
from helpers.localize_fault import assert_localize_finds_layer_1_attention
from helpers.tolerances import LOGPROB_TOL
from safetensors.torch import load_file

from replayllm import LLM, SamplingParams
from replayllm.config import ModelConfig

TEXT = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24, sliding_window=8, rms_norm_eps=1e-6,
            max_position_embeddings=256, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            pad_token_id=0, bos_token_id=1, eos_token_id=2)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
              patch_size=14)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[str, str, torch.nn.Module]:
    """(save_pretrained's checkpoint: the hub's `language_model.model.*` names; the same tensors under the module's
    own names, `model.language_model.*`, as a checkpoint written from its state dict; the transformers model)."""
    torch.manual_seed(0)
    config = transformers.Gemma3Config(text_config=TEXT, vision_config=VISION, mm_tokens_per_image=4,
                                       eos_token_id=[2, 299])
    hf = transformers.Gemma3ForConditionalGeneration(config).to(torch.float32).eval()
    with torch.no_grad():  # norms away from their zero start, so a misapplied one shows
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.uniform_(-0.5, 0.5)
    hub, module = tmp_path_factory.mktemp("hub"), tmp_path_factory.mktemp("module")
    state = save_both_namings(hf, hub, module)
    names = load_file(str(hub / "model.safetensors"))
    assert any(n.startswith("language_model.model.") for n in names) and any(n.startswith("vision_tower.")
                                                                              for n in names)
    assert any(n.startswith("model.language_model.") for n in state) and any(n.startswith("model.vision_tower.")
                                                                              for n in state)
    return str(hub), str(module), hf


def test_the_language_model_of_a_multimodal_checkpoint_scores_what_transformers_scores(checkpoints, tmp_path):
    hub, module, hf = checkpoints
    mc = ModelConfig.from_pretrained(hub)
    assert (mc.architecture, mc.num_layers, mc.hidden_size) == ("Gemma3ForConditionalGeneration", 3, 64)
    assert set(mc.eos_token_ids) == {2, 299}
    bare = tmp_path / "config-only"  # no generation_config.json: the EOS ids come from config.json's top level
    bare.mkdir()
    (bare / "config.json").write_text((Path(hub) / "config.json").read_text())
    assert set(ModelConfig.from_pretrained(str(bare)).eos_token_ids) == {2, 299}
    assert json.loads((Path(hub) / "config.json").read_text())["architectures"] == ["Gemma3ForConditionalGeneration"]
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (4, 17, 30)]
    traces = [torch.randint(3, 300, (8,), generator=g).tolist() for _ in prompts]
    engine = dict(device="cpu", dtype="float32", skip_tokenizer_init=True, enable_trace_replay=True, max_model_len=128)
    runs = [trace_logprobs(LLM(path, **engine), prompts, traces) for path in (hub, module)]
    assert runs[0] == runs[1]  # both names of the same tensors: the same engine
    assert max_gap_to_transformers(hf, prompts, traces, runs[0]) <= LOGPROB_TOL


def test_weight_updates_from_the_multimodal_module(checkpoints):
    """LLM.load_weights takes the trainer's whole multimodal module: its language model's tensors, the vision
    tower's skipped; the engine then computes what one built from that module computes."""
    hub, _, hf = checkpoints
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True, skip_reading_prefix_cache=True)
    llm = LLM(hub, device="cpu", dtype="float32", skip_tokenizer_init=True, load_format="dummy", max_model_len=128)
    prompt = [{"prompt_token_ids": [5, 17, 99, 3, 42]}]
    dummy = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert llm.load_weights(hf) > 0
    loaded = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    fresh = LLM(hub, device="cpu", dtype="float32", skip_tokenizer_init=True, max_model_len=128)
    built = fresh.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert loaded.token_ids == built.token_ids and loaded.logprobs == built.logprobs
    assert loaded.logprobs != dummy.logprobs


def test_localize_against_transformers_multimodal_class(checkpoints, tmp_path):
    """`replayllm diff --localize` between the engine and transformers' multimodal class (its decoder stack in
    model.language_model, fed embeddings): a fault planted in layer 1's attention output is found there."""
    hub, _, hf = checkpoints
    faulty = transformers.Gemma3ForConditionalGeneration.from_pretrained(hub, dtype=torch.float32)
    param = faulty.model.language_model.layers[1].self_attn.o_proj.weight
    with torch.no_grad():
        param.add_(torch.randn_like(param) * param.std() * 0.3)
    faulty.save_pretrained(str(tmp_path / "faulty"))
    assert_localize_finds_layer_1_attention(hub, str(tmp_path / "faulty"))
