"""What a side resolved to (dtype, attention backend, device, ...) and the software it ran on."""

from __future__ import annotations

from typing import Any

# The engine facts a diff reader needs to tell two setups apart, in the order the report lists them.
ENGINE_FACTS = ("model", "dtype", "kv_cache_dtype", "attention_backend", "device", "quantization",
                "enable_fp32_lm_head", "tensor_parallel_size", "batch_invariant", "cuda_graphs", "async_scheduling",
                "enable_prefix_caching", "enable_chunked_prefill", "max_model_len", "block_size", "seed",
                "trace_replay_chunk_size", "trace_replay")


def engine_resolved(config) -> dict[str, Any]:
    """The facts of a validated EngineConfig ("auto" values already resolved by its __post_init__)."""
    mc = config.model_config
    return {
        "model": config.model,
        "model_path": mc.path,
        "dtype": _dtype_name(mc.dtype),
        "kv_cache_dtype": _dtype_name(config.kv_cache_torch_dtype),  # the model's unless kv_cache_dtype says fp8
        "attention_backend": config.attention_backend,
        "device": str(config.torch_device),
        "quantization": config.quantization,
        "enable_fp32_lm_head": config.enable_fp32_lm_head,
        "tensor_parallel_size": config.tensor_parallel_size,
        "batch_invariant": config.batch_invariant,
        "cuda_graphs": config.use_cuda_graphs,
        "async_scheduling": bool(config.async_scheduling),
        "enable_prefix_caching": config.enable_prefix_caching,
        "enable_chunked_prefill": config.enable_chunked_prefill,
        "max_model_len": config.max_model_len,
        "block_size": config.block_size,
        "seed": config.seed,
        "trace_replay_chunk_size": config.trace_replay_chunk_size,
        # "one-token" (bitwise the sampling-time logprobs) or "fast:K" (EngineConfig.trace_replay_mode)
        "trace_replay": config.trace_replay_mode,
        "gpu": gpu_name(config.torch_device),
    }


def hf_resolved(mc, device, attn_implementation: str | None) -> dict[str, Any]:
    """The facts of an `hf` side; attn_implementation None means transformers' own choice (filled in after
    loading by sides._run_hf with what the model actually uses)."""
    return {"model_path": mc.path, "dtype": _dtype_name(mc.dtype), "device": str(device),
            "attn_implementation": attn_implementation, "gpu": gpu_name(device)}


def versions() -> dict[str, str | None]:
    """Versions of replayllm and the libraries that shape the numbers (None: not installed)."""
    from importlib import metadata

    out: dict[str, str | None] = {}
    for name in ("replayllm", "torch", "transformers", "triton"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def gpu_name(device) -> str | None:
    """The GPU's name when `device` is a CUDA device, else None."""
    import torch

    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(device)


# The facts the console prints per side (summary.md and diff.json hold them all).
CONSOLE_FACTS = ("dtype", "kv_cache_dtype", "attention_backend", "attn_implementation", "device", "gpu",
                 "quantization", "enable_fp32_lm_head", "tensor_parallel_size", "batch_invariant", "cuda_graphs",
                 "async_scheduling", "trace_replay")


def describe(resolved: dict[str, Any], keys: tuple[str, ...] = CONSOLE_FACTS) -> str:
    """`dtype=float32 attention_backend=torch ...`: the side's facts among `keys`, one line (no GPU: omitted)."""
    return " ".join(f"{k}={'none' if resolved[k] is None else resolved[k]}" for k in keys
                    if k in resolved and not (k == "gpu" and resolved[k] is None))


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")
