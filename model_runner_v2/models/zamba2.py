"""Zamba2 (`Zamba2ForCausalLM`: Zyphra's Zamba2-1.2B / 2.7B / 7B), as transformers computes it: every layer a
pre-norm Mamba-2 mixer (mamba2.py) with its residual; in the layers `layers_block_type` calls "hybrid", a shared
transformer block first, whose output (through the layer's own `linear`) joins the mixer's input, not the stream:

    emb = embed(ids);  x = emb
    mamba layer:   x = x + mamba(norm(x))
    hybrid layer:  t = linear(block(x, emb));  x = x + mamba(norm(x + t))
    block(x, emb): h = input_layernorm([x | emb])  (2 H wide);  a = o_proj(attention(h))  (no residual)
                   return down(gelu(gate) * up),  gate | up = gate_up_proj(pre_ff_layernorm(a))  (no residual)

The `num_mem_blocks` blocks serve the hybrid layers round-robin (the j-th hybrid layer: block j % num_mem_blocks;
with untied embeddings transformers ties no copy of a block either, so each hybrid layer runs its own, saved under
it, and only its own adapters of the copy's list load);
each application attends over its own KV cache (KV layer j, as HRM-Text's shared layers: hrm_text.py). Attention
takes the 2 H-wide input: heads of `attention_head_dim` = 2 H / heads (q/k/v/o without biases), softmax scale
(head_dim / 2)^-0.5, rotate-half rope over whole heads where `use_mem_rope`. Per application j, low-rank adapters
(`adapter_rank`) add B_j A_j h to q, k and v (`use_shared_attention_adapter`) and to gate | up (always: transformers
builds them whatever the config says). The mixer: transformers' Zamba2MambaMixer, a biased convolution whatever
`use_conv_bias` says, in_proj / out_proj / the MLP biased as `add_bias_linear`, its gated norm (gate first) at eps
1e-5; dt unclamped, as transformers' one-token path (its one-pass path clamps dt below at `time_step_min`).

Weights as transformers saves them: `model.layers.N.mamba.*` / `input_layernorm` (mamba layers),
`model.layers.N.mamba_decoder.{mamba,input_layernorm}.*` and `linear` (hybrid ones), a block's under the first
hybrid layer that uses it, `model.layers.N.shared_transformer.*` (a state dict repeats it under every later one:
the same tensors), the adapters `...{linear_q,linear_k,linear_v,gate_up_proj}_adapter_list.j.{0,1}.weight` (j: the
hybrid layer's index among them), `model.final_layernorm`; the head tied. Tensor parallelism is refused
(hybrid_facts)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ...hybrid_facts import shared_block_layers
from ...model_config import position_limit
from ...rope_settings import RopeSettings
from ..attention import Attention
from .decoder import BIASLESS, DecoderAttention, DecoderLM, DecoderSpec
from .layers import RMSNorm, RotaryEmbedding
from .mamba2 import Mamba2Mixer
from .parallel import ColumnParallelLinear, RowParallelLinear, attach_lm_head, embedding
from .smollm3 import identity_rotary


def gelu(x: torch.Tensor, invariant: bool) -> torch.Tensor:
    """F.gelu (exact); invariant (batch_invariant mode): x / 2 (1 + erf(x / sqrt 2)) from separate fp32 ops, rounded
    once (F.gelu's CPU SIMD body and scalar tail may disagree in the last bit; torch.erf's do not)."""
    if not invariant:
        return F.gelu(x)
    g = x.float()
    return (g * 0.5 * (1.0 + torch.erf(g * 0.7071067811865476))).to(x.dtype)


def low_rank(width: int, rank: int, out: int) -> nn.Sequential:
    """An adapter h [T, width] -> B(A h) [T, out] (transformers' nn.Sequential: `0` A [rank, width], `1` B)."""
    return nn.Sequential(ColumnParallelLinear(width, [rank], bias=False), ColumnParallelLinear(rank, [out], bias=False))


class Zamba2Attention(DecoderAttention):
    """Attention over the block's 2 H-wide normed input, one Attention (KV layer j) per application j of the block,
    with application j's q / k / v adapters where the config has them."""

    def __init__(self, hf_config, spec: DecoderSpec, applications: list[int], rotary: RotaryEmbedding):
        super().__init__(hf_config, spec, applications[0], rotary)
        wide, heads = 2 * hf_config.hidden_size, hf_config.num_attention_heads
        self.qkv_proj = ColumnParallelLinear(wide, [heads * self.head_dim, self.kv_size, self.kv_size], bias=False)
        scale = (self.head_dim / 2) ** -0.5  # transformers': the head of the 2 H-wide input counted half
        a = self.attn
        self.visits = nn.ModuleList(Attention(j, a.num_heads, a.num_kv_heads, a.head_dim, scale) for j in applications)
        del self.attn
        self.adapters = None
        if hf_config.use_shared_attention_adapter:
            if self.kv_size != wide:  # transformers adds a 2 H-wide adapter to k and v
                raise ValueError(f"config.json: Zamba2's attention adapters need num_key_value_heads = "
                                 f"num_attention_heads ({heads}), got {hf_config.num_key_value_heads}")
            rank = int(hf_config.adapter_rank)
            self.adapters = nn.ModuleDict({f"linear_{p}_adapter_list": nn.ModuleDict(
                {str(j): low_rank(wide, rank, wide) for j in applications}) for p in "qkv"})

    def forward(self, positions: torch.Tensor, h: torch.Tensor, j: int, visit: int) -> torch.Tensor:
        """h [T, 2 H] (normed) in application j (the block's visit-th) -> [T, H]."""
        qkv = self.qkv_proj(h)  # [T, (Hq + 2 Hkv) D]
        if self.adapters is not None:
            qkv = qkv + torch.cat([self.adapters[f"linear_{p}_adapter_list"][str(j)](h) for p in "qkv"], dim=-1)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self.o_proj(self.visits[visit](positions, q, k, v, self.rotary))


class Zamba2MLP(nn.Module):
    """down(gelu(gate) * up) with application j's adapter added to gate | up."""

    batch_invariant = False  # layers.set_batch_invariant: the GELU from torch.erf (gelu above)

    def __init__(self, hf_config, applications: list[int]):
        super().__init__()
        if getattr(hf_config, "hidden_act", "gelu") != "gelu":
            raise ValueError(f"Zamba2's hidden_act {hf_config.hidden_act!r} is not supported (gelu)")
        hidden, inter, bias = hf_config.hidden_size, hf_config.intermediate_size, bool(hf_config.add_bias_linear)
        self.gate_up_proj = ColumnParallelLinear(hidden, [inter, inter], bias=bias)  # gate | up rows
        self.down_proj = RowParallelLinear(inter, hidden, bias=bias)
        rank = int(hf_config.adapter_rank)
        self.gate_up_proj_adapter_list = nn.ModuleDict({str(j): low_rank(hidden, rank, 2 * inter)
                                                        for j in applications})

    def forward(self, h: torch.Tensor, j: int) -> torch.Tensor:  # [T, H] (normed) -> [T, H]
        gate, up = (self.gate_up_proj(h) + self.gate_up_proj_adapter_list[str(j)](h)).chunk(2, dim=-1)
        return self.down_proj(gelu(gate, self.batch_invariant) * up)


class Zamba2Block(nn.Module):
    """One shared transformer block: applications[i] is the hybrid index of its i-th use."""

    def __init__(self, hf_config, applications: list[int], rotary: RotaryEmbedding):
        super().__init__()
        self.applications = applications
        eps, hidden = float(hf_config.rms_norm_eps), hf_config.hidden_size
        self.input_layernorm = RMSNorm(2 * hidden, eps)
        self.self_attn = Zamba2Attention(hf_config, BIASLESS, applications, rotary)
        self.pre_ff_layernorm = RMSNorm(hidden, eps)
        self.feed_forward = Zamba2MLP(hf_config, applications)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, emb: torch.Tensor, j: int, visit: int
                ) -> torch.Tensor:  # the stream x and the embeddings emb [T, H] -> [T, H]
        h = self.input_layernorm(torch.cat([x, emb], dim=-1))  # [T, 2 H]: the stream first
        a = self.self_attn(positions, h, j, visit)
        return self.feed_forward(self.pre_ff_layernorm(a), j)


class Zamba2Layer(nn.Module):
    """A pre-norm Mamba-2 layer; a hybrid one (`hybrid` = its index j among them) also holds its `linear`."""

    def __init__(self, hf_config, hybrid: int | None):
        super().__init__()
        self.hybrid = hybrid
        self.input_layernorm = RMSNorm(hf_config.hidden_size, float(hf_config.rms_norm_eps))
        self.mamba = Mamba2Mixer(hf_config)
        if hybrid is not None:
            self.linear = ColumnParallelLinear(hf_config.hidden_size, [hf_config.hidden_size], bias=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, shared: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The previous layer's output x and the stream before it (residual; None: x is the stream), the shared
        block's output t (hybrid layers: x the stream) -> (the mixer's output, the stream): the add deferred to the
        next layer's norm, as the decoder's."""
        if shared is not None:  # x + t enters the mixer; the stream goes on without t
            h, stream = self.input_layernorm.add_and_norm(self.linear(shared), x)[0], x
        elif residual is None:
            h, stream = self.input_layernorm(x), x
        else:
            h, stream = self.input_layernorm.add_and_norm(x, residual)
        return self.mamba(h), stream


class Zamba2Model(nn.Module):
    def __init__(self, hf_config):
        super().__init__()
        hybrid, blocks = shared_block_layers("Zamba2ForCausalLM", hf_config), int(hf_config.num_mem_blocks)
        if blocks < 1:
            raise ValueError(f"config.json: Zamba2's num_mem_blocks={blocks} must be >= 1")
        if hf_config.use_mem_rope and getattr(hf_config, "use_long_context", False):  # no reference to meet
            raise ValueError("Zamba2's use_long_context with use_mem_rope is not supported: transformers 5.25 says it "
                             "rescales rope_theta yet rotates with the config's")
        # transformers ties the hybrid layers' copies of a block only with tied embeddings (its tie mechanism
        # follows tie_word_embeddings): untied, every hybrid layer runs its own copy (saved under its own layer)
        self.num_mem_blocks = blocks if getattr(hf_config, "tie_word_embeddings", True) else len(hybrid)
        self.embed_tokens = embedding(hf_config.vocab_size, hf_config.hidden_size)
        self.layers = nn.ModuleList(Zamba2Layer(hf_config, hybrid.index(i) if i in hybrid else None)
                                    for i in range(hf_config.num_hidden_layers))
        rope = RopeSettings.from_hf_config(hf_config)
        head_dim = 2 * hf_config.hidden_size // hf_config.num_attention_heads
        rotary = RotaryEmbedding(head_dim, rope.max_positions(position_limit(hf_config)), rope)
        if not hf_config.use_mem_rope:
            rotary = identity_rotary(rotary)
        self.blocks = nn.ModuleList(Zamba2Block(hf_config, list(range(b, len(hybrid), self.num_mem_blocks)), rotary)
                                    for b in range(min(self.num_mem_blocks, len(hybrid))))
        self.final_layernorm = RMSNorm(hf_config.hidden_size, float(hf_config.rms_norm_eps))
        self.fp32_final_norm = False  # DecoderLM.enable_fp32_lm_head: the output is then fp32

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        emb = self.embed_tokens(input_ids)  # [T, H]
        x, residual = emb, None
        for layer in self.layers:
            shared, j = None, layer.hybrid
            if j is not None:  # the block sees the stream itself: the deferred add made here
                x, residual = (x if residual is None else x + residual), None
                shared = self.blocks[j % self.num_mem_blocks](positions, x, emb, j, j // self.num_mem_blocks)
            x, residual = layer(x, residual, shared)
        if self.fp32_final_norm:
            return self.final_layernorm.add_and_norm_fp32(x, residual)  # [T, H] fp32
        return self.final_layernorm.add_and_norm(x, residual)[0]


class Zamba2ForCausalLM(DecoderLM):
    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        return BIASLESS

    def __init__(self, hf_config):
        nn.Module.__init__(self)
        self.config = hf_config
        self.model = Zamba2Model(hf_config)
        self.hybrid = shared_block_layers("Zamba2ForCausalLM", hf_config)
        attach_lm_head(self, hf_config, tie_default=True)

    def _fused_shards(self) -> dict[str, tuple[str, int, int]]:
        """q_proj / k_proj / v_proj -> their rows of a block's qkv_proj (the checkpoints store gate_up_proj fused)."""
        if not len(self.model.blocks):  # no hybrid layer (hybrid_facts refuses the model)
            return {}
        q, kv = self.model.blocks[0].self_attn.q_size, self.model.blocks[0].self_attn.kv_size
        return dict(q_proj=("qkv_proj", 0, q), k_proj=("qkv_proj", q, kv), v_proj=("qkv_proj", q + kv, kv))

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        parts = name.split(".")
        if len(parts) > 4 and parts[:2] == ["model", "layers"]:
            if parts[3] == "mamba_decoder":  # a hybrid layer's mixer and norm: the layer's own
                del parts[3]
            elif parts[3] == "shared_transformer" and int(parts[2]) in self.hybrid:  # the block it applies (a
                # tied copy: the same block; untied: the layer's own)
                j = self.hybrid.index(int(parts[2]))
                block = j % self.model.num_mem_blocks
                parts = ["model", "blocks", str(block), *parts[4:]]
                adapter = len(parts) > 6 and parts[4].endswith("_adapter_list")
                if adapter and int(parts[5]) not in self.model.blocks[block].applications:
                    return ()  # an untied copy's adapters of the other layers sharing its block index: never run
                if len(parts) > 5 and parts[4].startswith("linear_") and parts[4].endswith("_adapter_list"):
                    parts.insert(4, "adapters")  # the attention's q / k / v adapters
        return ((".".join(parts), tensor),)
