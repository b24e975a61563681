"""Megatron-style tensor-parallel layers: column/row-parallel linears, vocab-parallel embedding and lm_head.

Each layer captures the rank and world size of the `tensor_parallel(rank, size)` context active when it is
built (rank 0 of 1 outside any context, where every layer is exactly the single-device one and runs no
collective). Collectives use the default torch.distributed group, which `model_runner_v2/tp_workers.py` sets
up (gloo on CPU, NCCL on CUDA). Weight loading: each sharded Parameter carries `tp_dim` (the dim split across
ranks) and `tp_rank` / `tp_size`; `shard_for_rank(param, full_tensor)` cuts this rank's piece of a full HF tensor.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ...kernels.gemv import linear
from .layers import Embedding, Linear


@dataclass(frozen=True)
class ParallelState:
    rank: int = 0
    size: int = 1


_state = ParallelState()


@contextmanager
def tensor_parallel(rank: int, size: int) -> Iterator[None]:
    """Layers built inside shard themselves as `rank` of `size`."""
    global _state
    prev, _state = _state, ParallelState(rank, size)
    try:
        yield
    finally:
        _state = prev


def get_tp_state() -> ParallelState:
    return _state


def divide(n: int, size: int, what: str) -> int:
    if n % size:
        raise ValueError(f"{what}={n} is not divisible by tensor_parallel_size={size}")
    return n // size


def mark_sharded(param: nn.Parameter, dim: int, state: ParallelState, full_size: int, parts: list[int] | None = None,
          ) -> None:
    """`full_size`: the unsharded length of `dim`; `parts`: a fused layer's global part sizes along dim 0."""
    param.tp_dim, param.tp_rank, param.tp_size = dim, state.rank, state.size
    param.tp_full_size, param.tp_parts = full_size, parts


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The shape of `param` without tensor parallelism."""
    shape = list(param.shape)
    if getattr(param, "tp_size", 1) > 1:
        shape[param.tp_dim] = param.tp_full_size
    return tuple(shape)


def checkpoint_piece(param: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a checkpoint tensor bound for `param`: one that covers a whole fused parameter of
    several parts (transformers' stacked experts [E * 2I, H] for `gate_up_proj`) is cut part by part
    (full_to_local); a single part or an unfused tensor by shard_for_rank."""
    parts = getattr(param, "tp_parts", None) if getattr(param, "tp_size", 1) > 1 else None
    if parts is not None and len(parts) > 1 and tensor.shape[param.tp_dim] == param.tp_full_size:
        return full_to_local(param, tensor)
    return shard_for_rank(param, tensor)


def full_to_local(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of a full-shaped (fused) tensor: each fused part is split on its own, so dummy weights
    drawn in full shapes give every tensor-parallel layout the same model (loader.fill_dummy_weights)."""
    if getattr(param, "tp_size", 1) == 1:
        return full
    if param.tp_parts is None:
        return shard_for_rank(param, full)
    return torch.cat([shard_for_rank(param, part) for part in full.split(param.tp_parts, dim=0)], dim=0)


def shard_for_rank(param: torch.Tensor, loaded: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a full checkpoint tensor along `param.tp_dim`: equal pieces of ceil(n / size),
    the last zero-padded (only a vocabulary can be uneven). Unsharded params get `loaded` back."""
    size = getattr(param, "tp_size", 1)
    if size == 1:
        return loaded
    dim, rank = param.tp_dim, param.tp_rank
    n = loaded.shape[dim]
    if param.tp_parts is None and n != param.tp_full_size:  # (a fused part is checked by load_shard)
        raise ValueError(f"tensor of shape {tuple(loaded.shape)} does not match the unsharded size "
                         f"{param.tp_full_size} of dim {dim}")
    per = -(-n // size)
    start = min(rank * per, n)
    piece = loaded.narrow(dim, start, min(per, n - start))
    if piece.shape[dim] < per:  # pad rows: never looked up (ids < V), their logits are cut after the gather
        pad = list(piece.shape)
        pad[dim] = per - piece.shape[dim]
        piece = torch.cat([piece, piece.new_zeros(pad)], dim=dim)
    return piece


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(x)
    return x


def min_across_ranks(n: int, device: torch.device) -> int:
    """min of an int over the tensor-parallel group (e.g. KV blocks: each rank sizes its own memory).
    `device`: this rank's device (NCCL reduces CUDA tensors only)."""
    t = torch.tensor([n], dtype=torch.int64, device=device if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


class ColumnParallelLinear(Linear):
    """Output rows split across ranks: weight [out / tp, in]; each rank returns its slice of the output (no
    communication). A fused layer (qkv, gate_up) passes the global sizes of its parts, each split alike, so
    the local weight is [part0 / tp | part1 / tp | ...]."""

    def __init__(self, in_features: int, part_sizes: list[int], bias: bool = False):
        state = get_tp_state()
        self.part_sizes = [divide(p, state.size, "output size") for p in part_sizes]  # local sizes
        super().__init__(in_features, sum(self.part_sizes), bias=bias)
        for param in (self.weight, self.bias):
            if param is not None:
                mark_sharded(param, 0, state, sum(part_sizes), list(part_sizes))


class RowParallelLinear(Linear):
    """Input columns split across ranks: weight [out, in / tp]; partial outputs are all-reduced, then the
    (replicated) bias is added once. Quantization replaces the local matmul only (`quantize`)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        state = get_tp_state()
        self.tp_size = state.size
        super().__init__(divide(in_features, state.size, "input size"), out_features, bias=bias)
        mark_sharded(self.weight, 1, state, in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.matmul(x, self.weight, self.bias)
        y = all_reduce(linear(x, self.weight))
        return y if self.bias is None else y + self.bias

    def silu_mul_matmul(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """Linear's fused SiluAndMul + GEMV on one rank; None under tensor parallelism (the all-reduce follows)."""
        return super().silu_mul_matmul(gate_up) if self.tp_size == 1 else None

    def quantize(self, cls: type[nn.Module]) -> nn.Module:
        """The quantized module `cls.from_linear` of this rank's shard (its own per-row scales over the local
        columns), wrapped so the all-reduce and the bias still follow it."""
        if self.tp_size == 1:
            return cls.from_linear(self)
        return _ReducedLinear(cls.from_linear(_WeightOnly(self.weight)), self.bias)


class _WeightOnly(nn.Module):
    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight, self.bias = weight, None


class _ReducedLinear(nn.Module):
    """A quantized row-parallel shard: all_reduce(inner(x)) + bias."""

    def __init__(self, inner: nn.Module, bias: torch.Tensor | None):
        super().__init__()
        self.inner = inner
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce(self.inner(x))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(Embedding):
    """Each rank holds rows [rank * Vp, (rank + 1) * Vp) of the table, Vp = ceil(V / tp) (the last piece
    zero-padded); ids outside the slice look up zeros, and the all-reduce sums the one non-zero row."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        state = get_tp_state()
        self.tp_size = state.size
        self.per_rank = -(-num_embeddings // state.size)
        self.vocab_start = state.rank * self.per_rank
        super().__init__(self.per_rank, embedding_dim)
        mark_sharded(self.weight, 0, state, num_embeddings)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.per_rank)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, H]
        return all_reduce(x.masked_fill(outside[:, None], 0))


class ParallelLMHead(Linear):
    """lm_head over the same vocab partition as VocabParallelEmbedding (so tying shares the local table):
    each rank computes its [N, Vp] slice of the logits; all-gather + cut to V gives every rank the full [N, V]."""

    def __init__(self, hidden_size: int, vocab_size: int, bias: bool = False):
        state = get_tp_state()
        self.tp_size = state.size
        self.vocab_size = vocab_size
        super().__init__(hidden_size, -(-vocab_size // state.size), bias)
        mark_sharded(self.weight, 0, state, vocab_size)
        if self.bias is not None:
            mark_sharded(self.bias, 0, state, vocab_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.matmul(hidden, self.weight, self.bias)  # [N, Vp]
        if self.tp_size == 1:
            return logits
        pieces = [torch.empty_like(logits) for _ in range(self.tp_size)]
        dist.all_gather(pieces, logits.contiguous())
        return torch.cat(pieces, dim=-1)[:, : self.vocab_size]  # [N, V]


def embedding(num_embeddings: int, embedding_dim: int) -> Embedding:
    """The token embedding: vocab-parallel under tensor parallelism, the plain layer otherwise."""
    if get_tp_state().size == 1:
        return Embedding(num_embeddings, embedding_dim)
    return VocabParallelEmbedding(num_embeddings, embedding_dim)


def lm_head(hidden_size: int, vocab_size: int, bias: bool = False) -> Linear:
    """The LM head: vocab-parallel (gathering full logits) under tensor parallelism, the plain Linear otherwise;
    `bias`: a bias per vocabulary entry (Phi-2's)."""
    if get_tp_state().size == 1:
        return Linear(hidden_size, vocab_size, bias)
    return ParallelLMHead(hidden_size, vocab_size, bias)


def attach_lm_head(lm: nn.Module, hf_config, tie_default: bool = False, bias: bool = False) -> None:
    """`lm.lm_head` (lm_head above) and `lm.tie_word_embeddings` (config.json's, else `tie_default`: transformers'
    default for that model class); tied: one Parameter with `lm.model.embed_tokens.weight`, listed once."""
    lm.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", tie_default))
    lm.lm_head = lm_head(hf_config.hidden_size, hf_config.vocab_size, bias)
    if lm.tie_word_embeddings:
        lm.lm_head.weight = lm.model.embed_tokens.weight
