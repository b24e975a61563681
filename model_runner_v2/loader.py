"""Build a model from a ModelConfig and fill its weights (a safetensors or PyTorch .bin checkpoint, or seeded dummy
values)."""

from __future__ import annotations

import json
import logging
import math
import os
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import torch
from torch import nn

from ..config import ModelConfig, check_checkpoint_quantization
from ..fp8_checkpoint_config import fp8_weight_block, is_fp8_checkpoint
from .models.language_model import text_of_multimodal
from .models.layers import RotaryEmbedding, rotary_table_positions, set_batch_invariant
from .models.parallel import full_shape, full_to_local
from .models.registry import get_model_class
from .quantization.fp8_checkpoint import SCALE_SUFFIXES, dequantize_fp8_weights, scaled_weight_names
from .quantization.quantize import quantize_model

logger = logging.getLogger(__name__)

LOAD_FORMATS: tuple[str, ...] = ("auto", "safetensors", "pt", "dummy")
DUMMY_RANGE = 1e-3  # dummy matrices/biases ~ U(-1e-3, 1e-3): finite, non-degenerate logits at any depth


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(prev)


def weight_files(path: str, load_format: str = "auto") -> list[str]:
    """The checkpoint's weight files, as vLLM picks them: "safetensors" its safetensors files, "pt" its PyTorch ones
    (pytorch_model.bin or the shards of pytorch_model.bin.index.json), "auto" the safetensors files where there are
    any, else the PyTorch ones. FileNotFoundError naming what was looked for."""
    if load_format in ("auto", "safetensors"):
        files = _indexed_files(path, "model.safetensors")
        if files or load_format == "safetensors":
            return files or _no_weights(path, "model.safetensors or model.safetensors.index.json")
    files = _indexed_files(path, "pytorch_model.bin")
    if files:
        return files
    wanted = "pytorch_model.bin or pytorch_model.bin.index.json" if load_format == "pt" else (
        "model.safetensors, model.safetensors.index.json, pytorch_model.bin or pytorch_model.bin.index.json")
    return _no_weights(path, wanted)


WEIGHT_ENTRY_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                      "pytorch_model.bin.index.json")  # what weight_files starts from


def has_weight_files(path: str) -> bool:
    """Whether checkpoint folder `path` names weights weight_files would read (a config-only folder does not)."""
    return any(os.path.isfile(os.path.join(path, name)) for name in WEIGHT_ENTRY_FILES)


def safetensors_files(path: str) -> list[str]:
    """model.safetensors, or the shards named by model.safetensors.index.json (sorted, deduplicated)."""
    return weight_files(path, "safetensors")


def _indexed_files(path: str, single_name: str) -> list[str]:
    """[path/single_name], or the shards its `.index.json` names (sorted, deduplicated); [] when neither is there."""
    index = os.path.join(path, single_name + ".index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(path, name) for name in shards]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise FileNotFoundError(f"shards listed in {index} are missing: {missing}")
        return files
    single = os.path.join(path, single_name)
    return [single] if os.path.isfile(single) else []


def _no_weights(path: str, wanted: str) -> list[str]:
    raise FileNotFoundError(f"no weights in {path}: expected {wanted} (use load_format='dummy' for random weights)")


def _file_tensors(file: str) -> Iterator[tuple[str, torch.Tensor]]:
    """One weight file's (name, tensor) pairs: a safetensors file one tensor at a time; a PyTorch file (.bin) loaded
    with weights_only (no code runs; memory-mapped unless it is of torch's legacy format), its dict then walked."""
    if not file.endswith(".safetensors"):
        try:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # a file of torch's legacy (pre-1.6, non-zip) format cannot be memory-mapped
            state = torch.load(file, map_location="cpu", weights_only=True)
        if not isinstance(state, dict):
            raise ValueError(f"{file} holds a {type(state).__name__}, not a state dict of tensors")
        yield from ((name, t) for name, t in state.items() if isinstance(t, torch.Tensor))
        return
    from safetensors import safe_open

    with safe_open(file, framework="pt", device="cpu") as f:
        for name in f.keys():
            yield name, f.get_tensor(name)


def iterate_weights(files: list[str], dtype: torch.dtype, fp32_suffixes: tuple[str, ...] = ()
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream (name, tensor) one tensor at a time (the files: weight_files'); floating tensors are cast to `dtype`,
    those whose names end with one of `fp32_suffixes` to fp32 (parameters a model keeps in fp32:
    DecoderLM.checkpoint_fp32_suffixes). A file that cannot be read (corrupt, truncated, not a checkpoint) is a
    ValueError naming it: the caller's file, not an engine failure (/update_weights_from_disk answers 400)."""
    from safetensors import SafetensorError

    for file in files:
        try:
            for name, tensor in _file_tensors(file):
                if tensor.is_floating_point() and tensor.element_size() > 1:  # fp8 values: dequantized later
                    tensor = tensor.to(torch.float32 if name.endswith(fp32_suffixes) else dtype)
                yield name, tensor
        except (OSError, EOFError, RuntimeError, pickle.UnpicklingError, SafetensorError) as e:
            raise ValueError(f"cannot read weight file {file}: {type(e).__name__}: {e}") from None


def checkpoint_tensors(model_config: ModelConfig, files: list[str], device: torch.device | None = None
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors as its architecture loads them: the model dtype, except the ones it keeps in fp32
    (DecoderLM.checkpoint_fp32_suffixes); an fp8 checkpoint's weights dequantized to the model dtype
    (quantization/fp8_checkpoint.py), on `device` (the model's: a GPU does it at its speed). Loading at start-up and
    update_weights_from_disk both read this way. Whether the files are fp8 is their folder's config.json's word
    (`folder_quantization_config`): an engine started on bf16 weights can take an fp8 checkpoint in place, and a
    multimodal wrapper's top-level quantization_config counts (the model's config is its text part)."""
    suffixes = getattr(get_model_class([model_config.architecture]), "checkpoint_fp32_suffixes", ())
    quant = folder_quantization_config(os.path.dirname(files[0])) if files else None
    check_checkpoint_quantization(model_config.architecture, SimpleNamespace(quantization_config=quant))
    if not is_fp8_checkpoint(quant):
        return iterate_weights(files, model_config.dtype, suffixes)
    tensors = iterate_weights(files, model_config.dtype, suffixes + SCALE_SUFFIXES)
    return dequantize_fp8_weights(tensors, scaled_weight_names(tensor_names(files)), fp8_weight_block(quant),
                                  model_config.dtype, device)


def folder_quantization_config(path: str) -> dict | None:
    """config.json's quantization_config in checkpoint folder `path` (None: none, or no readable config.json)."""
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            quant = json.load(f).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return None
    return quant or None


def tensor_names(files: list[str]) -> list[str]:
    """Every tensor name of the checkpoint files (a safetensors file's header only)."""
    from safetensors import safe_open

    names = []
    for file in files:
        if file.endswith(".safetensors"):
            with safe_open(file, framework="pt", device="cpu") as f:
                names.extend(f.keys())
        else:
            names.extend(name for name, _ in _file_tensors(file))
    return names


_HASH_CHUNK = {"cpu": 1 << 20, "cuda": 1 << 26}  # elements hashed at once: cache-sized on a CPU, few launches on GPUs


def _hash_uniform(start: int, numel: int, seed: int, device: torch.device) -> torch.Tensor:
    """[numel] fp32 in [-1, 1): element i is a fixed function of (start + i, seed) — a 64-bit multiply / xor-shift /
    multiply mix (int64 arithmetic wraps alike on every device), its top 24 bits scaled. Exact integer math and
    an exactly representable scaling: the same bits on the CPU and on CUDA, at device speed (about half of
    torch's CPU generator's speed there). The result does not depend on the chunking."""
    out = torch.empty(numel, dtype=torch.float32, device=device)
    chunk = _HASH_CHUNK.get(torch.device(device).type, _HASH_CHUNK["cpu"])
    h = torch.empty(min(chunk, numel), dtype=torch.int64, device=device)
    t = torch.empty_like(h)
    for lo in range(0, numel, chunk):
        n = min(chunk, numel - lo)
        hh, tt, dst = h[:n], t[:n], out[lo : lo + n]
        torch.arange(start + lo, start + lo + n, out=hh)
        hh.mul_(-7046029254386353131).add_(seed * 1442695040888963407 % (1 << 62))  # odd: a bijection of i
        torch.bitwise_right_shift(hh, 32, out=tt)
        hh.bitwise_xor_(tt).mul_(-4658895280553007687)
        torch.bitwise_right_shift(hh, 40, out=tt)  # the top 24 bits (sign-extended by the shift, masked next)
        dst.copy_(tt.bitwise_and_(0xFFFFFF))
        dst.mul_(2.0 / (1 << 24)).sub_(1.0)
    return out


def _reserve_blas_workspace(device: torch.device, dtype: torch.dtype) -> None:
    """cuBLAS takes its workspace (tens of MiB per stream, kept for the process: CUDA graphs replay kernels that
    use it) from torch's allocator on a stream's first matmul. Taken here, before any weight or load temporary
    exists, it gets a segment of its own; taken later it lands in a freed segment of the load's temporaries
    (hundreds of MiB) and pins that whole segment after the engine shuts down."""
    if device.type != "cuda":
        return
    for dt in {torch.float32, dtype}:
        a = torch.zeros(8, 8, device=device, dtype=dt)
        a @ a


@torch.no_grad()
def fill_dummy_weights(model: nn.Module, seed: int) -> None:
    """Norm weights = 1; every other parameter ~ U(-DUMMY_RANGE, DUMMY_RANGE).

    Each value is a hash of its place in the model (parameter order, index in the full unsharded shape) and the
    seed, computed on the parameter's device (`_hash_uniform`): the same weights on every device and dtype, so
    dummy runs stay comparable across them, and a 30B model fills in a second on a GPU (drawing it from one
    CPU generator took minutes).
    """
    offset = 0
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
            continue
        # Drawn in the full (unsharded) shape: tensor-parallel ranks keep their part of the same model.
        shape = full_shape(param)
        numel = math.prod(shape)
        values = _hash_uniform(offset, numel, seed, param.device).view(shape) * DUMMY_RANGE
        param.copy_(full_to_local(param, values))
        offset += numel


def _fit_context(model: nn.Module, max_model_len: int) -> None:
    """Every module that settles something from the served context: Attention (a sliding window only where
    sequences can outgrow it), RotaryEmbedding (longrope's factors), mistral3.QueryTemperature."""
    for module in model.modules():
        fit = getattr(module, "fit_context", None)
        if fit is not None:
            fit(max_model_len)
    rotaries = [m for m in model.modules() if isinstance(m, RotaryEmbedding)]
    long = next((r.settings for r in rotaries if r.settings.use_long_factor), None)
    if long is not None:
        logger.warning("longrope: max_model_len=%d exceeds the pretraining context of %d tokens, so every position "
                       "takes the long factors (vLLM's rule); transformers takes the short ones for a sequence "
                       "within that context. Set max_model_len <= %d for those.", max_model_len,
                       long.original_max_position_embeddings, long.original_max_position_embeddings)


def load_model(
    model_config: ModelConfig,
    device: torch.device,
    load_format: str = "auto",
    seed: int = 0,
    quantization: str | None = None,
    fp32_lm_head: bool = False,
    batch_invariant: bool = False,
    max_model_len: int | None = None,
) -> nn.Module:
    """Model in `model_config.dtype` on `device`, weights loaded, in eval mode. With `quantization` ("int8" /
    "fp8"), the decoder layers' linears are then quantized from the loaded float weights (quantization/); with
    `fp32_lm_head`, the final norm and lm_head compute in fp32 (DecoderLM.enable_fp32_lm_head); with
    `batch_invariant`, linears and attention switch to their row-invariant implementations (set_batch_invariant);
    `max_model_len` (the engine's) settles what depends on the served context (longrope's short or long factors:
    RotaryEmbedding.fit_context; a sliding window's kernels only where sequences can outgrow it:
    Attention.fit_context)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r} is not supported; choose one of {LOAD_FORMATS}")
    # Find the files before allocating anything, so a bad path fails fast.
    files = weight_files(model_config.path, load_format) if load_format != "dummy" else []
    _reserve_blas_workspace(torch.device(device), model_config.dtype)
    model_cls = get_model_class([model_config.architecture])
    if model_config.text_of:  # a multimodal wrapper's checkpoint: its language model's tensors, renamed
        model_cls = text_of_multimodal(model_cls, model_config.text_of)
    with _default_dtype(model_config.dtype), torch.device(device), rotary_table_positions(max_model_len):
        model = model_cls(model_config.hf_config)
    if max_model_len is not None:
        _fit_context(model, max_model_len)
    if load_format == "dummy":
        fill_dummy_weights(model, seed)
    else:
        model.load_checkpoint(checkpoint_tensors(model_config, files, device))
    if quantization is not None:
        quantize_model(model, quantization)
    if fp32_lm_head:
        model.enable_fp32_lm_head()
    if batch_invariant:
        set_batch_invariant(model)
    return model.eval()
