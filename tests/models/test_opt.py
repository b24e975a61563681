"""OPT (models/opt.py) beyond test_engine_architectures.py[opt]: opt-350m's form (post-norm layers, projected
embeddings) is refused with a clear error, never run as the pre-norm model."""

from __future__ import annotations

import pytest
import torch
import transformers

from replayllm import LLM


@pytest.mark.parametrize("extra, reason", [
    (dict(do_layer_norm_before=False), "its layers norm after the residual add"),
    (dict(word_embed_proj_dim=32), "its embeddings are projected"),
], ids=["post-norm", "projected-embeddings"])
def test_opt_350ms_form_is_refused(tmp_path, extra, reason):
    cfg = transformers.OPTConfig(vocab_size=300, hidden_size=64, ffn_dim=96, num_hidden_layers=2,
                                 num_attention_heads=4, max_position_embeddings=128,
                                 **{"word_embed_proj_dim": 64, **extra})
    torch.manual_seed(0)
    transformers.OPTForCausalLM(cfg).save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match=f"opt-350m's form\\) is not supported: {reason}"):
        LLM(str(tmp_path), device="cpu", dtype="float32", skip_tokenizer_init=True, max_model_len=64)
