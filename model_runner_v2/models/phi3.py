"""Phi-3 causal LM (`Phi3ForCausalLM`: Phi-3, Phi-3.5-mini, Phi-4, Phi-4-mini): Llama's layers; its checkpoints
store the q/k/v and gate/up projections already fused."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .llama import LlamaForCausalLM

# checkpoint name of a fused projection -> the names of its parts, in row order
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class Phi3ForCausalLM(LlamaForCausalLM):
    """No biases, a rotary over all or part of each head (Phi-4-mini: partial_rotary_factor 0.75) with default or
    `longrope` frequencies (Phi-3.5 / Phi-4-mini: rope_settings.py), and a `sliding_window` that caps
    max_model_len as Mistral's does (model_config). `self_attn.qkv_proj.weight` [(Hq + 2 Hkv) D, H] and
    `mlp.gate_up_proj.weight` [2 I, H] are split into the q/k/v and gate/up tensors the other architectures'
    checkpoints hold, so each part takes the same way into the model's own fused parameters (its rank's rows of
    each part under tensor parallelism)."""

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        return split_fused_parts(self.config, name, tensor)


def split_fused_parts(cfg, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint tensor of a fused `qkv_proj` / `gate_up_proj` (Phi-3's; GLM's gate_up_proj) -> its parts'
    names and row blocks; any other tensor as it is. A fused tensor whose rows the config does not imply is a
    ValueError naming both."""
    prefix, _, rest = name.rpartition(".")
    owner, _, fused = prefix.rpartition(".")
    parts = _FUSED.get(fused)
    if parts is None:
        yield name, tensor
        return
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv = (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads) * head_dim
    sizes = ([cfg.num_attention_heads * head_dim, kv, kv] if fused == "qkv_proj"
             else [cfg.intermediate_size] * 2)
    if tensor.shape[0] != sum(sizes):
        raise ValueError(f"checkpoint tensor {name!r} has {tensor.shape[0]} rows, the config implies "
                         f"{' + '.join(map(str, sizes))} = {sum(sizes)}")
    for part, piece in zip(parts, torch.split(tensor, sizes, dim=0)):
        yield f"{owner}.{part}.{rest}", piece
