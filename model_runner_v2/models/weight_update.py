"""In-place weight updates from HF-named tensors (LLM.load_weights): all checked, then all copied.

A trainer hands the engine its new weights every RL step. They go into the engine's existing parameters with
`copy_` (same storage, same addresses), so CUDA graphs captured at start-up stay valid and nothing is
reallocated. Any subset of the model's tensors may be given (a partial update); an unknown name or a shape
that does not fit is a ValueError naming the tensor, raised before anything is copied, so a bad update leaves
the engine as it was. Under tensor parallelism each rank keeps its own slice (models/parallel.py).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from .parallel import checkpoint_piece, full_shape

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Copy:
    param: nn.Parameter
    offset: int  # first row of the parameter written (a fused qkv / gate_up part)
    rows: int
    tensor: torch.Tensor  # this rank's piece, still in the caller's dtype and device
    source: int  # which of the caller's (name, tensor) pairs it came from (applied_count)


def flatten_experts(tensor: torch.Tensor) -> torch.Tensor:
    """A stacked experts tensor [E, rows, cols] (transformers >= 5 keeps experts so in memory) as the flat
    [E * rows, cols] parameter that holds it (moe.py: expert e's rows follow expert e - 1's); others unchanged."""
    return tensor.reshape(-1, tensor.shape[-1]) if tensor.dim() == 3 else tensor


def named_tensors(weights) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs from an nn.Module (its state_dict), a mapping name -> tensor, or an iterable of
    pairs. ValueError for anything else."""
    if isinstance(weights, nn.Module):
        weights = weights.state_dict()
    if isinstance(weights, (str, bytes)) or not isinstance(weights, (Mapping, Iterable)):
        raise ValueError(f"weights must be an nn.Module, a state dict or (name, tensor) pairs, got "
                         f"{type(weights).__name__}")
    items = weights.items() if isinstance(weights, Mapping) else weights
    for i, item in enumerate(items):
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)):
            raise ValueError(f"weights[{i}] must be a (name, tensor) pair, got {type(item).__name__}")
        if not isinstance(item[1], torch.Tensor):  # a numpy array, a list: the caller converts (no silent copy)
            raise ValueError(f"weight {item[0]!r} must be a torch.Tensor, got {type(item[1]).__name__}")
        yield item[0], item[1]


def plan_update(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> list[_Copy]:
    """Check every tensor against `model` (a DecoderLM): its parameter and, for this rank's piece, the shape.
    Raises ValueError naming the first tensor that does not fit; copies nothing."""
    params = dict(model.named_parameters())
    shards = model._fused_shards()
    plan, head_skipped = [], False
    for source, name, tensor in ((i, *part) for i, pair in enumerate(weights)
                                 for part in model.checkpoint_parts(*pair)):
        found = model.weight_target(name, params, shards)
        if found is None:
            head_skipped |= name == "lm_head.weight"  # vLLM skips it too (a tied head is the embedding)
            continue
        target, offset, rows = found
        param = params[target]
        try:
            piece = checkpoint_piece(param, flatten_experts(tensor.detach()))  # stacked experts: flat rows
        except ValueError as e:
            raise ValueError(f"weight {name!r}: {e}") from None
        if piece.dim() == 0 or piece.shape[0] != rows or tuple(piece.shape[1:]) != tuple(param.shape[1:]):
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, which does not fit the model's "
                             f"{target!r} ({_expected(param, rows)})")
        if not tensor.is_floating_point():
            raise ValueError(f"weight {name!r} must be a floating-point tensor, got {tensor.dtype}")
        plan.append(_Copy(param, offset, rows, piece, source))
    embed = params.get("model.embed_tokens.weight")
    if head_skipped and not any(c.param is embed for c in plan):  # a head-only update would silently do nothing
        logger.warning("load_weights: 'lm_head.weight' skipped: this model ties its head to "
                       "'model.embed_tokens.weight' (update that tensor)")
    return plan


def applied_count(plan: list[_Copy]) -> int:
    """How many of the caller's tensors the plan writes (a tied head or a rotary cache it skips is not one)."""
    return len({c.source for c in plan})


def _expected(param: nn.Parameter, rows: int) -> str:
    if getattr(param, "tp_size", 1) == 1:
        return f"needs {(rows, *param.shape[1:])}"
    return f"full shape {full_shape(param)}, this rank's rows {rows}"


@torch.no_grad()
def apply_update(model: nn.Module, plan: list[_Copy]) -> None:
    """Copy a checked plan into the parameters (cast to their dtype and device in the copy), then refresh what is
    derived from them: an fp32 head's copy of a tied embedding (DecoderLM.enable_fp32_lm_head)."""
    for c in plan:
        c.param.data.narrow(0, c.offset, c.rows).copy_(c.tensor, non_blocking=True)
    head, embed = model.lm_head.weight, model.model.embed_tokens.weight
    if model.tie_word_embeddings and head is not embed and any(c.param is embed for c in plan):
        head.data.copy_(embed)  # the fp32 head of a tied bf16 model: its own fp32 copy of the embedding
