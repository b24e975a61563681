"""OLMo (models/olmo.py: the first OLMo; OLMo 2 / 3 are olmo2.py) against transformers: the parameter-free fp32
LayerNorms, `clip_qkv` clamping q / k / v (a bound the random model's projections cross, so a missing clamp shows),
tied and untied heads; a non-positive clip refused. (test_engine_architectures.py[olmo]: weight updates, batch
invariance, the engine on CUDA.)"""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers.hf_reference import max_gap_to_transformers, trace_logprobs
from helpers.tolerances import LOGPROB_TOL

from replayllm import LLM, SamplingParams

SIZES = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.5, pad_token_id=0,
             bos_token_id=1, eos_token_id=2)
ENGINE = dict(device="cpu", dtype="float32", skip_tokenizer_init=True, enable_trace_replay=True, max_model_len=128)


def _olmo(path, **extra):
    torch.manual_seed(0)
    hf = transformers.OlmoForCausalLM(transformers.OlmoConfig(**SIZES, **extra)).to(torch.float32).eval()
    hf.save_pretrained(str(path))
    return hf


def _cases():
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (3, 20, 50)]
    return prompts, [torch.randint(3, 300, (8,), generator=g).tolist() for _ in prompts]


@pytest.mark.parametrize("extra", [dict(clip_qkv=0.5), dict(clip_qkv=None, tie_word_embeddings=True)],
                         ids=["clipped-untied", "unclipped-tied"])
def test_engine_scores_what_transformers_scores(tmp_path, extra):
    hf = _olmo(tmp_path, **extra)
    prompts, traces = _cases()
    if extra["clip_qkv"] is not None:  # the bound bites: some projection of a prompt token passes it
        with torch.no_grad():
            x = hf.model.layers[0].input_layernorm(hf.model.embed_tokens(torch.tensor(prompts[1])))
            assert hf.model.layers[0].self_attn.q_proj(x).abs().max() > extra["clip_qkv"]
    got = trace_logprobs(LLM(str(tmp_path), **ENGINE), prompts, traces)
    assert max_gap_to_transformers(hf, prompts, traces, got) <= LOGPROB_TOL


def test_a_non_positive_clip_is_refused(tmp_path):
    _olmo(tmp_path, clip_qkv=0.5)
    import json

    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg, clip_qkv=-1.0)))
    with pytest.raises(ValueError, match="clip_qkv must be positive or null, got -1.0"):
        LLM(str(tmp_path), **ENGINE)


def test_enable_fp32_lm_head_works_without_a_norm_weight(tmp_path):
    """enable_fp32_lm_head (a bf16 model's final norm and head in fp32) asks the model's dtype of the embedding, not
    of the final norm, which has no weight here: it switches on for bf16 and its fp32 norm path runs."""
    _olmo(tmp_path, clip_qkv=0.5)
    llm = LLM(str(tmp_path), **dict(ENGINE, dtype="bfloat16", enable_fp32_lm_head=True))
    model = llm.llm_engine.runner.model
    assert model.model.fp32_final_norm and model.lm_head.weight.dtype == torch.float32
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4, logprobs=1), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
