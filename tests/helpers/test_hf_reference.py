"""tests/helpers/hf_reference.py's guard on transformers' GPT-OSS: a release whose experts module is not the model's
definition at the config's values (5.17: a clamp fixed at 7.0, no `swiglu_alpha` in its config) is reported, with
the reason, instead of being the reference or crashing the test that asks."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

from helpers.hf_reference import gpt_oss_reference_problem


class _Experts517(nn.Module):
    """transformers 5.17's GptOssExperts, as its source reads: the clamp and alpha fixed, the config's ignored."""

    def __init__(self, config, limit: float = 7.0):
        super().__init__()
        e, h, i = config.num_local_experts, config.hidden_size, config.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, h, 2 * i))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i))
        self.down_proj = nn.Parameter(torch.empty(e, i, h))
        self.down_proj_bias = nn.Parameter(torch.empty(e, h))
        self.limit = limit

    def forward(self, hidden_states, router_indices=None, routing_weights=None):
        out = torch.zeros_like(hidden_states)
        for t in range(hidden_states.shape[0]):
            for j, e in enumerate(router_indices[t].tolist()):
                gate_up = hidden_states[t] @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]
                gate, up = gate_up[0::2].clamp(max=self.limit), gate_up[1::2].clamp(-self.limit, self.limit)
                y = ((up + 1) * gate * torch.sigmoid(gate * 1.702)) @ self.down_proj[e] + self.down_proj_bias[e]
                out[t] += y * routing_weights[t, j]
        return out


class _Config517(transformers.GptOssConfig):
    """5.17's config: no swiglu_alpha attribute."""

    def __getattribute__(self, name):
        if name == "swiglu_alpha":
            raise AttributeError(name)
        return super().__getattribute__(name)


@pytest.fixture
def release_517(monkeypatch):
    monkeypatch.setattr(transformers, "GptOssConfig", _Config517)
    monkeypatch.setattr(transformers.models.gpt_oss.modeling_gpt_oss, "GptOssExperts", _Experts517)


def test_a_clamp_fixed_at_7_is_reported_not_raised(release_517):
    problem = gpt_oss_reference_problem()
    assert problem is not None and "GptOssExperts disagrees" in problem and "7.0" in problem


def test_a_module_that_honours_the_config_is_the_reference(release_517, monkeypatch):
    # the same module clamping at the config's limit (the helper's 2.5): no problem, alpha defaulting to 1.702
    monkeypatch.setattr(transformers.models.gpt_oss.modeling_gpt_oss, "GptOssExperts",
                        lambda config: _Experts517(config, limit=config.swiglu_limit))
    assert gpt_oss_reference_problem() is None
