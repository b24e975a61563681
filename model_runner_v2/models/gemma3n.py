"""Gemma 3n's text model (`Gemma3nForCausalLM`; the released `Gemma3nForConditionalGeneration` checkpoints —
gemma-3n-E2B, E4B — served as their language model), as transformers computes it. Gemma 4's attention, KV sharing
and per-layer inputs (gemma4.py, gemma4_facts.layer_plans: every layer `head_dim` x `num_key_value_heads`, an MLP
width per layer), around three parts of its own:

AltUp: the residual stream is n = `altup_num_inputs` streams [n, T, H]; each layer runs on the active one
(`altup_active_idx`) and spreads its change over all. m(x) = tanh(modality_router(router_norm(x) * H^-1)) [T, n]
(the tanh in fp32, rounded), then
    predict:  p_i = s_i + sum_j C_ij s_j               C = prediction_coefs(m(s_active)) as [T, n, n]
    correct:  c_i = (y - p_active) * (1 + correction_coefs(m(y)))_i + p_i        y: the layer's output
Laurel: a rank-`laurel_rank` side branch beside attention, x + post_laurel_norm(right(left(x))).
Per layer, on a = p_active (every op in the model dtype unless said, each norm Gemma 4's RMSNorm):
    x = input_layernorm(a)
    h = (a + post_attention_layernorm(attn(x)) + laurel(x)) / sqrt(2)
    y = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))     GeGLU (gelu_tanh), width per layer
    c = correct(p, y);  c_1.. += post_per_layer_input_norm(per_layer_projection(gelu_tanh(per_layer_input_gate(
             c_active * correct_output_scale)) * ple[i]))
The MLPs of the layers with `activation_sparsity_pattern` s > 0 keep only a gate's values above mean + std *
Phi^-1(s) over its row (relu(g - cutoff), std over the row's N), before the GELU.
Model: the embeddings e (times sqrt(H) rounded to the dtype) and n - 1 projections of e scaled to e's RMS
(altup_projections) make the streams; at the end the n - 1 altup_unembed_projections, scaled to stream 0's RMS,
averaged with it, then the final norm, the tied head and capped logits.

Tensor parallelism splits the heads and the MLPs as Gemma 4's; AltUp, Laurel and the per-layer inputs are whole on
every rank. Piecewise CUDA graphs are refused (gemma4_facts.resolve_gemma4_options)."""

from __future__ import annotations

import math

import torch
from torch import nn

from ...gemma4_facts import Gemma4LayerPlan, gemma4_layers
from ...kernels.activation import gelu_tanh
from .decoder import DecoderMLP
from .gemma4 import Gemma4Attention, Gemma4ForCausalLM, Gemma4ForConditionalGeneration, Gemma4Model, _dtype_scale, _norm
from .layers import Linear, RotaryEmbedding


def _rms(x: torch.Tensor) -> torch.Tensor:
    return torch.mean(x**2, dim=-1, keepdim=True) ** 0.5  # transformers' target magnitude, in x's dtype


def _scaled_to(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """x times target / RMS(x) (the RMS floored at sqrt(1e-5)), transformers' two ops."""
    return x * target / torch.sqrt(torch.mean(x**2, dim=-1, keepdim=True).clamp(min=1e-5))


class Gemma3nAltUp(nn.Module):
    """The AltUp coefficients of one layer (module docstring); streams [n, T, H]."""

    def __init__(self, hf_config):
        super().__init__()
        hidden, n = hf_config.hidden_size, int(hf_config.altup_num_inputs)
        self.n, self.active = n, int(hf_config.altup_active_idx)
        self.correct_output_scale = nn.Parameter(torch.empty(hidden), requires_grad=False)
        self.correction_coefs = Linear(n, n)
        self.prediction_coefs = Linear(n, n * n)
        self.modality_router = Linear(hidden, n)
        self.router_norm = _norm(hidden, hf_config)
        self.router_scale = _dtype_scale(hidden**-1.0)

    def modalities(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, n]
        return torch.tanh(self.modality_router(self.router_norm(x) * self.router_scale).float()).to(x.dtype)

    def predict(self, streams: torch.Tensor) -> torch.Tensor:
        coefs = self.prediction_coefs(self.modalities(streams[self.active]))  # [T, n * n]: row i*n + j is C_ij
        coefs = coefs.view(-1, self.n, self.n).transpose(1, 2)  # [T, j, i]
        return (torch.matmul(streams.permute(1, 2, 0), coefs).permute(2, 0, 1) + streams).contiguous()

    def correct(self, predictions: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        coefs = self.correction_coefs(self.modalities(y)) + 1.0  # [T, n]
        innovation = y - predictions[self.active]
        return innovation.unsqueeze(0) * coefs.t().unsqueeze(-1) + predictions  # [n, T, H]


class Gemma3nLaurel(nn.Module):
    def __init__(self, hf_config):
        super().__init__()
        hidden, rank = hf_config.hidden_size, int(hf_config.laurel_rank)
        self.linear_left, self.linear_right = Linear(hidden, rank), Linear(rank, hidden)
        self.post_laurel_norm = _norm(hidden, hf_config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.post_laurel_norm(self.linear_right(self.linear_left(x)))


def _std_multiplier(sparsity: float) -> float:
    """Phi^-1(sparsity) as transformers computes it (torch's Normal in fp32), rounded to the model's dtype."""
    fp32 = torch.distributions.normal.Normal(0, 1).icdf(torch.tensor(sparsity, dtype=torch.float32))
    return _dtype_scale(float(fp32))


class Gemma3nLayer(nn.Module):
    batch_invariant = False  # layers.set_batch_invariant: the GELUs from torch.exp (kernels/activation.py)

    def __init__(self, hf_config, plan: Gemma4LayerPlan, rotary: RotaryEmbedding, layer_idx: int):
        super().__init__()
        hidden, per_layer = hf_config.hidden_size, int(hf_config.hidden_size_per_layer_input)
        self.self_attn = Gemma4Attention(hf_config, plan, rotary)
        self.mlp = DecoderMLP(hf_config, Gemma4ForCausalLM.spec(hf_config), intermediate_size=plan.mlp_width,
                              act=getattr(hf_config, "hidden_activation", None) or "gelu_pytorch_tanh")
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm", "post_per_layer_input_norm"):
            setattr(self, name, _norm(hidden, hf_config))
        self.altup, self.laurel = Gemma3nAltUp(hf_config), Gemma3nLaurel(hf_config)
        self.altup_correct_scale = bool(getattr(hf_config, "altup_correct_scale", True))
        self.per_layer_input_gate = Linear(hidden, per_layer)
        self.per_layer_projection = Linear(per_layer, hidden)
        pattern = getattr(hf_config, "activation_sparsity_pattern", None) or 0.0
        sparsity = float(pattern[layer_idx] if isinstance(pattern, (list, tuple)) else pattern)
        self.std_multiplier = _std_multiplier(sparsity) if sparsity > 0.0 else None

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.mlp.gate_up_proj(x)
        if self.std_multiplier is None:
            return self.mlp.down(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)  # [T, I] each: whole rows (no tensor parallelism: gemma4_facts)
        std = torch.std(gate, dim=-1, keepdim=True, unbiased=False)
        cutoff = torch.mean(gate, dim=-1, keepdim=True) + std * self.std_multiplier
        return self.mlp.down_proj(gelu_tanh(torch.relu(gate - cutoff), self.batch_invariant) * up)

    def forward(self, positions: torch.Tensor, streams: torch.Tensor, per_layer: torch.Tensor) -> torch.Tensor:
        """streams [n, T, H], per_layer [T, P] -> streams [n, T, H]."""
        predictions = self.altup.predict(streams)
        active = predictions[self.altup.active]
        x = self.input_layernorm(active)
        h = active + self.post_attention_layernorm(self.self_attn(positions, x))
        h = (h + self.laurel(x)) / math.sqrt(2)
        y = h + self.post_feedforward_layernorm(self._mlp(self.pre_feedforward_layernorm(h)))
        corrected = self.altup.correct(predictions, y)
        first = corrected[self.altup.active]
        if self.altup_correct_scale:
            first = first * self.altup.correct_output_scale
        g = gelu_tanh(self.per_layer_input_gate(first), self.batch_invariant) * per_layer
        corrected[1:] += self.post_per_layer_input_norm(self.per_layer_projection(g))
        return corrected


class Gemma3nModel(Gemma4Model):
    def __init__(self, hf_config, plans: tuple[Gemma4LayerPlan, ...]):
        super().__init__(hf_config, plans)
        c, hidden, n = hf_config, hf_config.hidden_size, int(hf_config.altup_num_inputs)
        self.altup_projections = nn.ModuleList(Linear(hidden, hidden) for _ in range(n - 1))
        self.altup_unembed_projections = nn.ModuleList(Linear(hidden, hidden) for _ in range(n - 1))
        self.table_rows = int(c.vocab_size_per_layer_input)
        self.per_layer_proj_scale = _dtype_scale(hidden**-0.5)
        self.per_layer_input_scale = _dtype_scale(2.0**-0.5)

    @staticmethod
    def make_layer(hf_config, plan: Gemma4LayerPlan, rotary: RotaryEmbedding, i: int) -> nn.Module:
        return Gemma3nLayer(hf_config, plan, rotary, i)

    def per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """[T, L, P]: Gemma 4's, with transformers' scales rounded to the dtype and ids past the table reading row 0."""
        shape = (x.shape[0], len(self.layers), self.per_layer)
        ids = torch.where((input_ids >= 0) & (input_ids < self.table_rows), input_ids, 0)
        token = (self.embed_tokens_per_layer(ids) * self.per_layer_scale).reshape(shape)
        proj = self.per_layer_model_projection(x) * self.per_layer_proj_scale
        proj = self.per_layer_projection_norm(proj.reshape(-1, self.per_layer)).reshape(shape)
        return (proj + token) * self.per_layer_input_scale

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids) * self.embed_scale  # [T, H]
        per_layer = self.per_layer_inputs(input_ids, x)
        target = _rms(x)
        streams = torch.stack([x] + [_scaled_to(p(x), target) for p in self.altup_projections])  # [n, T, H]
        for i, layer in enumerate(self.layers):
            streams = layer(positions, streams, per_layer[:, i])
        target = _rms(streams[0])
        outs = [streams[0]] + [_scaled_to(p(s), target) for p, s in zip(self.altup_unembed_projections, streams[1:])]
        x = torch.mean(torch.stack(outs), dim=0)
        if self.fp32_final_norm:
            return self.norm.add_and_norm_fp32(x, torch.zeros_like(x))  # [T, H] fp32
        return self.norm(x)


class Gemma3nForCausalLM(Gemma4ForCausalLM):
    model_class = Gemma3nModel

    @classmethod
    def layer_plans(cls, hf_config) -> tuple[Gemma4LayerPlan, ...]:
        return gemma4_layers(hf_config, uniform=True)


class Gemma3nForConditionalGeneration(Gemma3nForCausalLM, Gemma4ForConditionalGeneration):
    """The released checkpoints: `model.language_model.*` as Gemma3nForCausalLM's `model.*`; the vision and audio
    towers and their embedders skipped (language_model.py)."""
