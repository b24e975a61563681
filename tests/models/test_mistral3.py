"""Ministral 3 and Mistral Small 3.x's multimodal checkpoints (Mistral3ForConditionalGeneration) served as their
language model (models/mistral3.py): the language model's tensors under both of their names, the vision tower's
skipped, logprobs against transformers' own multimodal model on text, for a Ministral 3 text config (Llama 4's query
temperature) and a Mistral one (none); the temperature computed only where sequences reach it.
test_engine_architectures.py[ministral3] covers the text-only class (weight updates, batch invariance, TP=2)."""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers.hf_reference import (
    max_gap_to_transformers,
    save_both_namings,
    spread_norms,
    teacher_forced,
    trace_logprobs,
)
from helpers.tolerances import LOGPROB_TOL
from safetensors.torch import load_file

from replayllm import LLM, SamplingParams
from replayllm.config import ModelConfig
from replayllm.model_runner_v2.models.mistral3 import QueryTemperature

ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
TEXT = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=256, pad_token_id=0,
            bos_token_id=1, eos_token_id=2)
TEXT_CONFIGS = {"ministral3": dict(TEXT, model_type="ministral3",
                                   rope_parameters={**ROPE, "llama_4_scaling_beta": 0.1}),
                "mistral": dict(TEXT, model_type="mistral", rope_parameters=ROPE)}
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, head_dim=16,
              image_size=28, patch_size=14)
ENGINE = dict(device="cpu", dtype="float32", skip_tokenizer_init=True, enable_trace_replay=True)


@pytest.fixture(scope="module", params=list(TEXT_CONFIGS))
def checkpoints(request, tmp_path_factory) -> tuple[str, str, torch.nn.Module]:
    """(save_pretrained's checkpoint; the same tensors under the module's own names, `model.language_model.*`;
    the transformers model)."""
    torch.manual_seed(0)
    config = transformers.Mistral3Config(text_config=TEXT_CONFIGS[request.param], vision_config=VISION)
    hf = transformers.Mistral3ForConditionalGeneration(config).to(torch.float32).eval()
    spread_norms(hf)
    hub, module = tmp_path_factory.mktemp("hub"), tmp_path_factory.mktemp("module")
    state = save_both_namings(hf, hub, module)
    assert any(n.startswith("vision_tower.") for n in load_file(str(hub / "model.safetensors")))
    assert any(n.startswith("model.language_model.") for n in state)
    return str(hub), str(module), hf


def test_the_language_model_scores_what_transformers_scores(checkpoints):
    hub, module, hf = checkpoints
    mc = ModelConfig.from_pretrained(hub)
    assert (mc.architecture, mc.num_layers, mc.hidden_size) == ("Mistral3ForConditionalGeneration", 3, 64)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (4, 17, 60)]  # up to 4x the context of 16
    traces = [torch.randint(3, 300, (8,), generator=g).tolist() for _ in prompts]
    runs = [trace_logprobs(LLM(path, **ENGINE, max_model_len=128), prompts, traces) for path in (hub, module)]
    assert runs[0] == runs[1]  # both names of the same tensors: the same engine
    assert max_gap_to_transformers(hf, prompts, traces, runs[0]) <= LOGPROB_TOL


def test_the_temperature_runs_only_where_sequences_reach_it(checkpoints):
    """Ministral 3's factor is 1 below the pretraining context: an engine whose sequences stay there computes none
    (and still scores what transformers scores); Mistral's config has no temperature at all."""
    hub, _, hf = checkpoints
    beta = hf.config.text_config.rope_parameters.get("llama_4_scaling_beta")
    for max_model_len, active in ((128, bool(beta)), (16, False)):  # the inactive engine last, scored below
        llm = LLM(hub, **ENGINE, max_model_len=max_model_len)
        temps = [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, QueryTemperature)]
        assert len(temps) == 3 and all(t.active == active for t in temps)
    prompt, trace = list(range(3, 11)), list(range(20, 28))  # 16 positions
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(trace_decode_token_ids=trace, logprobs=0),
                       use_tqdm=False)[0].outputs[0]
    lp, tokens = teacher_forced(hf, prompt, trace)
    engine = torch.tensor([d[t].logprob for t, d in zip(out.token_ids, out.logprobs)])
    assert (engine - lp[torch.arange(len(tokens)), tokens]).abs().max().item() <= LOGPROB_TOL


def test_the_factor_is_transformers():
    positions = torch.tensor([0, 15, 16, 47, 48, 1000])
    q = torch.ones(6, 4)
    theirs = transformers.models.ministral3.modeling_ministral3.get_llama_4_attn_scale(positions[None], 0.1, 16)
    assert torch.equal(QueryTemperature(0.1, 16)(positions, q), theirs[0, 0].expand(6, 4))
