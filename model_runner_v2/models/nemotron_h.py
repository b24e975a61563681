"""NemotronH (`NemotronHForCausalLM`: Nemotron-H 4B / 8B / 47B / 56B, NVIDIA-Nemotron-Nano-9B / 12B-v2): every layer
one mixer after one RMSNorm (the weight times the fp32 row, then cast: OLMo 2's order) and a residual add, the mixer
by the layer's kind: Mamba-2 ("M", mamba2.py: a recurrent state per request, docs/hybrid_models.md), attention without
a rotary ("*", NoPE, head_dim^-0.5), an ungated ReLU² MLP ("-"), or a mixture of experts ("E": Nemotron 3 Nano,
NemotronHMoeBlock). The kinds come from `layers_block_type` (transformers >= 5.25) or the checkpoints'
`hybrid_override_pattern`.

The MoE layer, as transformers' NemotronHMoE: GLM-4-MoE's router (glm4_moe.py: fp32 sigmoid scores, the choice on
scores + `e_score_correction_bias` within the `topk_group` best of `n_group` groups, the unbiased scores
renormalised and times `routed_scaling_factor`); `n_routed_experts` ungated ReLU² experts of `moe_intermediate_size`
(moe.StackedExperts relu2: up_proj, relu², down_proj, no bias), run in `moe_latent_size` dims between
`fc1_latent_proj` and `fc2_latent_proj` where the config sets one (applied once to the weighted sum); plus one
ungated ReLU² shared expert of `moe_shared_expert_intermediate_size` on the layer's normed input, unscaled.

Checkpoints name the model `backbone` (`backbone.embeddings`, `backbone.layers.N.norm`, `backbone.layers.N.mixer.*`,
`backbone.norm_f`); transformers' module names it `model`: both are read as the decoder's names (a layer's
`mixer` as its `self_attn`, `mamba` or `mlp` by kind; the multi-token-prediction layers `mtp.*` skipped). Experts
load one per expert (`mixer.experts.E.up_proj.weight`, the hub's) or stacked (`mixer.experts.up_proj` [E, I, L],
transformers' module); the router's weight and bias are read in fp32 (transformers keeps them so)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from ...config import moe_facts
from ...hybrid_facts import ATTENTION_KINDS, layer_types
from .decoder import DecoderAttention, DecoderLM, DecoderSpec
from .glm4_moe import GroupedSigmoidRouter, check_groups, route_grouped_sigmoid
from .layers import Linear, RMSNorm, RotaryEmbedding
from .mamba2 import Mamba2Mixer
from .moe import SparseMoeBlock, StackedExperts
from .parallel import get_tp_state
from .plain_mlp import PlainMLP
from .smollm3 import without_rotary

_KINDS = (*ATTENTION_KINDS, "mlp", "moe")
_MIXER_NAME = {"full_attention": "self_attn", "linear_attention": "mamba", "mlp": "mlp", "moe": "mlp"}


class NemotronHMoeBlock(SparseMoeBlock):
    """The "E" layer's mixer: x [T, H] (normed) -> fc2(experts(fc1(x))) + shared_experts(x) [T, H]."""

    fp32_weights = True  # transformers' router hands fp32 weights to its experts

    def __init__(self, hf_config, layer_idx: int, facts: dict):
        nn.Module.__init__(self)
        act = getattr(hf_config, "mlp_hidden_act", None) or "relu2"
        if act != "relu2":
            raise ValueError(f"NemotronH's experts with mlp_hidden_act {act!r} are not supported (relu2)")
        self.layer_idx, self.top_k = layer_idx, facts["num_experts_per_tok"]
        self.norm_topk_prob = facts["norm_topk_prob"]
        num_experts, hidden = facts["num_experts"], hf_config.hidden_size
        self.scale = float(getattr(hf_config, "routed_scaling_factor", 1.0) or 1.0)
        self.n_group = int(getattr(hf_config, "n_group", 1) or 1)
        self.topk_group = int(getattr(hf_config, "topk_group", 1) or 1)
        check_groups(num_experts, self.n_group, self.topk_group)
        self.gate = GroupedSigmoidRouter(num_experts, hidden)
        latent, bias = getattr(hf_config, "moe_latent_size", None), bool(getattr(hf_config, "mlp_bias", False))
        width = int(latent) if latent else hidden
        # replicated under tensor parallelism (the experts' partial sums are reduced before fc2)
        self.fc1_latent_proj = Linear(hidden, width, bias=bias) if latent else None
        self.fc2_latent_proj = Linear(width, hidden, bias=bias) if latent else None
        self.experts = StackedExperts(num_experts, width, facts["moe_intermediate_size"], relu2=True,
                                      fp32_weights=self.fp32_weights)
        self.shared_experts = PlainMLP(hf_config, ("up_proj", "down_proj"), "NemotronH", ("relu2",), "relu2",
                                       bias=bias, act_key="mlp_hidden_act",
                                       intermediate_size=int(hf_config.moe_shared_expert_intermediate_size))
        self.tp_size = get_tp_state().size

    def route_tokens(self, x: torch.Tensor, forced: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return route_grouped_sigmoid(self.gate(x), self.gate.e_score_correction_bias, self.top_k, self.n_group,
                                     self.topk_group, self.norm_topk_prob, self.scale, forced,
                                     self.gate.batch_invariant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        weights, ids = self.record_routes(x)  # on the normed input, before the latent projection
        h = x if self.fc1_latent_proj is None else self.fc1_latent_proj(x)
        routed = self.reduce(self.experts(h, ids, weights))
        if self.fc2_latent_proj is not None:
            routed = self.fc2_latent_proj(routed)
        return routed + self.shared_experts(x)


class NemotronHLayer(nn.Module):
    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary: RotaryEmbedding, mlp: nn.Module | None):
        super().__init__()
        kinds = layer_types(hf_config, _KINDS)
        self.kind = kinds[layer_idx]
        self.input_layernorm = self.make_norm(hf_config)
        if self.kind == "full_attention":  # its KV cache: the attention layers' count before it
            self.self_attn = DecoderAttention(hf_config, spec, kinds[:layer_idx].count("full_attention"), rotary)
        elif self.kind == "linear_attention":
            self.mamba = Mamba2Mixer(hf_config)
        else:
            self.mlp = mlp

    @classmethod
    def make_norm(cls, hf_config) -> nn.Module:
        return RMSNorm(hf_config.hidden_size, float(hf_config.layer_norm_epsilon), weight_in_fp32=True)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kind == "full_attention":
            return self.self_attn(positions, x, residual, self.input_layernorm)
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add_and_norm(x, residual)
        return (self.mamba(h) if self.kind == "linear_attention" else self.mlp(h)), residual


class NemotronHForCausalLM(DecoderLM):
    layer_class = NemotronHLayer
    checkpoint_fp32_suffixes = (".mixer.gate.weight", ".mixer.gate.e_score_correction_bias")

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        return DecoderSpec.with_attention_bias(hf_config)

    def __init__(self, hf_config):
        self.kinds = layer_types(hf_config, _KINDS)
        if getattr(hf_config, "sliding_window", None):
            raise ValueError("NemotronH with a sliding_window is not supported")
        super().__init__(hf_config)
        without_rotary(layer for layer in self.model.layers if layer.kind == "full_attention")

    def build_mlp(self, layer_idx: int) -> nn.Module | None:
        if self.kinds[layer_idx] == "moe":
            return NemotronHMoeBlock(self.config, layer_idx, moe_facts(type(self).__name__, self.config))
        if self.kinds[layer_idx] != "mlp":
            return None
        return PlainMLP(self.config, ("up_proj", "down_proj"), "NemotronH", ("relu2",), "relu2",
                        bias=bool(getattr(self.config, "mlp_bias", False)), act_key="mlp_hidden_act")

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        if name.startswith("mtp."):
            return  # the multi-token-prediction layers: not served
        if name.startswith("backbone."):
            name = "model." + name[len("backbone."):]
        name = {"model.embeddings.weight": "model.embed_tokens.weight",
                "model.norm_f.weight": "model.norm.weight"}.get(name, name)
        parts = name.split(".")
        if len(parts) > 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
            kind = self.kinds[int(parts[2])] if int(parts[2]) < len(self.kinds) else None
            if parts[3] == "norm":
                parts[3] = "input_layernorm"
            elif parts[3] == "mixer" and kind in _MIXER_NAME:
                parts[3] = _MIXER_NAME[kind]
            name = ".".join(parts)
        yield name, tensor

    def weight_target(self, name: str, params: dict[str, nn.Parameter],
                      shards: dict[str, tuple[str, int, int]]) -> tuple[str, int, int] | None:
        # model.layers.N.mlp.experts.E.{up,down}_proj.weight -> expert E's rows of ...mlp.experts.{up,down}_proj
        parts = name.split(".")
        if (len(parts) == 8 and parts[3:5] == ["mlp", "experts"] and parts[5].isdigit()
                and parts[6] in ("up_proj", "down_proj") and parts[7] == "weight"):
            block = getattr(self.model.layers[int(parts[2])], "mlp", None)
            if not isinstance(block, NemotronHMoeBlock):
                raise ValueError(f"tensor {name!r}: layer {parts[2]} is not a MoE layer")
            experts, e = block.experts, int(parts[5])
            if e >= experts.num_experts:
                raise ValueError(f"tensor {name!r}: expert {e} >= n_routed_experts={experts.num_experts}")
            rows = experts.intermediate_size if parts[6] == "up_proj" else experts.hidden_size
            return f"{'.'.join(parts[:5])}.{parts[6]}", e * rows, rows
        return super().weight_target(name, params, shards)

    def weight_pieces(self, params: dict[str, nn.Parameter],
                      shards: dict[str, tuple[str, int, int]]) -> dict[str, set[int]]:
        pieces = super().weight_pieces(params, shards)
        for i, layer in enumerate(self.model.layers):
            if isinstance(getattr(layer, "mlp", None), NemotronHMoeBlock):
                ex, prefix = layer.mlp.experts, f"model.layers.{i}.mlp.experts"
                pieces[f"{prefix}.up_proj"] = set(range(0, ex.num_experts * ex.intermediate_size, ex.intermediate_size))
                pieces[f"{prefix}.down_proj"] = set(range(0, ex.num_experts * ex.hidden_size, ex.hidden_size))
        return pieces
