"""PlainMLP: the ungated MLP (up projection, GELU, ReLU or ReLU², down projection, each with an optional bias) of
GPT-NeoX, StarCoder2, Phi, GPT-2, OPT, Nemotron, Arcee and BLOOM, under each architecture's own names for its two
projections (so checkpoints load as named)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .parallel import ColumnParallelLinear, RowParallelLinear


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """transformers' NewGELUActivation op for op (each op rounds in x's dtype): 0.5 x (1 + tanh(sqrt(2/pi)
    (x + 0.044715 x^3)))."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def bloom_gelu(x: torch.Tensor) -> torch.Tensor:
    """transformers' bloom_gelu_forward op for op (each op rounds in x's dtype)."""
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


# hidden_act -> the activation, as transformers computes it (F.gelu exact / tanh: its own ops; gelu_new: Phi's)
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": lambda x: F.gelu(x, approximate="none"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": gelu_new,
    "relu": F.relu,  # OPT's
    "relu2": lambda x: torch.square(F.relu(x)),  # Nemotron's and Arcee's ReLUSquaredActivation (two roundings)
    "bloom_gelu": bloom_gelu,  # BLOOM's (its configs name no activation)
}


class PlainMLP(nn.Module):
    """x [T, H] (normed) -> down(act(up(x))) [T, H]. `names`: the (up, down) attribute names, as the architecture's
    checkpoints call them; `supported`: the hidden_act values this architecture takes (another is a ValueError
    naming `arch`); `default_act`: the one when the config names none."""

    def __init__(self, hf_config, names: tuple[str, str], arch: str, supported: tuple[str, ...], default_act: str,
                 bias: bool = True, act_key: str = "hidden_act", intermediate_size: int | None = None):
        """act_key: the config key naming the activation (GPT-2's `activation_function`); intermediate_size: the
        width when the config's `intermediate_size` does not say it (GPT-2's `n_inner`, null: 4 x hidden)."""
        super().__init__()
        act = getattr(hf_config, act_key, None) or default_act
        if act not in supported:
            raise ValueError(f"{act_key} {act!r} is not supported for {arch} (supported: {', '.join(supported)})")
        self.act = ACTIVATIONS[act]
        self.up_name, self.down_name = names
        inter = hf_config.intermediate_size if intermediate_size is None else intermediate_size
        setattr(self, self.up_name, ColumnParallelLinear(hf_config.hidden_size, [inter], bias=bias))
        setattr(self, self.down_name, RowParallelLinear(inter, hf_config.hidden_size, bias=bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.down_name)(self.act(getattr(self, self.up_name)(x)))
