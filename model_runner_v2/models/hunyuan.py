"""HunYuan (Tencent's `HunYuanDenseV1ForCausalLM`: Hunyuan-0.5B / 1.8B / 4B / 7B; `HunYuanMoEV1ForCausalLM`:
Hunyuan-A13B), as transformers' HunYuanDenseV1 / HunYuanMoEV1 compute them:

- Llama's pre-norm layers whose attention rotates q and k first and then RMS-norms each head (`query_layernorm`,
  `key_layernorm`: Llama's RMSNorm over head_dim) — the opposite order of Qwen3's (rope_then_norm.RopeThenNorm);
- the checkpoints' "dynamic" rope with a fixed `alpha`: static frequencies over the base theta * alpha ** (d / (d - 2))
  (RopeSettings' "ntk_alpha");
- the MoE model: every layer sparse, its router (`mlp.gate.wg`) in fp32 over the fp32 token, a softmax over all
  experts, the top `moe_topk` renormalised; `num_experts` SwiGLU experts of `intermediate_size` plus a shared one
  of the same width every token runs, ungated (`mlp.shared_mlp`).

Refused: cross-layer attention (`use_cla`: transformers has none), per-layer expert counts or top-k that differ,
more than one shared MLP (`num_shared_expert`)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ...moe_facts import uniform
from .decoder import DecoderMLP, DecoderSpec
from .glm4_moe import Fp32Router
from .llama import LlamaForCausalLM
from .moe import SparseMoeBlock
from .qwen2_moe import Qwen2MoeForCausalLM
from .rope_then_norm import RopeThenNorm
from .smollm3 import identity_rotary

_NORMS = {".self_attn.query_layernorm.": ".self_attn.q_norm.", ".self_attn.key_layernorm.": ".self_attn.k_norm."}


def _refuse_cla(hf_config) -> None:
    if getattr(hf_config, "use_cla", False):
        raise ValueError("HunYuan with cross-layer attention (use_cla) is not supported")


def _rope_then_norm(layers: nn.ModuleList) -> None:
    """Every layer's attention rotates, then norms its heads (one identity rotary shared by all)."""
    rope = layers[0].self_attn.rotary
    identity = identity_rotary(rope)
    for layer in layers:
        layer.self_attn.rotary = RopeThenNorm(rope, identity)


def _hunyuan_spec(hf_config) -> DecoderSpec:
    return DecoderSpec.with_attention_bias(hf_config, qk_norm=True)


def _renamed(name: str) -> str:
    for theirs, ours in _NORMS.items():
        name = name.replace(theirs, ours)
    return name


class HunYuanDenseV1ForCausalLM(LlamaForCausalLM):
    def __init__(self, hf_config):
        _refuse_cla(hf_config)
        super().__init__(hf_config)
        _rope_then_norm(self.model.layers)

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        return _hunyuan_spec(hf_config)

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        return ((_renamed(name), tensor),)


class HunYuanMoeBlock(SparseMoeBlock):
    """The fp32 router's softmax top-k (renormalised) over the experts, plus the ungated shared MLP."""

    fp32_weights = True  # transformers' router (its `wg` built fp32) hands fp32 weights to its experts

    def __init__(self, hf_config, layer_idx: int, facts: dict, spec: DecoderSpec):
        super().__init__(hf_config, layer_idx, facts)
        self.gate = Fp32Router(facts["num_experts"], hf_config.hidden_size)
        self.shared_expert = DecoderMLP(hf_config, spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        return super().forward(x) + self.shared_expert.down(self.shared_expert.gate_up_proj(x))


class HunYuanMoEV1ForCausalLM(Qwen2MoeForCausalLM):  # Qwen2-MoE's loading of a shared expert's gate and up parts
    # the router's weight stays fp32 (transformers builds `wg` in fp32 whatever the model dtype)
    checkpoint_fp32_suffixes = (".mlp.gate.wg.weight", ".mlp.gate.weight")

    def __init__(self, hf_config):
        _refuse_cla(hf_config)
        shared = uniform(getattr(hf_config, "num_shared_expert", 1), "num_shared_expert")
        if shared != 1:
            raise ValueError(f"config.json: num_shared_expert={shared} is not supported (only 1, as transformers)")
        super().__init__(hf_config)
        _rope_then_norm(self.model.layers)

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        return _hunyuan_spec(hf_config)

    def sparse_block(self, layer_idx: int, facts: dict) -> nn.Module:
        return HunYuanMoeBlock(self.config, layer_idx, facts, self.spec(self.config))

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        name = _renamed(name).replace(".mlp.gate.wg.", ".mlp.gate.").replace(".mlp.shared_mlp.",
                                                                             ".mlp.shared_expert.")
        return ((name, tensor),)
