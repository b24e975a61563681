"""Inkling (`InklingForCausalLM`: Thinking Machines' Inkling text model), as transformers 5.25 computes it:

- the embedding normed (`embed_tokens.embed_norm`, Llama's RMSNorm); no rotary anywhere (positions reach the model
  through the short convolutions and the attention's relative bias);
- each layer (inkling_facts: "hybrid" full attention, "hybrid_sliding" a window with its own heads): h = x +
  attn_sconv(attention(input_layernorm(x))), then h + mlp_sconv(mlp(post_attention_layernorm(h))), each `*_sconv` a
  causal depthwise convolution plus its own input, in fp32 (its history per request: hybrid_facts, one per layer
  holding k | v | attention output | MLP output); the attention in models/inkling_attention.py;
- MLPs by `mlp_layer_types`: dense SwiGLU times a learned scalar (`global_scale`); sparse: a router over the routed
  and the shared experts at once (fp32 logits; the top k of sigmoid(routed) + e_score_correction_bias; the k chosen
  and the shared experts weighted by their sigmoids normalised together, times route_scale * the router's
  global_scale, cast to the model dtype), SwiGLU routed experts, the shared experts each weighted by its own share,
  summed in fp32;
- the final norm, the hidden divided by `logits_mup_width_multiplier`, an untied head; logits past
  `unpadded_vocab_size` (a padded head) set to -inf (transformers drops them).
The hub's checkpoint form is read too (inkling_checkpoint.py); multi-token-prediction layers (`model.mtp.*`) are not
loaded, as transformers skips them. Tensor parallelism and CUDA
graphs are refused (inkling_facts.resolve_inkling_options)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ...inkling_facts import inkling_layers
from ...kernels.gated_delta import conv_windows
from ...moe_facts import moe_facts
from .decoder import DecoderLM
from .inkling_attention import InklingAttention, ShortConvWeight
from .inkling_checkpoint import inkling_checkpoint_parts
from .layers import Linear, RMSNorm
from .moe import SparseMoeBlock
from .parallel import ColumnParallelLinear, RowParallelLinear, embedding, lm_head
from .recurrent_layer import RecurrentLayer


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class InklingMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) * global_scale [1] (the model dtype, as transformers' parameter)."""

    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.gate_proj = ColumnParallelLinear(hidden, [width])
        self.up_proj = ColumnParallelLinear(hidden, [width])
        self.down_proj = RowParallelLinear(width, hidden)
        self.global_scale = nn.Parameter(torch.empty(1), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(_silu_mul(self.gate_proj(x), self.up_proj(x))) * self.global_scale


class InklingSharedExperts(nn.Module):
    """S SwiGLU experts over every token, gate / up [S * I, H] and down [S * H, I] (the checkpoints' [S, I, H] and
    [S, H, I] flattened at load), expert s's output times its share [T] before the fp32 sum over s."""

    batch_invariant = False

    def __init__(self, count: int, hidden: int, width: int):
        super().__init__()
        self.count, self.hidden, self.width = count, hidden, width
        self.gate_proj = nn.Parameter(torch.empty(count * width, hidden), requires_grad=False)
        self.up_proj = nn.Parameter(torch.empty(count * width, hidden), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(count * hidden, width), requires_grad=False)

    def _linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return Linear.matmul(self, x, weight)  # the row-invariant matmul when batch_invariant

    def forward(self, x: torch.Tensor, shares: torch.Tensor) -> torch.Tensor:  # x [T, H], shares [T, S] -> [T, H]
        gates = self.gate_proj.view(self.count, self.width, self.hidden)
        ups = self.up_proj.view(self.count, self.width, self.hidden)
        downs = self.down_proj.view(self.count, self.hidden, self.width)
        total = None
        for s in range(self.count):
            h = _silu_mul(self._linear(x, gates[s]), self._linear(x, ups[s])) * shares[:, s : s + 1]
            y = self._linear(h, downs[s]).float()
            total = y if total is None else total + y
        return total.to(x.dtype)


class InklingMoeBlock(SparseMoeBlock):
    """`gate` [E + S, H] (routed rows, then the shared experts'), its `e_score_correction_bias` [E] and
    `global_scale` [1] (fp32), the routed experts and `shared_experts`."""

    def __init__(self, hf_config, layer_idx: int, facts: dict):
        super().__init__(hf_config, layer_idx, facts)
        hidden, routed = int(hf_config.hidden_size), facts["num_experts"]
        self.shared = int(hf_config.n_shared_experts)
        self.route_scale = float(hf_config.route_scale)
        self.gate = Linear(hidden, routed + self.shared)
        self.gate.e_score_correction_bias = nn.Parameter(torch.empty(routed, dtype=torch.float32),
                                                         requires_grad=False)
        self.gate.global_scale = nn.Parameter(torch.empty(1, dtype=torch.float32), requires_grad=False)
        self.shared_experts = InklingSharedExperts(self.shared, hidden, facts["moe_intermediate_size"])
        self.shares: torch.Tensor | None = None  # the step's shared-expert shares [T, S] (route_tokens)

    def route_tokens(self, x: torch.Tensor, forced: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k], ids [T, k]), transformers' InklingTopkRouter in fp32; the shared experts'
        shares [T, S] kept in self.shares for forward. forced [T, k] int16 (routing replay): rows with ids >= 0 take
        them, weighed alike."""
        logits = Linear.matmul(self.gate, x.float(), self.gate.weight.float())  # [T, E + S] fp32
        routed, shared = logits[:, : -self.shared], logits[:, -self.shared :]
        ids = torch.topk(routed.sigmoid() + self.gate.e_score_correction_bias, self.top_k, dim=-1)[1]
        if forced is not None:
            ids = torch.where(forced[:, :1] >= 0, forced.long(), ids)
        log_probs = F.logsigmoid(torch.cat((routed.gather(-1, ids), shared), dim=-1))  # [T, k + S]
        weights = torch.exp(log_probs - torch.logsumexp(log_probs, dim=-1, keepdim=True))
        weights = (weights * self.route_scale * self.gate.global_scale).to(x.dtype)  # transformers' one cast
        self.shares = weights[:, self.top_k :]
        return weights[:, : self.top_k].float(), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.record_routes(x)
        routed = self.experts(x, ids, weights)
        return routed + self.shared_experts(x, self.shares)


class InklingLayer(RecurrentLayer):
    """One decoder layer and its convolution history (RecurrentLayer: bound per request slot), shared by its four
    convolutions at their channel offsets: k | v (the widest kind's width each) | attention out | MLP out."""

    has_state = False  # the convolutions' histories are the whole state

    def __init__(self, hf_config, layer_idx: int, mlp: nn.Module):
        super().__init__()
        plans = inkling_layers(hf_config)
        hidden, eps, kernel = int(hf_config.hidden_size), float(hf_config.rms_norm_eps), int(hf_config.conv_kernel_size)
        kv = max(p.kv_width for p in plans)
        self.self_attn = InklingAttention(hf_config, plans[layer_idx], layer_idx, kernel, kv)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.attn_sconv = ShortConvWeight(hidden, kernel, 2 * kv)
        self.mlp_sconv = ShortConvWeight(hidden, kernel, 2 * kv + hidden)
        self._step = None  # (metadata, each row's first position): this step's, read once per forward

    def short_conv(self, x: torch.Tensor, conv: ShortConvWeight) -> torch.Tensor:
        """x [T, C] -> (conv(x) + x) [T, C]: the causal convolution over each request's inputs in fp32, plus its
        input, rounded once (transformers' InklingShortConvolution); its history at conv.offset of the slot."""
        md, pos_start = self._step
        history = self.conv_state[:, :, conv.offset : conv.offset + conv.channels]  # a view: written in place
        y = conv_windows(x, history, md.req_slots, md.token_req_idx, md.positions, pos_start, md.query_start_loc,
                         md.seq_lens, conv.conv1d.weight, out_dtype=torch.float32)
        return (y + x.float()).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        self._step = self.step()
        h = x + self.short_conv(self.self_attn(self.input_layernorm(x), self.short_conv), self.attn_sconv)
        return h + self.short_conv(self.mlp(self.post_attention_layernorm(h)), self.mlp_sconv)


class InklingModel(nn.Module):
    def __init__(self, hf_config, build_mlp):
        super().__init__()
        hidden, eps = int(hf_config.hidden_size), float(hf_config.rms_norm_eps)
        self.embed_tokens = embedding(hf_config.vocab_size, hidden)
        self.embed_tokens.embed_norm = RMSNorm(hidden, eps)
        self.layers = nn.ModuleList(InklingLayer(hf_config, i, build_mlp(i))
                                    for i in range(hf_config.num_hidden_layers))
        self.norm = RMSNorm(hidden, eps)
        self.fp32_final_norm = False  # DecoderLM.enable_fp32_lm_head: the output is then fp32

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens.embed_norm(self.embed_tokens(input_ids))  # [T, H]
        for layer in self.layers:
            x = layer(x)
        if self.fp32_final_norm:
            return self.norm.add_and_norm_fp32(x, torch.zeros_like(x))  # [T, H] fp32
        return self.norm(x)


class InklingForCausalLM(DecoderLM):
    checkpoint_fp32_suffixes = ("sconv.conv1d.weight", ".mlp.gate.e_score_correction_bias", ".mlp.gate.global_scale")

    def __init__(self, hf_config):
        inkling_layers(hf_config)  # ValueError for a plan this engine does not honour
        nn.Module.__init__(self)
        self.config = hf_config
        self.model = InklingModel(hf_config, self.build_mlp)
        self.tie_word_embeddings = False  # `embed` and `unembed` are separate in every checkpoint (transformers)
        self.lm_head = lm_head(int(hf_config.hidden_size), int(hf_config.vocab_size))
        self.mup = float(hf_config.logits_mup_width_multiplier)
        unpadded = getattr(hf_config, "unpadded_vocab_size", None)
        self.unpadded = None if unpadded is None or int(unpadded) >= hf_config.vocab_size else int(unpadded)

    def build_mlp(self, layer_idx: int) -> nn.Module:
        facts = moe_facts(type(self).__name__, self.config)
        if facts and layer_idx in facts["moe_layers"]:
            return InklingMoeBlock(self.config, layer_idx, facts)
        return InklingMLP(int(self.config.hidden_size), int(self.config.intermediate_size))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden / self.mup)  # [N, V]
        if self.unpadded is not None:  # the padded head's extra rows: never a token
            logits[:, self.unpadded :] = -torch.inf
        return logits

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """The hub's form as transformers' names (inkling_checkpoint.py); the towers and MTP layers skipped."""
        return inkling_checkpoint_parts(name, tensor)
