"""LongCat-Flash (`LongcatFlashForCausalLM`: Meituan's LongCat-Flash-Chat / -Thinking), as transformers'
LongcatFlash computes it. `num_layers` blocks, each two attention + MLP sub-layers and one MoE whose output joins at
the block's end (the "shortcut" MoE, run on the first sub-layer's normed input):

    h = x + attn_0(input_layernorm_0(x));  n = post_attention_layernorm_0(h);  s = moe(n);  h = h + mlps_0(n)
    h = h + attn_1(input_layernorm_1(h));  out = (h + mlps_1(post_attention_layernorm_1(h))) + s

Attention is DeepSeek-V3's MLA (models/mla.py; always a q LoRA, the interleaved rotary) with LoRA scales: q times
sqrt(hidden / q_lora_rank), the normed latent times sqrt(hidden / kv_lora_rank) before kv_b_proj (each a model-dtype
product, as transformers). Sub-layer j of block b caches at KV layer 2b + j (`num_hidden_layers` is 2 x num_layers).

The MoE's router (`router.classifier`, fp32, its bias never applied) softmaxes over n_routed_experts +
`zero_expert_num` experts, chooses the top k of the probabilities plus `e_score_correction_bias`, and weighs them by
their probabilities times `routed_scaling_factor` (no renormalisation). A zero expert (id >= n_routed_experts) is the
identity: its weight times the token itself, added after the real experts' sum (whose routes it takes with weight 0,
as transformers does). Routes are recorded at the block's first KV layer (2b)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ...model_config import position_limit
from ...moe_facts import moe_facts
from ...rope_settings import RopeSettings
from .decoder import DecoderMLP, DecoderSpec
from .deepseek import DeepseekV3ForCausalLM
from .glm4_moe import Fp32Router
from .layers import RMSNorm, RotaryEmbedding
from .mla import LATENT_NORM_EPS, MlaAttention, mla_dims, rope_first
from .moe import SparseMoeBlock, StackedExperts
from .parallel import attach_lm_head, embedding, get_tp_state


class ScaledRMSNorm(RMSNorm):
    """The latent's norm, its output times a constant (a model-dtype product after the norm's rounding)."""

    def __init__(self, dim: int, eps: float, scale: float):
        super().__init__(dim, eps)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale


class LongcatFlashMla(MlaAttention):
    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__(hf_config, spec, layer_idx, rotary)
        hidden = hf_config.hidden_size
        self.q_scale = (hidden / int(hf_config.q_lora_rank)) ** 0.5
        self.kv_a_layernorm = ScaledRMSNorm(self.kv_lora_rank, LATENT_NORM_EPS, (hidden / self.kv_lora_rank) ** 0.5)

    def query(self, x: torch.Tensor) -> torch.Tensor:
        return super().query(x) * self.q_scale


class LongcatFlashRouter(nn.Module):
    def __init__(self, num_experts: int, hidden: int):
        super().__init__()
        self.classifier = Fp32Router(num_experts, hidden)
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts, dtype=torch.float32), requires_grad=False)


class LongcatFlashMoe(SparseMoeBlock):
    fp32_weights = True  # transformers' router hands fp32 weights to its experts

    def __init__(self, hf_config, layer_idx: int, facts: dict):
        nn.Module.__init__(self)
        self.layer_idx, self.top_k, self.norm_topk_prob = layer_idx, facts["num_experts_per_tok"], False
        self.real, hidden = int(hf_config.n_routed_experts), hf_config.hidden_size
        self.zero = int(getattr(hf_config, "zero_expert_num", 0) or 0)
        self.router = LongcatFlashRouter(self.real + self.zero, hidden)
        self.experts = StackedExperts(self.real, hidden, facts["moe_intermediate_size"],
                                      fp32_weights=self.fp32_weights)
        self.scale = float(getattr(hf_config, "routed_scaling_factor", 1.0) or 1.0)
        self.tp_size = get_tp_state().size

    def route_tokens(self, x: torch.Tensor, forced: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        probs = self.router.classifier(x).softmax(dim=-1)  # [T, E + Z] fp32
        ids = torch.topk(probs + self.router.e_score_correction_bias, self.top_k, dim=-1, sorted=False)[1]
        if forced is not None:  # routing replay: the rows' own ids, weighted alike
            ids = torch.where(forced[:, :1] >= 0, forced.long(), ids)
        return probs.gather(1, ids) * self.scale, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        weights, ids = self.record_routes(x)
        if not self.zero:
            return self.reduce(self.experts(x, ids, weights))
        identity = ids >= self.real
        identity_out = x * weights.masked_fill(~identity, 0.0).sum(dim=-1, keepdim=True)  # fp32
        dummy = (ids - self.real) * self.real // self.zero  # a real expert, weight 0 (transformers' spread)
        out = self.reduce(self.experts(x, torch.where(identity, dummy, ids), weights.masked_fill(identity, 0.0)))
        return out + identity_out.to(out.dtype)


class LongcatFlashBlock(nn.Module):
    def __init__(self, hf_config, spec: DecoderSpec, block: int, rotary: RotaryEmbedding, facts: dict):
        super().__init__()
        hidden, eps = hf_config.hidden_size, float(hf_config.rms_norm_eps)
        self.self_attn = nn.ModuleList(LongcatFlashMla(hf_config, spec, 2 * block + j, rotary) for j in (0, 1))
        self.mlps = nn.ModuleList(DecoderMLP(hf_config, spec) for _ in (0, 1))
        self.input_layernorm = nn.ModuleList(RMSNorm(hidden, eps) for _ in (0, 1))
        self.post_attention_layernorm = nn.ModuleList(RMSNorm(hidden, eps) for _ in (0, 1))
        self.mlp = LongcatFlashMoe(hf_config, 2 * block, facts)

    @staticmethod
    def _dense(mlp: DecoderMLP, x: torch.Tensor) -> torch.Tensor:
        return mlp.down(mlp.gate_up_proj(x))

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = x + self.self_attn[0](positions, x, None, self.input_layernorm[0])[0]
        n = self.post_attention_layernorm[0](h)
        shortcut = self.mlp(n)
        h = h + self._dense(self.mlps[0], n)
        h = h + self.self_attn[1](positions, h, None, self.input_layernorm[1])[0]
        return h + self._dense(self.mlps[1], self.post_attention_layernorm[1](h)) + shortcut


class LongcatFlashModel(nn.Module):
    def __init__(self, hf_config, spec: DecoderSpec, facts: dict):
        super().__init__()
        self.embed_tokens = embedding(hf_config.vocab_size, hf_config.hidden_size)
        rope = RopeSettings.from_hf_config(hf_config)
        rotary = RotaryEmbedding(spec.head_dim, rope.max_positions(position_limit(hf_config)), rope,
                                 interleaved=True, rotary_dim=spec.rotary_dim)
        blocks = int(hf_config.num_hidden_layers) // 2
        self.layers = nn.ModuleList(LongcatFlashBlock(hf_config, spec, b, rotary, facts) for b in range(blocks))
        self.norm = RMSNorm(hf_config.hidden_size, float(hf_config.rms_norm_eps))
        self.fp32_final_norm = False  # DecoderLM.enable_fp32_lm_head: the output is then fp32

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for block in self.layers:
            x = block(positions, x)
        if self.fp32_final_norm:
            return self.norm.add_and_norm_fp32(x, torch.zeros_like(x))  # [T, H] fp32
        return self.norm(x)


class LongcatFlashForCausalLM(DeepseekV3ForCausalLM):
    checkpoint_fp32_suffixes = (".mlp.router.classifier.weight", ".mlp.router.e_score_correction_bias")

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        nope, rope, _ = mla_dims(hf_config)
        return DecoderSpec(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False, rope_interleaved=True,
                           head_dim=nope + rope, rotary_dim=rope)

    def __init__(self, hf_config):
        nn.Module.__init__(self)
        self.config = hf_config
        self.model = LongcatFlashModel(hf_config, self.spec(hf_config), moe_facts(type(self).__name__, hf_config))
        attach_lm_head(self, hf_config)

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        if name.startswith("model.mtp.") or name.endswith(".mlp.router.classifier.bias"):
            return ()  # the MTP layers; the router's bias, which transformers never applies
        parts = name.split(".")
        if len(parts) > 5 and parts[3:5] == ["mlp", "experts"] and parts[5].isdigit() and int(
                parts[5]) >= self.config.n_routed_experts:
            return ()  # a zero expert's unused weights (transformers 5.17 builds them; 5.25 does not)
        if parts[3:5] == ["mlp", "experts"] and parts[-1] in ("gate_up_proj", "down_proj"):
            tensor = tensor[: self.config.n_routed_experts]  # stacked: 5.17's module holds the zero experts' rows too
        if len(parts) == 7 and parts[3] == "self_attn" and parts[5] == "q_b_proj":  # layers.b.self_attn.j.q_b_proj
            nope, rope, _ = mla_dims(self.config)
            tensor = rope_first(tensor, self.config.num_attention_heads, nope, rope)  # (DeepSeek's names: V2's)
        return super().checkpoint_parts(name, tensor)

    def _fused_shards(self) -> dict[str, tuple[str, int, int]]:
        inter = self.model.layers[0].mlps[0].intermediate_size  # the dense sub-layers' gate | up rows
        return dict(gate_proj=("gate_up_proj", 0, inter), up_proj=("gate_up_proj", inter, inter))
