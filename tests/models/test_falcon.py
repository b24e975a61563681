"""Falcon (models/falcon.py) against transformers, in every layer form and fused q|k|v layout: Falcon-7B's
(multi-query, one norm for the parallel sub-blocks), Falcon-40B's (the new architecture: grouped K/V heads, ln_attn
and ln_mlp), Falcon2-11B's (the new architecture with one norm), one K/V head per query head with biases, and the
sequential layer; ALiBi refused. (test_engine_architectures.py[falcon]: weight updates, batch invariance.)"""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers.hf_reference import max_gap_to_transformers, trace_logprobs
from helpers.tolerances import LOGPROB_TOL

from replayllm import LLM

SIZES = dict(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_hidden_size=96,
             max_position_embeddings=128, initializer_range=0.5, bos_token_id=1, eos_token_id=2)
ENGINE = dict(device="cpu", dtype="float32", skip_tokenizer_init=True, enable_trace_replay=True, max_model_len=128)
FORMS = {
    "7b": dict(multi_query=True, parallel_attn=True),
    "40b": dict(new_decoder_architecture=True, num_kv_heads=2),
    "11b": dict(new_decoder_architecture=True, num_kv_heads=2, num_ln_in_parallel_attn=1),
    "mha-bias": dict(multi_query=False, parallel_attn=True, bias=True),
    "sequential": dict(multi_query=False, parallel_attn=False, bias=True),
}


def _falcon(path, **extra):
    torch.manual_seed(0)
    hf = transformers.FalconForCausalLM(transformers.FalconConfig(**SIZES, **extra)).to(torch.float32).eval()
    with torch.no_grad():  # norms away from weight 1, bias 0
        for name, param in hf.named_parameters():
            if "ln" in name.rsplit(".", 2)[-2] or "layernorm" in name:
                param.uniform_(0.5, 1.5) if name.endswith("weight") else param.uniform_(-0.3, 0.3)
    hf.save_pretrained(str(path))
    return hf


@pytest.mark.parametrize("form", list(FORMS))
def test_every_layer_form_scores_what_transformers_scores(tmp_path, form):
    hf = _falcon(tmp_path, **FORMS[form])
    llm = LLM(str(tmp_path), **ENGINE)
    kv = {"7b": 1, "40b": 2, "11b": 2}.get(form, 4)
    assert llm.llm_engine.model_config.num_kv_heads == kv
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (3, 20, 50)]
    traces = [torch.randint(3, 300, (8,), generator=g).tolist() for _ in prompts]
    assert max_gap_to_transformers(hf, prompts, traces, trace_logprobs(llm, prompts, traces)) <= LOGPROB_TOL


def test_alibi_is_refused(tmp_path):
    _falcon(tmp_path, alibi=True, multi_query=False, parallel_attn=False, bias=True)
    with pytest.raises(ValueError, match="alibi=true .* is not supported"):
        LLM(str(tmp_path), **ENGINE)
