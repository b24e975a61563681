"""Attention-free Mamba models, as transformers computes them: `MambaForCausalLM` (state-spaces' mamba-130m ...
2.8b), `FalconMambaForCausalLM` (falcon-mamba-7b: weightless dt / B / C norms), both of Mamba-1 mixers (mamba1.py),
and `Mamba2ForCausalLM` (Mamba-Codestral: Mamba-2 mixers, mamba2.py). Every layer: one RMSNorm, the mixer, a residual
add; the residual stream kept in fp32 where `residual_in_fp32` (the default: each norm reads it cast to the model
dtype, the final norm reads it as it is); the final `norm_f`, the (tied) head. No attention layer and so no KV cache:
each request's state lives in its slot (docs/hybrid_models.md); the blocks the scheduler hands out cost no memory.

Checkpoints and transformers' modules name the model `backbone` (`embeddings`, `layers.N.norm`, `layers.N.mixer.*`,
`norm_f`): read as the engine's `model` (`embed_tokens`, `input_layernorm`, `mamba`, `norm`)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from .decoder import BIASLESS, DecoderLM, DecoderSpec, norm_eps
from .layers import RMSNorm
from .mamba1 import Mamba1Mixer
from .mamba2 import Mamba2Mixer
from .parallel import attach_lm_head, embedding

_NAMES = {"model.embeddings.weight": "model.embed_tokens.weight", "model.norm_f.weight": "model.norm.weight"}


class MambaLayer(nn.Module):
    def __init__(self, hf_config, mixer: nn.Module):
        super().__init__()
        self.input_layernorm = RMSNorm(hf_config.hidden_size, norm_eps(hf_config))
        self.mamba = mixer
        self.fp32_residual = bool(getattr(hf_config, "residual_in_fp32", True))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous mixer's output (the embeddings first), residual: the stream before it (None first) ->
        (this mixer's output, the stream it is added to)."""
        stream = x if residual is None else residual + x  # fp32 + the model dtype: fp32 where the stream is
        if self.fp32_residual:
            stream = stream.float()
        return self.mamba(self.input_layernorm(stream.to(x.dtype))), stream


class MambaModel(nn.Module):
    def __init__(self, hf_config, mixer_class: type[nn.Module]):
        super().__init__()
        self.embed_tokens = embedding(hf_config.vocab_size, hf_config.hidden_size)
        self.layers = nn.ModuleList(MambaLayer(hf_config, mixer_class(hf_config))
                                    for _ in range(hf_config.num_hidden_layers))
        self.norm = RMSNorm(hf_config.hidden_size, norm_eps(hf_config))
        self.fp32_final_norm = False  # DecoderLM.enable_fp32_lm_head: the output is then fp32

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, H]
        dtype, residual = x.dtype, None
        for layer in self.layers:
            x, residual = layer(x, residual)
        stream = residual + x
        if self.fp32_final_norm:
            return self.norm.add_and_norm_fp32(stream, torch.zeros_like(stream))
        return self.norm(stream).to(dtype)  # transformers: norm_f over the (fp32) stream, cast for the head


class MambaForCausalLM(DecoderLM):
    mixer_class: type[nn.Module] = Mamba1Mixer

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        return BIASLESS

    def __init__(self, hf_config):
        nn.Module.__init__(self)
        self.config = hf_config
        self.model = MambaModel(hf_config, self.mixer_class)
        attach_lm_head(self, hf_config, tie_default=True)

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        if name.startswith("backbone."):
            name = "model." + name[len("backbone."):]
        name = _NAMES.get(name, name)
        parts = name.split(".")
        if len(parts) > 4 and parts[:2] == ["model", "layers"]:
            parts[3] = {"norm": "input_layernorm", "mixer": "mamba"}.get(parts[3], parts[3])
        return ((".".join(parts), tensor),)


class FalconMambaForCausalLM(MambaForCausalLM):
    pass  # Mamba1Settings reads its weightless dt / B / C norms from the config's model_type


class Mamba2ForCausalLM(MambaForCausalLM):
    mixer_class = Mamba2Mixer
