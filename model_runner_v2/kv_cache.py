"""KV cache sizing (from a memory budget) and allocation: one [2, num_blocks, block_size, Hkv, D] per layer with a
KV cache (a hybrid model's linear-attention layers have none), in EngineConfig.kv_cache_torch_dtype (the model's
dtype, or fp8)."""

from __future__ import annotations

import logging

import torch

from ..config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from ..model_config import mlp_width
from .models.parallel import min_across_ranks
from .recurrent_state import state_bytes

logger = logging.getLogger(__name__)

# GPU memory kept free for activations, logits and the sampler's [R, V] temporaries: at least this much, more
# when a step can score many positions (activation_reserve_bytes).
_GPU_ACTIVATION_RESERVE = 2 << 30


def activation_reserve_bytes(config: EngineConfig) -> int:
    """GPU memory the KV cache leaves free. A step computes logits [R, V] for its scored positions: R is one per
    row (max_num_seqs), or up to the whole token budget (max_num_batched_tokens) when fast replay or speculative
    decoding score several positions a row. Those logits (fp32 with enable_fp32_lm_head or an fp32 model) plus
    the larger of 1 GiB and one layer's temporaries for a whole budget of tokens (a step above the piecewise
    graphs' sizes runs eagerly: `layer_temporaries_per_token`), never less than 2 GiB (e.g. 8,192 x 151,936 bf16
    logits: 2.3 GiB + 1 GiB)."""
    mc = config.model_config
    many = config.enable_trace_replay or config.speculative_config is not None
    rows = max(config.max_num_batched_tokens, config.max_num_seqs) if many else config.max_num_seqs
    elem = 4 if config.enable_fp32_lm_head else mc.dtype.itemsize
    eager = max(1 << 30, config.max_num_batched_tokens * layer_temporaries_per_token(config))
    return max(_GPU_ACTIVATION_RESERVE, rows * mc.vocab_size * elem + eager) + piecewise_graph_bytes(config)


def layer_temporaries_per_token(config: EngineConfig) -> int:
    """Bytes a token's temporaries in one layer take at most: norm outputs and residuals, qkv, rotated q/k,
    gate|up, SiLU, down: under 8 H + 3 I + 2 qkv elements, counted at 4 bytes (fp32 head outputs, bf16 with
    slack). Qwen3-0.6B: 102 KB, so a 16,384-token eager step ~1.7 GB; an 8B shape ~5.8 GB."""
    mc = config.model_config
    hf = mc.hf_config
    shapes = getattr(mc, "kv_layer_shapes", None) or [(mc.num_kv_heads, mc.head_dim)]  # Gemma 4's differ
    qkv = max((mc.num_heads + 2 * kv_heads) * head_dim for kv_heads, head_dim in shapes)
    return (8 * hf.hidden_size + 3 * mlp_width(hf) + 2 * qkv) * 4


def piecewise_graph_bytes(config: EngineConfig) -> int:
    """Bound on the piecewise CUDA graphs' memory (model_runner_v2/piecewise_graph.py): their private pool holds
    one layer's temporaries at the largest size (`layer_temporaries_per_token`) plus the static buffers; 0 when
    they are off. Kept apart from the eager reserve: the pool's memory is not the caching allocator's."""
    if not config.use_piecewise_cuda_graphs:
        return 0
    return config.max_piecewise_capture_size * layer_temporaries_per_token(config)


def kv_block_bytes(config: EngineConfig) -> int:
    """One block's bytes over every layer's cache (a layer's K and V: kv_cache_shape)."""
    elem = config.kv_cache_torch_dtype.itemsize
    total = 0
    for layer in range(config.model_config.num_kv_layers):
        _, _, block, heads, head_dim = kv_cache_shape(config, 1, layer)
        total += 2 * block * heads * head_dim * elem
    return total


def local_num_kv_heads(config: EngineConfig, layer: int = 0) -> int:
    """KV heads of KV layer `layer` cached on this rank: tensor parallelism splits them evenly (checked by
    EngineConfig)."""
    return config.model_config.kv_shape(layer)[0] // config.tensor_parallel_size


def determine_num_blocks(config: EngineConfig, free_at_start: int | None = None) -> int:
    """Blocks from, in order: num_gpu_blocks_override; kv_cache_memory_bytes; on CUDA this engine's share of the
    GPU (`gpu_budget`; `free_at_start`: the device's free bytes when the runner began, before its weights); on CPU
    a 1 GiB default. Never more than enough for max_num_seqs full-length sequences (plus one block), never fewer
    than one full-length sequence."""
    per_block = kv_block_bytes(config)
    hint = ""  # what else took the memory, when the KV budget came from the GPU's free memory
    enough = config.max_num_seqs * config.max_blocks_per_seq + 1
    if config.num_gpu_blocks_override is not None:
        num = config.num_gpu_blocks_override
    else:
        if config.kv_cache_memory_bytes is not None:
            budget = config.kv_cache_memory_bytes
        elif config.torch_device.type == "cuda":
            budget, hint = gpu_budget(config, free_at_start)
        else:
            budget = DEFAULT_CPU_KV_CACHE_BYTES
        state = state_bytes(config)  # hybrid models' recurrent state (recurrent_state.py) comes out of it first
        budget -= state
        if state:
            hint += (f"; the recurrent state of max_num_seqs={config.max_num_seqs} requests takes "
                     f"{state / 2**30:.2f} GiB of it (docs/hybrid_models.md: lower max_num_seqs to shrink it)")
        # one block of the budget is the runner's sink block; an attention-free model's blocks cost nothing
        num = min(budget // per_block - 1, enough) if per_block else enough
    if config.tensor_parallel_size > 1:  # every rank must hold the blocks rank 0's BlockManager hands out
        num = min_across_ranks(num, config.torch_device)
    if num < config.max_blocks_per_seq:
        # As vLLM's error: the longest max_model_len these blocks would serve (a user's next --max-model-len).
        fits = (f"; these blocks fit max_model_len={num * config.block_size} at most" if num > 0 else "")
        raise ValueError(
            f"the KV cache holds {max(num, 0)} blocks of {config.block_size} tokens, fewer than one sequence of "
            f"max_model_len={config.max_model_len} needs ({config.max_blocks_per_seq}); raise the KV budget "
            "(kv_cache_memory_bytes / num_gpu_blocks_override / gpu_memory_utilization) or lower max_model_len"
            + fits + hint
        )
    return int(num)


def gpu_budget(config: EngineConfig, free_at_start: int | None) -> tuple[int, str]:
    """The KV bytes gpu_memory_utilization allows on CUDA, and the error hint that explains them. As in vLLM, the
    fraction is this engine's share of the device, not a cap on the whole device: total x fraction, less what
    this engine took since `free_at_start` (weights, sleep-mode regions, the CUDA context's growth), less the
    activation reserve; so two engines at 0.45 share one GPU, and a trainer's memory does not count against an
    engine's share. Where less than that share was free at the start, vLLM refuses to start; here the engine
    takes the fraction of what was free instead (leaving the rest of it to the others, as the share would have)
    and says so in a warning: an engine often needs far fewer blocks than it may take (`determine_num_blocks`
    caps them). Never more than is free now, less the reserve. Without `free_at_start` everything in use counts
    as this engine's."""
    free, total = torch.cuda.mem_get_info(config.torch_device)
    util = config.gpu_memory_utilization
    own = total - free if free_at_start is None else max(free_at_start - free, 0)
    reserve = activation_reserve_bytes(config)
    requested = int(total * util)
    short = free_at_start is not None and free_at_start < requested  # where vLLM refuses to start
    allowed = int(free_at_start * util) if short else requested
    budget = min(allowed - own - reserve, free - reserve)
    gib = 2**30
    hint = (f" (gpu_memory_utilization={util} of {total / gib:.1f} GiB is this engine's share; it took "
            f"{own / gib:.1f} GiB before its KV cache and keeps {reserve / gib:.1f} GiB for activations; "
            f"{free / gib:.1f} GiB of the device are free, {(total - free - own) / gib:.1f} GiB held by other "
            "processes or engines")
    if piecewise_graph_bytes(config):
        hint += (f"; piecewise CUDA graphs keep {piecewise_graph_bytes(config) / gib:.1f} GiB of GPU memory out of "
                 "it: a smaller max_piecewise_capture_size or cudagraph_mode='FULL_DECODE_ONLY' frees that")
    hint += ")"
    if short:
        logger.warning("gpu_memory_utilization=%s asks for %.1f GiB but only %.1f GiB of the GPU were free when this "
                       "engine started (vLLM refuses to start): it takes %s of that free memory, %.1f GiB of KV "
                       "cache at most; lower gpu_memory_utilization to silence this%s", util, requested / gib,
                       free_at_start / gib, util, max(budget, 0) / gib, hint)
    return budget, hint


def kv_cache_shape(config: EngineConfig, num_blocks: int, layer: int = 0) -> tuple[int, ...]:
    """KV layer `layer`'s cache: [2 (K, V), num_blocks, block_size, this rank's KV heads, head_dim] (the layers'
    heads and head_dim differ in Gemma 4: ModelConfig.kv_shape)."""
    return (2, num_blocks, config.block_size, local_num_kv_heads(config, layer),
            config.model_config.kv_shape(layer)[1])


def kv_cache_specs(config: EngineConfig, num_blocks: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of every KV layer's cache, in layer order (the model's dtype, or fp8: kv_cache_dtype)."""
    return [(kv_cache_shape(config, num_blocks, layer), config.kv_cache_torch_dtype)
            for layer in range(config.model_config.num_kv_layers)]


def allocate_kv_caches(config: EngineConfig, num_blocks: int) -> list[torch.Tensor]:
    # Zero-filled: padded attention gathers slots past a sequence's end and masks them; uninitialised memory
    # there could hold NaN, and NaN * 0 is NaN.
    return [torch.zeros(shape, dtype=dtype, device=config.torch_device)
            for shape, dtype in kv_cache_specs(config, num_blocks)]
