"""HY-V4 (`HYV4ForCausalLM`: Tencent's Hy4), as transformers' HYV4 computes it:

- the residual stream as `hc_mult` hyper-connection streams [T, N, H] (models/hyper_connection.py): each layer's
  attention and MLP read a per-token mix of the streams and write their output back through per-stream weights,
  all in fp32; `model.hc_head` collapses the streams before the final norm;
- attention: GLM-5's (DeepSeek-V3.2's MLA with a q LoRA, the interleaved rotary in the model dtype, DeepSeek Sparse
  Attention) with an attention sink per head (fp32, `self_attn.sinks`) and a per-head output gate: o_proj(out *
  sigmoid(gate_proj(x))), gate_proj [H * v_head_dim, hidden]. Served up to max_model_len = `index_topk`
  (model_config.dense_attention_limit), where every indexer ("full" or "shared" per `indexer_types`) keeps every
  key: the indexers' weights are not loaded, as for DeepSeek-V3.2;
- MLPs: `mlp_layer_types`' dense layers Llama's SwiGLU; its sparse layers GLM-4.7-Flash's (V3's sigmoid router
  with its correction bias, one expert group, a shared expert) whose routed experts clamp their inputs:
  SiLU(min(gate, swiglu_limit)) * clamp(up, -swiglu_limit, swiglu_limit) (kernels/activation.ClampedSiLU; a limit
  <= 0: no clamp, as transformers).

transformers keeps its LM head in fp32: the engine's head is in the model dtype unless enable_fp32_lm_head (an fp32
model is exact either way). The hub's names (`hc_pre.hc_attn_layer.hc_fn`, `learnable_sink_param`, `linear_gate`,
...) are transformers' renamed on load (checkpoint_parts); the multi-token-prediction layers (`model.mtp_layers.*`)
are skipped, as transformers skips them."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ...kernels.activation import ClampedSiLU, sigmoid
from ...model_config import position_limit
from ...rope_settings import RopeSettings
from .decoder import DecoderMLP, DecoderSpec
from .deepseek import GlmMoeDsaForCausalLM
from .glm4_moe import Glm4MoeBlock
from .hyper_connection import HyperConnection, HyperHead
from .layers import RMSNorm, RotaryEmbedding
from .mla import MlaAttention
from .parallel import ColumnParallelLinear, attach_lm_head, embedding, get_tp_state, mark_sharded

# the hub's names -> transformers' (its conversion mapping for hy_v4), applied in this order
_HUB_RENAMES = ((".hc_pre.hc_", ".hc_"), (".learnable_sink_param", ".sinks"), (".linear_gate", ".gate_proj"),
                (".hc_attn_layer.hc_fn", ".attn_hc.fn"), (".hc_attn_layer.hc_base", ".attn_hc.base"),
                (".hc_attn_layer.hc_scale", ".attn_hc.scale"), (".hc_mlp_layer.hc_fn", ".ffn_hc.fn"),
                (".hc_mlp_layer.hc_base", ".ffn_hc.base"), (".hc_mlp_layer.hc_scale", ".ffn_hc.scale"),
                (".hc_head_fn", ".hc_fn"), (".hc_head_base", ".hc_base"), (".hc_head_scale", ".hc_scale"))


def check_hy_v4_config(hf_config) -> None:
    """ValueError for what this build cannot honour: layers other than "indexed_attention", indexer or MLP kinds
    transformers does not know, a first layer without its own indexer (transformers fails on it too)."""
    n = int(hf_config.num_hidden_layers)
    kinds = list(getattr(hf_config, "layer_types", None) or ["indexed_attention"] * n)
    if set(kinds) != {"indexed_attention"} or len(kinds) != n:
        raise ValueError(f"HY-V4: layer_types={kinds} not supported (only {n} x 'indexed_attention')")
    indexers = list(getattr(hf_config, "indexer_types", None) or ["full"] * n)
    if len(indexers) != n or not set(indexers) <= {"full", "shared"} or indexers[0] != "full":
        raise ValueError(f"HY-V4: indexer_types={indexers} must be {n} of 'full' / 'shared', the first 'full'")
    mlps = list(getattr(hf_config, "mlp_layer_types", None) or [])
    if len(mlps) != n or not set(mlps) <= {"dense", "sparse"}:
        raise ValueError(f"HY-V4: mlp_layer_types={mlps} must be {n} of 'dense' / 'sparse'")


class HYV4Attention(MlaAttention):
    """MLA (models/mla.py) with fp32 attention sinks (this rank's heads') and the sigmoid output gate of each head,
    in the model dtype as transformers multiplies it; gate_proj split by heads under tensor parallelism."""

    batch_invariant = False  # layers.set_batch_invariant: the gate's sigmoid in its row-invariant form

    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__(hf_config, spec, layer_idx, rotary)
        heads = hf_config.num_attention_heads
        # transformers' `gate_proj`, renamed at load: the dense MLPs' gate_proj rows go into their gate_up_proj
        self.o_gate_proj = ColumnParallelLinear(hf_config.hidden_size, [heads * self.v_head_dim])
        self.attn.enable_sinks()
        self.attn.sinks = nn.Parameter(self.attn.sinks.detach().float(), requires_grad=False)  # fp32 (transformers')
        mark_sharded(self.attn.sinks, 0, get_tp_state(), heads)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module
                ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = (norm(x), x) if residual is None else norm.add_and_norm(x, residual)
        out = self.attend(positions, x, self.query(x))  # [T, H * v]
        return self.o_proj(out * sigmoid(self.o_gate_proj(x), self.batch_invariant)), residual


class HYV4Layer(nn.Module):
    """Attention then MLP, each behind its hyper-connection (`attn_hc`, `ffn_hc`) and its RMSNorm."""

    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary: RotaryEmbedding, mlp: nn.Module):
        super().__init__()
        hidden, eps = hf_config.hidden_size, float(hf_config.rms_norm_eps)
        streams, hc_eps = int(hf_config.hc_mult), float(hf_config.hc_eps)
        self.self_attn = HYV4Attention(hf_config, spec, layer_idx, rotary)
        self.mlp = mlp  # DecoderMLP (dense layers) or HYV4MoeBlock
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        magnitude = float(hf_config.hc_magnitude)
        self.attn_hc = HyperConnection(hidden, streams, eps, hc_eps, magnitude)
        self.ffn_hc = HyperConnection(hidden, streams, eps, hc_eps, magnitude)

    def forward(self, positions: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:  # [T, N, H] -> [T, N, H]
        x, post = self.attn_hc(streams)
        out, _ = self.self_attn(positions, x, None, self.input_layernorm)
        streams = HyperConnection.expand(streams, post, out)
        x, post = self.ffn_hc(streams)
        x = self.post_attention_layernorm(x)
        out = self.mlp.down(self.mlp.gate_up_proj(x)) if isinstance(self.mlp, DecoderMLP) else self.mlp(x)
        return HyperConnection.expand(streams, post, out)


class HYV4Model(nn.Module):
    """Embedding copied into N streams -> layers -> hc_head -> final norm; named `model` as transformers'."""

    def __init__(self, hf_config, spec: DecoderSpec, build_mlp):
        super().__init__()
        hidden = hf_config.hidden_size
        self.embed_tokens = embedding(hf_config.vocab_size, hidden)  # vocab-parallel under TP
        rope = RopeSettings.from_hf_config(hf_config)
        rotary = RotaryEmbedding(spec.head_dim, rope.max_positions(position_limit(hf_config)), rope,
                                 interleaved=spec.rope_interleaved, rotary_dim=spec.rotary_dim)
        self.layers = nn.ModuleList(HYV4Layer(hf_config, spec, i, rotary, build_mlp(i))
                                    for i in range(hf_config.num_hidden_layers))
        eps = float(hf_config.rms_norm_eps)
        self.streams = int(hf_config.hc_mult)
        self.hc_head = HyperHead(hidden, self.streams, eps, float(hf_config.hc_eps))
        self.norm = RMSNorm(hidden, eps)
        self.fp32_final_norm = False  # DecoderLM.enable_fp32_lm_head: the output is then fp32

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, H]
        streams = x.unsqueeze(1).expand(-1, self.streams, -1).contiguous()  # [T, N, H]: N copies
        for layer in self.layers:
            streams = layer(positions, streams)
        x = self.hc_head(streams)  # [T, H]
        if self.fp32_final_norm:
            return self.norm.add_and_norm_fp32(x, torch.zeros_like(x))  # [T, H] fp32
        return self.norm(x)


class HYV4MoeBlock(Glm4MoeBlock):
    """GLM-4.7-Flash's sparse block (V3's router, a shared expert) with ClampedSiLU routed experts where
    `swiglu_limit` > 0 (the shared expert unclamped, as transformers)."""

    def __init__(self, hf_config, layer_idx: int, facts: dict, spec: DecoderSpec):
        super().__init__(hf_config, layer_idx, facts, spec)
        limit = float(getattr(hf_config, "swiglu_limit", 0.0) or 0.0)
        if limit > 0:
            self.experts.clamped = ClampedSiLU(limit)


class HYV4ForCausalLM(GlmMoeDsaForCausalLM):
    checkpoint_fp32_suffixes = (".mlp.gate.weight", ".mlp.gate.e_score_correction_bias", ".self_attn.sinks",
                                ".self_attn.learnable_sink_param", "_hc.fn", "_hc.base", "_hc.scale", ".hc_fn",
                                ".hc_base", ".hc_scale", ".hc_head_fn", ".hc_head_base", ".hc_head_scale")

    def __init__(self, hf_config):
        check_hy_v4_config(hf_config)
        nn.Module.__init__(self)
        self.config = hf_config
        self.model = HYV4Model(hf_config, self.spec(hf_config), self.build_mlp)
        attach_lm_head(self, hf_config)

    def sparse_block(self, layer_idx: int, facts: dict) -> nn.Module:
        return HYV4MoeBlock(self.config, layer_idx, facts, self.spec(self.config))

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """The hub's names as transformers'; the attention sinks into `self_attn.attn.sinks`, its gate_proj into
        `self_attn.o_gate_proj`; the MTP layers and the indexers (DeepseekV32ForCausalLM's) skipped."""
        if name.startswith("model.mtp_layers."):
            return ()
        for hub, ours in _HUB_RENAMES:
            name = name.replace(hub, ours)
        if name.endswith(".self_attn.sinks"):
            name = name[: -len("sinks")] + "attn.sinks"
        name = name.replace(".self_attn.gate_proj.", ".self_attn.o_gate_proj.")
        return super().checkpoint_parts(name, tensor)
