"""RecurrentLayer: what Gated DeltaNet (gated_deltanet.py), Mamba-2 (mamba2.py) and LFM2's short convolution
(lfm2.py) layers share: the state tensors the runner binds (model_runner_v2/recurrent_state.py: the convolution
history [slots, K - 1, C], and where the layer has one, `has_state`, the recurrent state [slots, heads, *, *] fp32),
and the step's view of them (each row's slot and first position; the causal convolution over each request's inputs,
kernels/gated_delta.conv_windows)."""

from __future__ import annotations

import torch
from torch import nn

from ...kernels.gated_delta import conv_windows
from ..forward_context import AttentionMetadata, get_forward_context


class RecurrentLayer(nn.Module):
    batch_invariant = False  # layers.set_batch_invariant: the activations from torch.exp (kernels/activation.py)
    has_state = True  # a recurrent state beside the convolution history (LFM2's short convolution: none)

    def __init__(self):
        super().__init__()
        self.conv_state: torch.Tensor | None = None  # [slots, K - 1, conv channels], the model's dtype
        self.state: torch.Tensor | None = None  # [slots, heads, *, *] fp32

    def bind_state(self, conv_state: torch.Tensor, state: torch.Tensor | None) -> None:
        self.conv_state, self.state = conv_state, state

    def step(self) -> tuple[AttentionMetadata, torch.Tensor]:
        """The step's metadata and each row's first position in it, [B] (0: the row starts from a fresh state)."""
        md = get_forward_context().attn_metadata
        if md.req_slots is None or self.conv_state is None:
            raise RuntimeError(f"a {type(self).__name__} layer needs the step's request slots and its bound state")
        return md, md.seq_lens - (md.query_start_loc[1:] - md.query_start_loc[:-1])

    def conv(self, x: torch.Tensor, md: AttentionMetadata, pos_start: torch.Tensor, weight: torch.Tensor,
             bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, C] -> the causal convolution over each request's inputs [T, C] (no activation); the rows' new
        histories written to their slots."""
        return conv_windows(x, self.conv_state, md.req_slots, md.token_req_idx, md.positions, pos_start,
                            md.query_start_loc, md.seq_lens, weight, bias)
