"""MiniMax-Text-01 / MiniMax-M1 (`MiniMaxForCausalLM`, model_type `minimax`), as transformers computes it: layers of
Lightning Attention ("linear_attention": a linear attention with a fixed decay per head, a recurrent state per request)
and Mixtral's attention ("full_attention": rotate-half rope over the whole head, an optional window), each followed by
Mixtral's sparse MoE (softmax router, top k renormalised, SwiGLU experts) in every layer.

The layer's residual is the *normed* input, each sum weighed by the config's factors:
    h = input_layernorm(x);  y = h * alpha_attn + attn(h) * beta_attn     (full_attn_* or linear_attn_* factors)
    z = post_attention_layernorm(y);  out = z * mlp_alpha_factor + moe(z) * mlp_beta_factor
(out is the next layer's x, whole: no residual stream around the norms.) Here the layer hands on (moe(z) * beta,
z * alpha), which the next norm adds (RMSNorm.add_and_norm), as every decoder layer's deferred residual.

Lightning Attention of layer l (H = num_attention_heads heads of D = head_dim, L = num_hidden_layers):
    q | k | v = silu(qkv_proj(h)), per head [q_h | k_h | v_h] (rows H x 3D, head-major); q not scaled
    slope_h = (2^(-8/H))^(h + 1) * (1 - l / (L - 1 + 1e-5) + 1e-5)        [H] fp32, from the config alone
    S_t = exp(-slope_h) S_{t-1} + k_t^T v_t  (S [D, D] per head, zeros at a request's start);  o_t = q_t S_t
    o = sigmoid(output_gate(h)) * RMSNorm_{H D}(o) (one norm over all heads' channels, eps 1e-6: transformers'
    LlamaRMSNorm default, not rms_norm_eps); out_proj.
transformers' prefill runs the same recurrence in blocks of `block_size` (intra-block decay matrix, inter-block
state): the same maths, other roundings. Here the recurrence is Mamba-2's selective state update
(kernels/mamba_ssm.py, torch and Triton) with dt = 1, A = -slope, B = k, C = q, x = v, D = 0: its state
[H, D (v channel), D (k channel)] is S transposed, and y = S C is q S. The layer keeps no convolution history
(hybrid_facts.RecurrentShape: a kernel of 1, no channels).

Weights: `self_attn.{qkv_proj, output_gate, out_proj, norm}` in the linear layers (the buffers transformers saves
beside them, `slope_rate`, `query_decay`, `key_decay`, `diagonal_decay`, are derived from the config and skipped),
`self_attn.{q,k,v,o}_proj` in the others; the experts `block_sparse_moe.experts.E.{w1, w3, w2}` (the hub's and
transformers' save) or stacked `mlp.experts.*` (a transformers module). Tensor parallelism is refused (hybrid_facts:
the output norm spans every head)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ...hybrid_facts import layer_types
from ...kernels.activation import sigmoid, silu
from ...kernels.dispatch import use_fused_kernels
from ...kernels.mamba_ssm import ssm_update_torch, ssm_update_triton
from .decoder import DecoderAttention, DecoderSpec, norm_eps
from .layers import Linear, RMSNorm, RotaryEmbedding
from .mixtral import MixtralForCausalLM, block_sparse_moe_name
from .recurrent_layer import RecurrentLayer

_DERIVED_BUFFERS = ("slope_rate", "query_decay", "key_decay", "diagonal_decay")
_OUT_NORM_EPS = 1e-6  # transformers' MiniMaxRMSNorm(H * D) takes LlamaRMSNorm's default eps


def lightning_slopes(num_heads: int, layer_idx: int, num_layers: int) -> torch.Tensor:
    """Each head's decay rate in layer `layer_idx` [H] fp32 (whatever the model's dtype: the state is fp32):
    transformers' get_slope_rate, in its order of ops."""
    base = 1 / (2 ** (8 / num_heads))
    factor = 1 - layer_idx / (num_layers - 1 + 1e-5) + 1e-5
    return (base ** (torch.arange(num_heads, dtype=torch.float32) + 1)) * factor


class LightningAttention(RecurrentLayer):
    def __init__(self, hf_config, layer_idx: int):
        super().__init__()
        hidden, heads = hf_config.hidden_size, hf_config.num_attention_heads
        self.num_heads = heads
        self.head_dim = int(getattr(hf_config, "head_dim", None) or hidden // heads)
        self.width = heads * self.head_dim
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported by the lightning layers (silu)")
        self.qkv_proj = Linear(hidden, 3 * self.width)  # per head q_h | k_h | v_h
        self.output_gate = Linear(hidden, self.width)
        self.out_proj = Linear(self.width, hidden)
        self.norm = RMSNorm(self.width, _OUT_NORM_EPS)
        slopes = lightning_slopes(heads, layer_idx, hf_config.num_hidden_layers)
        self.register_buffer("neg_slope", -slopes, persistent=False)  # A [H] fp32: the log decay per token
        f32 = torch.float32  # (the loader builds the model under its dtype as the default)
        self.register_buffer("dt", torch.ones(1, heads, dtype=f32), persistent=False)  # dt = 1: S = S exp(A) + k (x) v
        self.register_buffer("skip", torch.zeros(heads, dtype=f32), persistent=False)  # D = 0: no skip term

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] (normed) -> [T, hidden]
        md, pos_start = self.step()
        t, h, d, inv = x.shape[0], self.num_heads, self.head_dim, self.batch_invariant
        qkv = silu(self.qkv_proj(x), inv).view(t, h, 3 * d).float()
        q, k, v = qkv.split(d, dim=-1)  # [T, H, D] strided views
        rule = ssm_update_triton if use_fused_kernels(x.device) else ssm_update_torch
        o = rule(v.contiguous(), self.dt.expand(t, h).contiguous(), self.neg_slope, k.contiguous(), q.contiguous(),
                 self.skip, self.state, md.req_slots, md.query_start_loc, pos_start, md.max_query_len)  # [T, H, D]
        o = self.norm(o.reshape(t, self.width).to(x.dtype))
        return self.out_proj(sigmoid(self.output_gate(x), inv) * o)


class MiniMaxAttention(DecoderAttention):
    """Mixtral's attention over an input already normed (the layer's residual needs the normed h too)."""

    def forward(self, positions: torch.Tensor, h: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        q, k, v = self.qkv_proj(h).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self.o_proj(self.attn(positions, q, k, v, self.rotary, None, None))


def _factors(hf_config, kind: str) -> tuple[float, float]:
    """(alpha, beta) of `kind`'s residual sum: `{kind}_alpha_factor` (the normed input's), `{kind}_beta_factor`."""
    return tuple(float(getattr(hf_config, f"{kind}_{s}_factor", 1)) for s in ("alpha", "beta"))


def _scaled(x: torch.Tensor, factor: float) -> torch.Tensor:
    return x if factor == 1.0 else x * factor


class MiniMaxLayer(nn.Module):
    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary: RotaryEmbedding, mlp: nn.Module):
        super().__init__()
        kinds = layer_types(hf_config)
        self.linear = kinds[layer_idx] == "linear_attention"
        if self.linear:
            self.self_attn: nn.Module = LightningAttention(hf_config, layer_idx)
            kind = "linear_attn"
        else:  # its KV cache: the full-attention layers' count before it
            self.self_attn = MiniMaxAttention(hf_config, spec, kinds[:layer_idx].count("full_attention"), rotary)
            kind = "full_attn"
        self.attn_alpha, self.attn_beta = _factors(hf_config, kind)
        self.mlp_alpha, self.mlp_beta = _factors(hf_config, "mlp")
        self.mlp = mlp
        self.input_layernorm = self.make_norm(hf_config)
        self.post_attention_layernorm = self.make_norm(hf_config)

    @classmethod
    def make_norm(cls, hf_config) -> nn.Module:
        return RMSNorm(hf_config.hidden_size, norm_eps(hf_config))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual: the previous layer's moe(z) * beta and z * alpha (residual None: x the embeddings) ->
        this layer's two, which the next norm adds."""
        h = self.input_layernorm(x) if residual is None else self.input_layernorm.add_and_norm(x, residual)[0]
        a = self.self_attn(h) if self.linear else self.self_attn(positions, h)
        z, _ = self.post_attention_layernorm.add_and_norm(_scaled(a, self.attn_beta), _scaled(h, self.attn_alpha))
        return _scaled(self.mlp(z), self.mlp_beta), _scaled(z, self.mlp_alpha)


class MiniMaxForCausalLM(MixtralForCausalLM):
    layer_class = MiniMaxLayer

    def __init__(self, hf_config):
        layer_types(hf_config)  # ValueError for a list that names other kinds or another number of layers
        super().__init__(hf_config)

    def _fused_shards(self) -> dict[str, tuple[str, int, int]]:
        """q / k / v rows of the attention layers' qkv_proj (the lightning layers' own qkv_proj loads whole)."""
        attn = next((layer.self_attn for layer in self.model.layers if not layer.linear), None)
        if attn is None:
            return {}
        q, kv = attn.q_size, attn.kv_size
        return dict(q_proj=("qkv_proj", 0, q), k_proj=("qkv_proj", q, kv), v_proj=("qkv_proj", q + kv, kv))

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        if name.rsplit(".", 1)[-1] in _DERIVED_BUFFERS:
            return ()  # transformers' decay tables: the layer derives its slopes from the config
        return ((block_sparse_moe_name(name), tensor),)
