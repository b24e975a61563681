"""StableLM beyond the engine-vs-transformers tests (tests/models/test_engine_architectures.py): its LayerNorm
against torch's own, the fp32 head's final norm, and the per-head q/k LayerNorms refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers

from replayllm.config import EngineConfig
from replayllm.model_runner_v2.models.layers import LayerNorm

SMALL = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _norm(dtype: torch.dtype) -> LayerNorm:
    norm = LayerNorm(48, 1e-5)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(48, generator=g) + 0.5)
        norm.bias.copy_(torch.rand(48, generator=g) - 0.5)
    return norm.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_layer_norm_is_hf_layer_norm_bit_for_bit(dtype):
    norm, ref = _norm(dtype), torch.nn.LayerNorm(48, eps=1e-5).to(dtype)
    ref.load_state_dict(norm.state_dict())
    g = torch.Generator().manual_seed(1)
    x, res = ((torch.randn(5, 48, generator=g) * 3).to(dtype) for _ in range(2))
    assert torch.equal(norm(x), ref(x))
    normed, stream = norm.add_and_norm(x, res)
    assert torch.equal(stream, res + x) and torch.equal(normed, ref(res + x))
    out, again = norm.norm_then(x, res, torch.nn.Identity())
    assert torch.equal(out, normed) and torch.equal(again, stream)
    # the fp32 head's final norm: the add, the norm and its parameters in fp32, the result left in fp32
    fp32 = norm.add_and_norm_fp32(x, res)
    assert fp32.dtype == torch.float32
    assert torch.equal(fp32, F.layer_norm(x.float() + res.float(), (48,), norm.weight.float(), norm.bias.float(),
                                          1e-5))


def test_per_head_qk_layernorms_are_refused(tmp_path):
    torch.manual_seed(0)
    transformers.StableLmForCausalLM(transformers.StableLmConfig(**SMALL, qk_layernorm=True)).save_pretrained(
        str(tmp_path / "m"))
    from replayllm import LLM

    with pytest.raises(ValueError, match="qk_layernorm"):
        LLM(str(tmp_path / "m"), device="cpu", dtype="float32", skip_tokenizer_init=True)
    assert EngineConfig(model=str(tmp_path / "m"), device="cpu").model_config.architecture == "StableLmForCausalLM"
