"""Qwen4-Exp (`Qwen4ExpForCausalLM`, and `Qwen4ExpForConditionalGeneration`'s language model), as transformers 5.25
computes it: Qwen3.5-MoE's hybrid (Gated DeltaNet "linear_attention" layers: gated_deltanet.py, a recurrent state
per request; gated attention in the "indexed_attention" layers: qwen3_next.GatedAttention; every layer's MLP
Qwen3-Next's sparse block, routed experts plus a sigmoid-gated shared expert) with

- a gated residual in place of the pre-norms: the residual stream widened to `hc_count` (N) copies [T, N * H] of
  the embedding; before each block (attention or DeltaNet, then the MLP) a GatedResidual (hc_norm: a (1 + w) RMSNorm
  of each stream, then a low-rank sigmoid mix) collapses the normed streams into the block's input [T, H], and the
  block's output is added back to every stream times its own weight 2 sigmoid(inject(normed) / N) [T, N]. At the
  top `hyper_connection_mixer` collapses the streams once more (no injection) into the LM head's input: no final
  norm;
- the DeltaNet's output gate `output_gate_type` (else `hidden_act`): silu or sigmoid;
- QSA, the indexed layers' sparse attention: each query attends to the complete `indexer_compress_ratio`-token
  blocks its indexer scores highest (`indexer_budget` tokens of them) plus the incomplete tail block. A context of
  fewer than budget + ratio tokens has at most budget / ratio complete blocks: all chosen, the attention dense. So
  served up to max_model_len = budget + ratio - 1 (moe_facts.sparse_attention_limit), the indexer's weights
  (`self_attn.indexer.*`) not loaded, as DeepSeek-V3.2's;
- Per-Layer Embedding (`ple_layer_ids`: hashed n-gram embeddings of each token's last `ngram_size` tokens, gated
  into every stream through a dilated convolution) refused at load: its per-request token history and convolution
  history are state the engine's recurrent cache does not carry (check_qwen4_exp_config).

Tensor parallelism: the streams are whole on every rank (each block's output all-reduced before the injection), so
the gated residuals' weights are replicated and every rank computes the same mix."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ...hybrid_facts import layer_types
from ...kernels.activation import sigmoid, silu
from ...model_config import position_limit
from ...rope_settings import RopeSettings
from .decoder import DecoderSpec, norm_eps
from .gated_deltanet import GatedDeltaNet, GatedRMSNorm
from .layers import Linear, RotaryEmbedding
from .parallel import attach_lm_head, embedding
from .qwen3_next import GatedAttention, Qwen3NextForCausalLM

_GATES = ("silu", "sigmoid")  # the DeltaNet output gates transformers knows


def check_qwen4_exp_config(hf_config) -> None:
    """ValueError for what this build cannot honour: PLE layers, fewer than two streams, an unknown output gate."""
    ple = list(getattr(hf_config, "ple_layer_ids", None) or [])
    if ple:
        raise ValueError(f"Qwen4-Exp: ple_layer_ids={ple} (Per-Layer Embedding) is not supported: its n-gram token "
                         "history and dilated-convolution history per request are state the engine does not keep")
    if int(getattr(hf_config, "hc_count", 0) or 0) < 2:
        raise ValueError(f"Qwen4-Exp: hc_count={getattr(hf_config, 'hc_count', None)} must be > 1 (transformers')")
    gate = getattr(hf_config, "output_gate_type", None) or hf_config.hidden_act
    if gate not in _GATES:
        raise ValueError(f"Qwen4-Exp: output_gate_type={gate!r} not supported (one of {_GATES})")


class StreamRMSNorm(nn.Module):
    """transformers' Qwen4ExpTextRMSNorm with a group size: each H-wide stream of [T, N * H] normalised in fp32,
    times (1 + weight) [N * H] in fp32, cast back."""

    def __init__(self, streams: int, hidden: int, eps: float):
        super().__init__()
        self.streams, self.hidden, self.eps = streams, hidden, eps
        self.weight = nn.Parameter(torch.empty(streams * hidden), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, N * H] -> [T, N * H]
        xf = x.float().unflatten(-1, (self.streams, self.hidden))
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class GatedResidual(nn.Module):
    """transformers' Qwen4ExpTextGatedResidual: streams [T, N * H] -> the block's input [T, H] (and, with `inject`,
    each stream's weight for the block's output [T, N]), in the model dtype as transformers computes it."""

    batch_invariant = False  # layers.set_batch_invariant: silu / sigmoid from torch.exp (kernels/activation.py)

    def __init__(self, hf_config, inject: bool = True):
        super().__init__()
        self.streams, self.hidden = int(hf_config.hc_count), int(hf_config.hidden_size)
        width, rank = self.streams * self.hidden, int(hf_config.hc_lowrank)
        self.hc_norm = StreamRMSNorm(self.streams, self.hidden, float(hf_config.rms_norm_eps))
        self.input_mix_weight_down = Linear(width, rank)  # replicated (see the module docstring)
        self.input_mix_weight_up = Linear(rank, width)
        self.block_inject_weight = Linear(width, self.streams) if inject else None

    def mix(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """streams [T, N * H] -> (the mean over streams of mix * normed stream [T, H], the normed streams)."""
        inv, n = self.batch_invariant, self.streams
        normed = self.hc_norm(streams)
        mix = sigmoid(self.input_mix_weight_up(silu(self.input_mix_weight_down(normed) / n, inv)), inv)
        shape = (n, self.hidden)
        return (mix.unflatten(-1, shape) * normed.unflatten(-1, shape)).mean(dim=-2), normed

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, normed = self.mix(streams)
        return x, 2 * sigmoid(self.block_inject_weight(normed) / self.streams, self.batch_invariant)

    @staticmethod
    def inject(streams: torch.Tensor, weights: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """streams [T, N * H] + out [T, H] times each stream's weight [T, N] -> the new streams [T, N * H]."""
        return streams + (out.unsqueeze(-2) * weights.unsqueeze(-1)).flatten(-2)


class SigmoidGatedRMSNorm(GatedRMSNorm):
    """Qwen3NextRMSNormGated with activation "sigmoid": the row normed (rounded), times the weight, times
    sigmoid(z) in fp32, cast back."""

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * normed * sigmoid(z.float(), self.batch_invariant)).to(x.dtype)


class Qwen4ExpDeltaNet(GatedDeltaNet):
    def __init__(self, hf_config):
        super().__init__(hf_config)
        if (getattr(hf_config, "output_gate_type", None) or hf_config.hidden_act) == "sigmoid":
            self.norm = SigmoidGatedRMSNorm(self.value_head_dim, norm_eps(hf_config))


class Qwen4ExpLayer(nn.Module):
    """A DeltaNet (`linear_attn`) or gated attention (`self_attn`, its KV cache: the attention layers before it),
    then the sparse MLP, each behind its GatedResidual: [T, N * H] -> [T, N * H]."""

    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary: RotaryEmbedding, mlp: nn.Module):
        super().__init__()
        kinds = layer_types(hf_config)  # "indexed_attention" read as "full_attention" (hybrid_facts)
        if kinds[layer_idx] == "linear_attention":
            self.linear_attn = Qwen4ExpDeltaNet(hf_config)
        else:
            self.self_attn = GatedAttention(hf_config, kinds[:layer_idx].count("full_attention"), rotary)
        self.mlp = mlp
        self.attn_hyper_connection = GatedResidual(hf_config)
        self.mlp_hyper_connection = GatedResidual(hf_config)

    def forward(self, positions: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        x, weights = self.attn_hyper_connection(streams)
        out = self.linear_attn(x) if hasattr(self, "linear_attn") else self.self_attn(positions, x)
        streams = GatedResidual.inject(streams, weights, out)
        x, weights = self.mlp_hyper_connection(streams)
        return GatedResidual.inject(streams, weights, self.mlp(x))


class Qwen4ExpModel(nn.Module):
    """Embedding copied into N streams -> layers -> hyper_connection_mixer; named `model` as transformers'."""

    def __init__(self, hf_config, spec: DecoderSpec, build_mlp):
        super().__init__()
        hidden = hf_config.hidden_size
        self.embed_tokens = embedding(hf_config.vocab_size, hidden)  # vocab-parallel under TP
        rope = RopeSettings.from_hf_config(hf_config, spec.partial_rotary_factor)
        head_dim = spec.head_dim or int(getattr(hf_config, "head_dim", None) or hidden // hf_config.num_attention_heads)
        rotary = RotaryEmbedding(head_dim, rope.max_positions(position_limit(hf_config)), rope,  # DecoderModel's
                                 interleaved=spec.rope_interleaved, fp32_math=spec.rope_fp32,
                                 rotary_dim=spec.rotary_dim or None, fp32_tables=spec.rope_fp32_tables)
        self.layers = nn.ModuleList(Qwen4ExpLayer(hf_config, spec, i, rotary, build_mlp(i))
                                    for i in range(hf_config.num_hidden_layers))
        self.streams = int(hf_config.hc_count)
        self.hyper_connection_mixer = GatedResidual(hf_config, inject=False)
        self.fp32_final_norm = False  # DecoderLM.enable_fp32_lm_head: the output is then fp32

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        streams = self.embed_tokens(input_ids).repeat(1, self.streams)  # [T, N * H]: N copies
        for layer in self.layers:
            streams = layer(positions, streams)
        x, _ = self.hyper_connection_mixer.mix(streams)  # [T, H]
        return x.float() if self.fp32_final_norm else x


class Qwen4ExpForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5-MoE's weights (in_proj_qkv split at load, the shared expert's gate and up fused, `mtp.*` skipped)
    and the gated residuals' as named; top-k renormalised as `norm_topk_prob` says (moe_facts)."""

    def __init__(self, hf_config):
        check_qwen4_exp_config(hf_config)
        nn.Module.__init__(self)
        self.config = hf_config
        self.model = Qwen4ExpModel(hf_config, self.spec(hf_config), self.build_mlp)
        attach_lm_head(self, hf_config)

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """QSA's indexer (dense up to the limit: module docstring) skipped."""
        return () if ".self_attn.indexer." in name else super().checkpoint_parts(name, tensor)


class Qwen4ExpForConditionalGeneration(Qwen4ExpForCausalLM):
    """The multimodal checkpoint's language model (its vision tower skipped: language_model.py)."""
