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


def test_the_original_files_without_the_model_prefix_load_the_same_model(tmp_path):
    """facebook/opt-125m's original files name the stack `decoder.*` (saved from OPTModel) and hold no lm_head."""
    from helpers.hf_reference import trace_logprobs
    from safetensors.torch import load_file, save_file

    cfg = transformers.OPTConfig(vocab_size=300, hidden_size=64, ffn_dim=96, num_hidden_layers=2,
                                 num_attention_heads=4, max_position_embeddings=128, word_embed_proj_dim=64,
                                 init_std=0.5)
    torch.manual_seed(0)
    transformers.OPTForCausalLM(cfg).save_pretrained(str(tmp_path / "current"))
    tensors = load_file(str(tmp_path / "current" / "model.safetensors"))
    (tmp_path / "original").mkdir()
    save_file({n.removeprefix("model."): t for n, t in tensors.items() if n != "lm_head.weight"},
              str(tmp_path / "original" / "model.safetensors"))
    for f in (tmp_path / "current").iterdir():
        if f.name != "model.safetensors":
            (tmp_path / "original" / f.name).symlink_to(f)
    engine = dict(device="cpu", dtype="float32", skip_tokenizer_init=True, enable_trace_replay=True, max_model_len=64)
    prompts, traces = [[5, 17, 99, 3, 42] * 4], [[7, 8, 9, 10]]
    runs = [trace_logprobs(LLM(str(tmp_path / d), **engine), prompts, traces) for d in ("current", "original")]
    assert runs[0] == runs[1]
