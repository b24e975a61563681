"""SleepMode: where an engine built with `enable_sleep_mode` keeps its weights and KV cache, and how they sleep.

Three regions (device_region.py), each one contiguous buffer whose memory can go back to the device:
- parameters: every nn.Parameter of the model. Sleep level 1 copies them to pinned host memory first; level 2
  discards them (the caller brings new ones with load_weights after wake_up).
- buffers: the model's other tensors (rotary cos/sin tables, quantized weights and scales): always copied out,
  they do not come from a checkpoint that load_weights could replay.
- KV cache: discarded at both levels (its blocks belong to no request while the engine is idle); zero-filled on
  wake-up.
The tensors keep their addresses through a sleep, so the CUDA graphs captured at start-up replay unchanged
after wake_up (nothing is re-captured, nothing is re-compiled).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from .device_region import MemoryRegion, aligned, make_region

logger = logging.getLogger(__name__)
TAGS = ("weights", "kv_cache")  # vLLM's wake_up(tags=...) names


class SleepMode:
    def __init__(self, model: nn.Module, device: torch.device):
        self.device = device
        params = _unique(p for _, p in model.named_parameters())
        self.params = _relocate(params, device)
        buffers = [(m, name, b) for m in model.modules() for name, b in m._buffers.items() if b is not None]
        self.buffers = _relocate_buffers(buffers, device)
        self.kv: MemoryRegion | None = None
        self.level = 0  # the latest sleep's level (0: never slept)
        self.weights_lost = False  # woken after level 2: the parameters hold zeros until load_weights

    def allocate_kv(self, specs: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
        """Zero-filled tensors of these (shape, dtype) in one region: each layer's [2, blocks, block_size, Hkv, D]
        KV cache, then a hybrid model's recurrent state (recurrent_state.py; it sleeps as the cache does)."""
        offsets, total = [], 0
        for shape, dtype in specs:
            offsets.append(total)
            total += aligned(_nbytes(shape, dtype))
        self.kv = make_region(total, self.device)
        return [self.kv.view(off, dtype, shape) for off, (shape, dtype) in zip(offsets, specs)]

    @property
    def asleep(self) -> set[str]:
        tags = set()
        if self.params.released:
            tags.add("weights")
        if self.kv is not None and self.kv.released:
            tags.add("kv_cache")
        return tags

    def sleep(self, level: int) -> None:
        """Give the device memory back (the caller made sure no step is running)."""
        self.level = level
        self.buffers.release(keep=True)
        self.params.release(keep=level == 1)
        if level == 2:
            self.params.drop_host_copy()  # a level-1 sleep earlier may have left one
        if self.kv is not None:
            self.kv.release(keep=False)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # what the caching allocator holds unused (activations of eager steps)

    def wake_up(self, tags: Iterable[str]) -> None:
        tags = set(tags)
        if self.device.type == "cuda":
            # A colocated trainer's freed activations sit in torch's cache, unusable for the driver's pages.
            torch.cuda.empty_cache()
        if "weights" in tags:
            self.buffers.restore()
            if self.params.released:
                self.weights_lost = not self.params.restore()
                if self.weights_lost:  # vLLM's contract too, but a plain wake_up then serves a zero model quietly
                    logger.warning("woken after a level-2 sleep: the weights are zeros until new ones are loaded "
                                   "(load_weights, /update_weights_from_disk); requests before that get noise")
        if "kv_cache" in tags and self.kv is not None:
            self.kv.restore()

    def free(self) -> None:
        for region in (self.params, self.buffers, self.kv):
            if region is not None:
                region.free()


def _unique(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    seen, out = set(), []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    numel = 1
    for s in shape:
        numel *= s
    return numel * torch.empty(0, dtype=dtype).element_size()


def _layout(tensors: list[torch.Tensor], device: torch.device) -> tuple[MemoryRegion, list[torch.Tensor]]:
    """One region holding a contiguous copy of each tensor; the copies, in order."""
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += aligned(_nbytes(tuple(t.shape), t.dtype))
    region = make_region(total, device)
    views = []
    with torch.no_grad():
        for t, off in zip(tensors, offsets):
            v = region.view(off, t.dtype, tuple(t.shape))
            v.copy_(t)
            views.append(v)
    return region, views


def _relocate(params: list[nn.Parameter], device: torch.device) -> MemoryRegion:
    """Move every parameter's data into one region (same Parameter objects: the model and the optimizer-free
    load_weights path keep their references)."""
    region, views = _layout([p.data for p in params], device)
    for p, v in zip(params, views):
        p.data = v
    return region


def _relocate_buffers(buffers: list[tuple[nn.Module, str, torch.Tensor]], device: torch.device) -> MemoryRegion:
    """Move the modules' buffers into one region; a buffer registered in several modules stays shared."""
    unique = _unique(b for _, _, b in buffers)
    region, views = _layout(unique, device)
    moved = {id(b): v for b, v in zip(unique, views)}
    for module, name, b in buffers:
        module._buffers[name] = moved[id(b)]
    return region
