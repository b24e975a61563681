"""Gemma's pieces against transformers' own, bit for bit (the engine-vs-transformers logprobs, weight updates,
batch invariance and tensor parallelism: tests/models/test_engine_architectures.py): the (1 + weight) RMSNorm, the
GeGLU, and the embedding scale rounded to the model dtype; the batch-invariant GeGLU's rows."""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers.tolerances import rounding_tol
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

from replayllm.kernels.activation import gelu_tanh_and_mul_invariant_torch, gelu_tanh_and_mul_torch
from replayllm.model_runner_v2.models.gemma import GemmaForCausalLM
from replayllm.model_runner_v2.models.layers import RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_unit_offset_rms_norm_is_gemmas(dtype):
    g = torch.Generator().manual_seed(0)
    ours, ref = RMSNorm(48, 1e-6, unit_offset=True).to(dtype), GemmaRMSNorm(48, eps=1e-6).to(dtype)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(48, generator=g) * 0.5)
        ref.weight.copy_(ours.weight)
    x, res = ((torch.randn(5, 48, generator=g) * 3).to(dtype) for _ in range(2))
    assert torch.equal(ours(x), ref(x))
    normed, stream = ours.add_and_norm(x, res)
    assert torch.equal(normed, ref(res + x)) and torch.equal(stream, res + x)
    plain = RMSNorm(48, 1e-6, weight_in_fp32=True).to(dtype)
    plain.load_state_dict(ours.state_dict())
    assert not torch.equal(plain(x), ours(x))  # the offset matters


def test_geglu_is_gemmas_and_its_invariant_form_is_row_independent():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(37, 2 * 24, generator=g) * 3
    gate, up = x.chunk(2, dim=-1)
    act = transformers.activations.ACT2FN["gelu_pytorch_tanh"]
    assert torch.equal(gelu_tanh_and_mul_torch(x), act(gate) * up)
    inv = gelu_tanh_and_mul_invariant_torch(x)
    torch.testing.assert_close(inv, act(gate) * up, rtol=rounding_tol(1, steps=8), atol=rounding_tol(x.abs().max(),
                                                                                                    steps=8))
    for rows in (1, 3, 16, 37):  # each row's bits whatever the batch it is computed in
        assert torch.equal(gelu_tanh_and_mul_invariant_torch(x[:rows]), inv[:rows])


def test_the_embedding_scale_is_rounded_to_the_model_dtype():
    config = transformers.GemmaConfig(vocab_size=32, hidden_size=48, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=24)
    default = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.bfloat16)
        with torch.device("meta"):
            model = GemmaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    assert model.model.embed_scale == 6.9375 != 48**0.5  # sqrt(48) = 6.928... in bf16, as HF's normalizer
