"""Hyper-connections (DeepSeek-V4's family; HY-V4's "iHC" form): the residual stream widened to `hc_mult` (N)
streams [T, N, H]. Before a block (attention or MLP) the streams are collapsed into its input by per-token weights
`pre` [T, N]; after it the block's output is spread back over them by `post` [T, N] and added:

    flat = streams [T, N * H] (fp32);  mixes = (flat @ fn^T) * rsqrt(mean(flat^2) + eps)   [T, 2N]
    pre  = sigmoid(mixes[:, :N] * scale[0] + base[:N]) + hc_eps
    post = magnitude * sigmoid(mixes[:, N:] * scale[1] + base[N:]) + hc_eps
    block input = sum_n pre[:, n] * streams[:, n]                                          [T, H]
    streams'    = post[:, :, None] * block(block input)[:, None, :] + streams              [T, N, H]

and at the top HyperHead collapses the streams once more (its own fn / base / scale, no post) before the final
norm. As transformers' HYV4HyperConnection / HYV4HyperHead compute them: every step in fp32 whatever the model dtype
(the parameters kept in fp32, the streams upcast), the block input and the new streams rounded once to the model
dtype. DeepSeek-V4's form adds a third output, an N x N stream mix made doubly stochastic by Sinkhorn iterations;
it is a subclass's to add (this module holds what both share).

Tensor parallelism: every rank holds every stream whole (the blocks' outputs are all-reduced before the add), so the
parameters are replicated and each rank computes the same weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels.activation import sigmoid
from ...kernels.batch_invariant_matmul import batch_invariant_linear


def inverse_rms(flat: torch.Tensor, eps: float) -> torch.Tensor:
    """[T, D] fp32 -> rsqrt(mean(x^2) + eps) [T, 1]: the parameter-free norm, applied to the mixes (linear in flat)
    rather than to flat itself (transformers' UnweightedRMSNorm returns this factor)."""
    return torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)


class _StreamMixer(nn.Module):
    """What HyperConnection and HyperHead share: the fp32 projection of the flattened streams, normed."""

    batch_invariant = False  # layers.set_batch_invariant: the row-invariant matmul and sigmoid

    def __init__(self, streams: int, norm_eps: float, hc_eps: float):
        super().__init__()
        if streams < 1:
            raise ValueError(f"hyper-connections need hc_mult >= 1 streams, got {streams}")
        self.streams, self.norm_eps, self.hc_eps = streams, norm_eps, hc_eps

    def mixes(self, streams: torch.Tensor, fn: torch.Tensor) -> torch.Tensor:
        """streams [T, N, H] -> (flat @ fn^T) * inverse_rms(flat) [T, rows of fn], fp32."""
        flat = streams.flatten(1).float()  # [T, N * H]
        proj = batch_invariant_linear(flat, fn, None) if self.batch_invariant else F.linear(flat, fn)
        return proj * inverse_rms(flat, self.norm_eps)

    def gate(self, logits: torch.Tensor) -> torch.Tensor:  # fp32 [T, N] -> sigmoid, fp32
        return sigmoid(logits, self.batch_invariant)

    @staticmethod
    def collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """streams [T, N, H], pre [T, N] fp32 -> sum_n pre * stream in fp32, rounded once to streams' dtype [T, H]."""
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


class HyperConnection(_StreamMixer):
    """One block's hyper-connection (`attn_hc` / `ffn_hc`): fn [2N, N * H], base [2N], scale [2], all fp32 (named as
    transformers names them). `post_magnitude`: post's sigmoid scale (HY-V4's `hc_magnitude`; 2 in DeepSeek-V4)."""

    def __init__(self, hidden_size: int, streams: int, norm_eps: float, hc_eps: float, post_magnitude: float):
        super().__init__(streams, norm_eps, hc_eps)
        self.post_magnitude = post_magnitude
        rows = 2 * streams  # pre | post
        self.fn = nn.Parameter(torch.empty(rows, streams * hidden_size, dtype=torch.float32), requires_grad=False)
        self.base = nn.Parameter(torch.empty(rows, dtype=torch.float32), requires_grad=False)
        self.scale = nn.Parameter(torch.empty(2, dtype=torch.float32), requires_grad=False)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """streams [T, N, H] -> (the block's input [T, H] in streams' dtype, post [T, N] fp32 for `expand`)."""
        n = self.streams
        pre_logits, post_logits = self.mixes(streams, self.fn).split(n, dim=-1)  # [T, N] each
        pre = self.gate(pre_logits * self.scale[0] + self.base[:n]) + self.hc_eps
        post = self.post_magnitude * self.gate(post_logits * self.scale[1] + self.base[n:]) + self.hc_eps
        return self.collapse(streams, pre), post

    @staticmethod
    def expand(streams: torch.Tensor, post: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The residual add: post [T, N] fp32 times the block's output out [T, H], plus streams [T, N, H], in fp32
        and rounded once to streams' dtype -> the new streams [T, N, H]."""
        return (post.unsqueeze(-1) * out.float().unsqueeze(1) + streams.float()).to(streams.dtype)


class HyperHead(_StreamMixer):
    """The final collapse (`model.hc_head`): hc_fn [N, N * H], hc_base [N], hc_scale [1], fp32; streams [T, N, H] ->
    [T, H] in streams' dtype, weighted by sigmoid(mixes * hc_scale + hc_base) + hc_eps."""

    def __init__(self, hidden_size: int, streams: int, norm_eps: float, hc_eps: float):
        super().__init__(streams, norm_eps, hc_eps)
        self.hc_fn = nn.Parameter(torch.empty(streams, streams * hidden_size, dtype=torch.float32),
                                  requires_grad=False)
        self.hc_base = nn.Parameter(torch.empty(streams, dtype=torch.float32), requires_grad=False)
        self.hc_scale = nn.Parameter(torch.empty(1, dtype=torch.float32), requires_grad=False)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        pre = self.gate(self.mixes(streams, self.hc_fn) * self.hc_scale + self.hc_base) + self.hc_eps
        return self.collapse(streams, pre)
