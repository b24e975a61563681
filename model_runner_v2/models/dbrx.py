"""DBRX (`DbrxForCausalLM`: Databricks' DBRX Base / Instruct), as transformers computes it: Mixtral's model (Llama's
attention, a sparse block in every layer) with

- LayerNorms without a bias at eps 1e-5 (transformers' nn.LayerNorm default, whatever the config);
- one `Wqkv` projection (q | k | v rows, GQA: `attn_config.kv_n_heads`), q, k and v clamped to
  +-`attn_config.clip_qkv` before the rope;
- the router (`ffn.router.layer`) softmaxed in the model dtype over `ffn_config.moe_num_experts`, the top
  `moe_top_k` divided by their p-norm (p = `moe_normalize_expert_weights`; null: left as they are), in the model dtype;
  SwiGLU experts stored flat: `ffn.experts.mlp.w1` / `v1` [E x I, H] (gate / up) and `w2` [E x I, H] (down,
  transposed).
Checkpoint names (`transformer.wte`, `transformer.blocks.N.norm_attn_norm.{norm_1, attn, norm_2}`, `ffn`,
`transformer.norm_f`) renamed to the decoder's at load. The rope theta: hf_config_json reads the hub's
`attn_config.rope_theta` where config.json names no top-level rope (transformers 5 ignores that key)."""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
from torch import nn

from .decoder import DecoderLayer, DecoderSpec, rename_first
from .layers import LayerNorm
from .moe import SparseMoeBlock
from .mpt import nested_attn_config
from .qwen3_moe import Qwen3MoeForCausalLM

_RENAMES = ((re.compile(r"^transformer\.wte\."), "model.embed_tokens."),
            (re.compile(r"^transformer\.norm_f\."), "model.norm."),
            (re.compile(r"^transformer\.blocks\.(\d+)\.norm_attn_norm\.norm_1\."), r"model.layers.\1.input_layernorm."),
            (re.compile(r"^transformer\.blocks\.(\d+)\.norm_attn_norm\.norm_2\."),
             r"model.layers.\1.post_attention_layernorm."),
            (re.compile(r"^transformer\.blocks\.(\d+)\.norm_attn_norm\.attn\.out_proj\."),
             r"model.layers.\1.self_attn.o_proj."),
            (re.compile(r"^transformer\.blocks\.(\d+)\.ffn\.router\.layer\."), r"model.layers.\1.mlp.gate."))
_EXPERTS = re.compile(r"^transformer\.blocks\.(\d+)\.ffn\.experts\.mlp\.(w1|v1|w2)$")
_WQKV = re.compile(r"^transformer\.blocks\.(\d+)\.norm_attn_norm\.attn\.Wqkv\.weight$")
_EXPERT_PROJ = {"w1": "gate_proj", "v1": "up_proj", "w2": "down_proj"}


def ffn_config(hf_config, key: str, default=None):
    """A key of DBRX's nested `ffn_config` (a config object under transformers, a dict in raw JSON)."""
    ffn = getattr(hf_config, "ffn_config", None)
    value = ffn.get(key, default) if isinstance(ffn, dict) else getattr(ffn, key, default)
    return default if value is None else value


class DbrxLayer(DecoderLayer):
    @classmethod
    def make_norm(cls, hf_config) -> nn.Module:
        return LayerNorm(hf_config.hidden_size, 1e-5, bias=False)


class DbrxMoeBlock(SparseMoeBlock):
    def __init__(self, hf_config, layer_idx: int, facts: dict):
        super().__init__(hf_config, layer_idx, facts)
        # moe_facts' norm_topk_prob: a p-norm named (absent: transformers' 1.0; null: none)
        self.norm_p = float(ffn_config(hf_config, "moe_normalize_expert_weights", 1.0)) if self.norm_topk_prob else None

    def route_tokens(self, x: torch.Tensor, forced: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(self.gate(x), dim=-1)  # [T, E], in the model dtype as transformers
        weights, ids = probs.topk(self.top_k, dim=-1)
        if forced is not None:  # routing replay: rows with ids >= 0 take them, weighted by their probabilities alike
            ids = torch.where(forced[:, :1] >= 0, forced.long(), ids)
            weights = probs.gather(-1, ids)
        if self.norm_p is not None:
            weights = weights / torch.norm(weights, p=self.norm_p, dim=-1, keepdim=True)
        return weights.float(), ids


class DbrxForCausalLM(Qwen3MoeForCausalLM):
    layer_class = DbrxLayer

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        act = (ffn_config(hf_config, "ffn_act_fn", {}) or {}).get("name", "silu")
        if act != "silu":
            raise ValueError(f"DBRX: ffn_config.ffn_act_fn {act!r} is not supported (only 'silu')")
        clip = nested_attn_config(hf_config, "clip_qkv")
        return DecoderSpec(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False,
                           clip_qkv=None if clip is None else float(clip))

    def sparse_block(self, layer_idx: int, facts: dict) -> nn.Module:
        return DbrxMoeBlock(self.config, layer_idx, facts)

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        if m := _WQKV.match(name):
            attn = self.model.layers[0].self_attn
            heads, kv_heads = self.config.num_attention_heads, self.config.num_key_value_heads
            sizes = [heads * attn.head_dim, kv_heads * attn.head_dim, kv_heads * attn.head_dim]
            if tensor.shape[0] != sum(sizes):
                raise ValueError(f"tensor {name!r} of shape {tuple(tensor.shape)}: Wqkv has {sum(sizes)} rows here")
            for proj, part in zip(("q_proj", "k_proj", "v_proj"), tensor.split(sizes)):
                yield f"model.layers.{m[1]}.self_attn.{proj}.weight", part
        elif m := _EXPERTS.match(name):
            experts = self.model.layers[int(m[1])].mlp.experts
            flat = tensor.view(experts.num_experts, -1, tensor.shape[-1])  # [E, I, H]
            for e, w in enumerate(flat):
                w = w.t() if m[2] == "w2" else w  # w2 holds each expert's down projection transposed
                yield f"model.layers.{m[1]}.mlp.experts.{e}.{_EXPERT_PROJ[m[2]]}.weight", w
        else:
            yield rename_first(name, _RENAMES), tensor
