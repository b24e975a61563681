"""Llama causal LM: GQA, optional attention/MLP biases, tied or untied head, llama3 rope scaling; Mistral; Ministral;
Seed-OSS; Arcee; EXAONE 3.x; InternLM3; Jais 2."""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from .decoder import DecoderLayer, DecoderLM, DecoderSpec
from .layers import LayerNorm
from .plain_mlp import PlainMLP


class LlamaForCausalLM(DecoderLM):
    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        bias = bool(getattr(hf_config, "attention_bias", False))
        mlp_bias = bool(getattr(hf_config, "mlp_bias", False))
        return DecoderSpec(qkv_bias=bias, o_bias=bias, mlp_bias=mlp_bias, qk_norm=False)


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama's layers and weight names, and its sliding window in every layer (Attention.fit_context)."""


class MinistralForCausalLM(MistralForCausalLM):
    """Ministral (transformers' `MinistralForCausalLM`, Ministral-8B-2410's layers): Mistral's, the window only in the
    layers `layer_types` calls sliding (model_config)."""


class CwmForCausalLM(MinistralForCausalLM):
    """CWM (`CwmForCausalLM`: Meta's Code World Model 32B): Llama's layers without biases, llama3 rope, a window in the
    layers `layer_types` calls sliding (three of every four; transformers' CwmConfig writes them): Ministral's."""


class SeedOssForCausalLM(LlamaForCausalLM):
    """Seed-OSS (ByteDance's Seed-OSS-36B): Llama's layers with the q/k/v bias (`attention_bias`, on by default) apart
    from the o_proj one (`attention_out_bias`, off by default)."""

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        return DecoderSpec(qkv_bias=bool(getattr(hf_config, "attention_bias", True)),
                           o_bias=bool(getattr(hf_config, "attention_out_bias", False)),
                           mlp_bias=bool(getattr(hf_config, "mlp_bias", False)), qk_norm=False)


class ArceeForCausalLM(LlamaForCausalLM):
    """Arcee (AFM-4.5B): Llama's layers with an ungated MLP, down_proj(relu(up_proj(x))^2) (transformers' ArceeMLP,
    Nemotron's)."""

    def build_mlp(self, layer_idx: int) -> nn.Module:
        return PlainMLP(self.config, ("up_proj", "down_proj"), "Arcee", ("relu2",), "relu2",
                        bias=bool(getattr(self.config, "mlp_bias", False)))


# EXAONE 3.x's tensor names (GPT-2's module names over Llama's layers) -> Llama's
_EXAONE_NAMES = ((r"^transformer\.wte\.", "model.embed_tokens."), (r"^transformer\.h\.", "model.layers."),
                 (r"^transformer\.ln_f\.", "model.norm."), (r"\.attn\.attention\.out_proj\.", ".self_attn.o_proj."),
                 (r"\.attn\.attention\.", ".self_attn."), (r"\.ln_1\.", ".input_layernorm."),
                 (r"\.ln_2\.", ".post_attention_layernorm."), (r"\.mlp\.c_fc_0\.", ".mlp.gate_proj."),
                 (r"\.mlp\.c_fc_1\.", ".mlp.up_proj."), (r"\.mlp\.c_proj\.", ".mlp.down_proj."))


class ExaoneForCausalLM(LlamaForCausalLM):
    """EXAONE 3.0 / 3.5 (LG AI Research; `ExaoneForCausalLM`, model_type "exaone"): Llama's model (transformers runs it
    with its Llama class) under GPT-2-style tensor names (`transformer.h.N.attn.attention.q_proj`, `mlp.c_fc_0` the
    gate, `c_fc_1` the up, `c_proj` the down; `ln_1` / `ln_2`), renamed at load; the config's `num_layers`,
    `layer_norm_epsilon`, `activation_function` are transformers' ExaoneConfig aliases."""

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        for pattern, ours in _EXAONE_NAMES:
            name = re.sub(pattern, ours, name)
        return ((name, tensor),)


class InternLM3ForCausalLM(LlamaForCausalLM):
    """InternLM3 (`InternLM3ForCausalLM`: internlm3-8b-instruct): Llama's model and tensor names (transformers runs it
    with its Llama class); the config's `qkv_bias` / `bias` are transformers' InternLM3Config aliases of
    `attention_bias` / `mlp_bias`; its "dynamic" rope is RopeSettings' dynamic NTK."""


class Jais2Layer(DecoderLayer):
    @classmethod
    def make_norm(cls, hf_config) -> nn.Module:
        return LayerNorm(hf_config.hidden_size, float(hf_config.layer_norm_eps))  # nn.LayerNorm, weight and bias


class Jais2ForCausalLM(LlamaForCausalLM):
    """Jais 2 (`Jais2ForCausalLM`: inceptionai's Jais-2): Llama's layers with LayerNorms (weight and bias), biases on
    q/k/v/o (`attention_bias`) and an ungated ReLU² MLP with biases (`mlp_bias`: down_proj(relu(up_proj(x))²)),
    transformers' NemotronMLP."""

    layer_class = Jais2Layer

    def build_mlp(self, layer_idx: int) -> nn.Module:
        return PlainMLP(self.config, ("up_proj", "down_proj"), "Jais2", ("relu2", "relu", "gelu"), "relu2",
                        bias=bool(getattr(self.config, "mlp_bias", True)))
