"""Each architecture's norms as its transformers module computes them, in bf16, bit for bit: the engine model's own
norm modules (built from the architecture's class) against transformers' norm class on the same weights. The fp32
engine tests against transformers (test_engine_architectures.py) cannot tell the orders apart: in fp32 they agree."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.helium import modeling_helium
from transformers.models.nemotron import modeling_nemotron
from transformers.models.olmo2 import modeling_olmo2

from replayllm.model_runner_v2.models.registry import get_model_class

SIZES = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16)
PRE_NORMS = ("input_layernorm", "post_attention_layernorm")
CASES = {  # arch -> (config, transformers' norm for it, the layer's norms)
    # Helium: the weight times the fp32 normed row, one cast (not Llama's cast, then the weight)
    "HeliumForCausalLM": (transformers.HeliumConfig(**SIZES), lambda c: modeling_helium.HeliumRMSNorm(
        c.hidden_size, eps=c.rms_norm_eps), PRE_NORMS),
    # Nemotron: LayerNorm1P, the scale (weight + 1) rounded to bf16 first
    "NemotronForCausalLM": (transformers.NemotronConfig(**SIZES), lambda c: modeling_nemotron.NemotronLayerNorm1P(
        c.hidden_size, eps=c.norm_eps), PRE_NORMS),
    # OLMo 2: Helium's order, in norms after the sub-blocks (and the final one)
    "Olmo2ForCausalLM": (transformers.Olmo2Config(**{k: v for k, v in SIZES.items() if k != "head_dim"}),
                         lambda c: modeling_olmo2.Olmo2RMSNorm(c.hidden_size, eps=c.rms_norm_eps),
                         ("post_attention_layernorm", "post_feedforward_layernorm")),
}


@pytest.mark.parametrize("arch", list(CASES))
def test_the_engines_norms_are_transformers_in_bf16(arch):
    config, hf_norm, names = CASES[arch]
    model = get_model_class([arch])(config)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(7, config.hidden_size, generator=g) * 3).to(torch.bfloat16)
    for norm in (*(getattr(model.model.layers[0], name) for name in names), model.model.norm):
        ref = hf_norm(config).to(torch.bfloat16)
        with torch.no_grad():
            for name, param in ref.named_parameters():  # weights off 1 (and 0): the orders then round differently
                param.copy_(torch.rand(param.shape, generator=g) * 2 - 0.5)
                getattr(norm, name).data = param.detach().clone()
            assert torch.equal(norm(x), ref(x)), f"{arch}: {type(norm).__name__}"
