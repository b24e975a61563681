"""Lara-4-Mini (`LaraMiniForCausalLM`: Translated's Lara-4-Mini), as transformers computes it: Qwen3.5's hybrid of
Gated DeltaNet layers ("linear_attention": gated_deltanet.py, a recurrent state per request) and attention layers,
as `layer_types` says (the released period of five: linear, sliding, linear, full, sliding), with

- Qwen3's attention in both attention kinds (per-head q/k RMSNorms before the rope, no output gate): the rotary over
  the whole head and a window of `sliding_window` in the "sliding_attention" layers, neither in the
  "full_attention" ones (NoPE); each keeps a KV cache (the linear layers none);
- every RMSNorm in Helium's order (the weight times the fp32 row, one cast: OLMo 2's), the layers', q/k's and the
  final one; the DeltaNet's gated norm GLM-5-Next's: the weight, the fp32 row and silu(z) multiplied in fp32, one
  cast (Qwen3-Next's rounds the row to the model dtype before its weight);
- Flint's sparse block in every layer (an fp32 router and an ungated shared SwiGLU of
  `shared_expert_intermediate_size` added to the routed sum) routing by softmax: the top k of softmax(fp32 logits),
  renormalised when `norm_topk_prob`, cast to the model dtype before they weigh the experts (Qwen's order);
- tied embeddings by default.

Weights: the hub's checkpoints fuse each DeltaNet's input projections into one `linear_attn.in_proj` (rows
q | k | v | z | b | a: the engine's own in_proj, loaded as it is, each part split per rank under tensor parallelism)
and name its gated norm `linear_attn.out_norm` (read as `norm`); transformers' in-memory form (`in_proj_qkv`,
`in_proj_z`, `in_proj_b`, `in_proj_a`, `norm`: LLM.load_weights from a trainer's module) loads as Qwen3.5's. The
router (`mlp.gate.weight`) is read in the model dtype, as transformers loads it (unlike Flint's: not in
checkpoint_fp32_suffixes), then held and applied in fp32 (Fp32Router)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ...kernels.activation import silu
from .decoder import DecoderAttention, DecoderLM, DecoderSpec, norm_eps
from .flint import FlintMoeBlock
from .gated_deltanet import GatedDeltaNet, GatedRMSNorm
from .hybrid_layer import HybridLayer
from .layers import RMSNorm, RotaryEmbedding
from .moe import SparseMoeBlock
from .qwen3_next import Qwen3NextForCausalLM
from .smollm3 import without_rotary


class Fp32GatedRMSNorm(GatedRMSNorm):
    """transformers' LaraMiniRMSNormGated (GLM-5-Next's, silu): weight * rms-normed row * silu(z), all in fp32, one
    cast back."""

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:  # [..., D], [..., D] -> [..., D]
        xf = x.float()
        normed = self.weight.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps))
        return (normed * silu(z.float(), self.batch_invariant)).to(x.dtype)


class LaraMiniDeltaNet(GatedDeltaNet):
    def __init__(self, hf_config):
        super().__init__(hf_config)
        self.norm = Fp32GatedRMSNorm(self.value_head_dim, norm_eps(hf_config))


class LaraMiniAttention(DecoderAttention):
    """Qwen3's attention (spec.qk_norm) with its per-head q/k norms in Helium's order."""

    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__(hf_config, spec, layer_idx, rotary)
        eps = norm_eps(hf_config)
        self.q_norm = RMSNorm(self.head_dim, eps, weight_in_fp32=True)
        self.k_norm = RMSNorm(self.head_dim, eps, weight_in_fp32=True)


class LaraMiniLayer(HybridLayer):
    """Attention (sliding or full: hybrid_facts reads lara_mini's "sliding_attention" as an attention kind, so the
    KV-cache index counts both) or a Gated DeltaNet under transformers' name `linear_attn`; Flint's MoE after it."""

    attention_class = LaraMiniAttention
    linear_name = "linear_attn"
    linear_class = LaraMiniDeltaNet

    @classmethod
    def make_norm(cls, hf_config) -> nn.Module:
        return RMSNorm(hf_config.hidden_size, norm_eps(hf_config), weight_in_fp32=True)


class LaraMiniMoeBlock(FlintMoeBlock):
    """Flint's block (fp32 router, ungated shared expert) with the softmax rule of moe.route on its fp32 logits;
    transformers casts the k weights to the model dtype (no fp32 weighing, unlike Flint's)."""

    fp32_weights = False
    route_tokens = SparseMoeBlock.route_tokens


class LaraMiniForCausalLM(Qwen3NextForCausalLM):  # Qwen3.5's DeltaNet weights (in_proj_qkv split at load)
    layer_class = LaraMiniLayer

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        return DecoderSpec.with_attention_bias(hf_config, qk_norm=True)

    def __init__(self, hf_config):
        super().__init__(hf_config)
        # NoPE in the full-attention layers (transformers hands them no position embeddings)
        kinds = list(hf_config.layer_types)
        without_rotary(layer for layer, kind in zip(self.model.layers, kinds) if kind == "full_attention")

    def sparse_block(self, layer_idx: int, facts: dict) -> nn.Module:
        return LaraMiniMoeBlock(self.config, layer_idx, facts, self.spec(self.config))

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        return super().checkpoint_parts(name.replace(".linear_attn.out_norm.", ".linear_attn.norm."), tensor)

    def _fused_shards(self) -> dict[str, tuple[str, int, int]]:
        """Qwen3's q | k | v (not Qwen3-Next's gated q) and the DeltaNet's in_proj parts."""
        shards = DecoderLM._fused_shards(self)
        linear = next((layer.linear_attn for layer in self.model.layers if hasattr(layer, "linear_attn")), None)
        if linear is not None:
            shards.update(linear.in_proj_shards())
        return shards
