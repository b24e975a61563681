"""GPT-J (`GPTJForCausalLM`: EleutherAI's GPT-J-6B and the models trained with its code), as transformers computes
it: Phi-2's parallel layer (models/phi.py: one LayerNorm whose output both attention and the MLP read, HF's
`attn + mlp + residual`), q/k/v and the output projection without biases, a rotary over the first `rotary_dim`
elements of each head in interleaved pairs (2i, 2i + 1: `rotate_every_two`) from tables cast to the model dtype, op
by op (transformers' GPT-J casts its sin/cos to q's dtype; CodeGen's stay fp32: below), the plain MLP (`fc_in`,
`activation_function` gelu_new, `fc_out`, with biases, width `n_inner` or 4 x hidden), a final LayerNorm (`ln_f`)
and an untied LM head with a bias.

Checkpoints: `transformer.` names (wte, h.N.ln_1, h.N.attn.{q,k,v,out}_proj, h.N.mlp.fc_in / fc_out, ln_f) renamed
to the decoder's; the attention-mask and sin/cos buffers of older files (`attn.bias`, `attn.masked_bias`,
`rotary_emb.embed_positions`) are not weights."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator

import torch
from torch import nn

from .decoder import DecoderSpec, rename_first
from .phi import PhiForCausalLM
from .plain_mlp import PlainMLP

_IGNORED = re.compile(r"^(transformer\.)?(h\.\d+\.attn\.(bias|masked_bias)|rotary_emb\.embed_positions)$")
_RENAMES = ((re.compile(r"^transformer\.wte\."), "model.embed_tokens."),
            (re.compile(r"^transformer\.ln_f\."), "model.norm."),
            (re.compile(r"^transformer\.h\.(\d+)\.ln_1\."), r"model.layers.\1.input_layernorm."),
            (re.compile(r"^transformer\.h\.(\d+)\.attn\.out_proj\."), r"model.layers.\1.self_attn.o_proj."),
            (re.compile(r"^transformer\.h\.(\d+)\.attn\."), r"model.layers.\1.self_attn."),
            (re.compile(r"^transformer\.h\.(\d+)\.mlp\."), r"model.layers.\1.mlp."))


class GPTJForCausalLM(PhiForCausalLM):
    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        head_dim = hf_config.hidden_size // hf_config.num_attention_heads
        rotary_dim = getattr(hf_config, "rotary_dim", None)
        if rotary_dim is None:  # transformers then builds tables over hidden_size, not a head: no model to match
            raise ValueError("GPT-J with rotary_dim null is not supported (every released config names it)")
        if not 2 <= rotary_dim <= head_dim or rotary_dim % 2:
            raise ValueError(f"GPT-J's rotary_dim={rotary_dim} must be even and within a head of {head_dim}")
        return DecoderSpec(qkv_bias=False, o_bias=False, mlp_bias=True, qk_norm=False, rope_interleaved=True,
                           rotary_dim=int(rotary_dim))

    def build_mlp(self, layer_idx: int) -> nn.Module:
        inner = getattr(self.config, "n_inner", None) or 4 * self.config.hidden_size
        return PlainMLP(self.config, ("fc_in", "fc_out"), "GPT-J", ("gelu_new",), "gelu_new",
                        act_key="activation_function", intermediate_size=inner)

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        if not _IGNORED.match(name):
            yield rename_first(name, _RENAMES), tensor


_MP_SHARDS = 4  # CodeGen's fused qkv_proj: trained on 4 TPU shards, each [q | v | k] of hidden / 4 rows


class CodeGenForCausalLM(GPTJForCausalLM):
    """Salesforce's CodeGen (`CodeGenForCausalLM`: codegen-350M ... 16B, nl / multi / mono): GPT-J itself (transformers
    builds it from GPT-J's blocks), its q, k and v stored as one `qkv_proj` [3 x hidden, hidden] in 4 shards of
    [q | v | k] (v before k), split here into GPT-J's projections; the `causal_mask` buffers are not weights. Its
    sin/cos stay fp32 (not cast as GPT-J's): the rotation in fp32, rounded once."""

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        return dataclasses.replace(super().spec(hf_config), rope_fp32=True, rope_fp32_tables=True)

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        if name.endswith(".attn.causal_mask"):
            return
        if name.endswith(".attn.qkv_proj.weight"):
            hidden = tensor.shape[1]
            if hidden % _MP_SHARDS or tensor.shape[0] != 3 * hidden:
                raise ValueError(f"tensor {name!r} of shape {tuple(tensor.shape)}: CodeGen's qkv_proj is [3 x hidden, "
                                 f"hidden] with hidden divisible by {_MP_SHARDS}")
            shards = tensor.view(_MP_SHARDS, 3, hidden // _MP_SHARDS, hidden)  # [shard, (q, v, k), rows, hidden]
            prefix = name[: -len("qkv_proj.weight")]
            for proj, part in (("q_proj", 0), ("v_proj", 1), ("k_proj", 2)):
                yield from super().checkpoint_parts(f"{prefix}{proj}.weight", shards[:, part].reshape(hidden, hidden))
            return
        yield from super().checkpoint_parts(name, tensor)
