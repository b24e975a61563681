"""Building blocks shared by the decoder models: linear/embedding, RMSNorm, LayerNorm, rotary embedding, SiluAndMul.

RMSNorm, LayerNorm (each with the residual add before it), the q/k norm + rotary and SiluAndMul run fused Triton
kernels (replayllm/kernels/) where
`use_fused_kernels` says so (CUDA), and their plain-torch references elsewhere (the CPU engine); Linear runs
`gemv.linear` (the GEMV kernel for one-row steps, kernels/gemv.py; F.linear otherwise)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels import layer_norm as layer_norm_kernel
from ...kernels.activation import (
    gelu_tanh_and_mul_invariant_torch,
    gelu_tanh_and_mul_torch,
    silu_and_mul_invariant_torch,
    silu_and_mul_torch,
    silu_and_mul_triton,
)
from ...kernels.batch_invariant_matmul import batch_invariant_linear
from ...kernels.dispatch import use_fused_kernels
from ...kernels.gemv import gemv_applies, gemv_triton, linear, norm_gemv_triton
from ...kernels.layer_norm import layer_norm_torch, layer_norm_triton
from ...kernels.rms_norm import rms_norm_torch, rms_norm_triton
from ...kernels.rotary import KVWrite, qk_norm_rope_torch, qk_norm_rope_triton
from ...rope_settings import RopeSettings

# Parameters below are created with torch.empty (current default dtype/device) and never randomly
# initialised: the loader overwrites every one of them, so an init pass would only cost time.


class Linear(nn.Module):
    """y = x W^T (+ b). weight [out, in]; a fused layer (qkv_proj, gate_up_proj) stacks shards along `out`.
    With `batch_invariant` (set by `set_batch_invariant`) every row is reduced in an order independent of the
    batch (kernels/batch_invariant_matmul.py) instead of by the library GEMM. Otherwise `gemv.linear`: the
    weight-streaming GEMV kernel for one-row steps, where it beats the library (bf16/fp16, CUDA:
    kernels/gemv.gemv_wanted), F.linear elsewhere. Quantized layers replace the module (quantization/), so they
    never get here."""

    batch_invariant = False

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.weight, self.bias)

    def matmul(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., in] @ weight^T (+ bias): the layer's matmul (subclasses pass their local shard)."""
        if self.batch_invariant:
            return batch_invariant_linear(x, weight, bias)
        return linear(x, weight, bias)

    def silu_mul_matmul(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up of a SwiGLU projection's output gate_up [..., 2 * in], then this layer, as one GEMV
        kernel where the GEMV takes the step (kernels/gemv.py: one row, CUDA; the same bits as SiluAndMul's
        kernel and then the GEMV). None elsewhere: the caller runs SiluAndMul, then the layer."""
        if self.batch_invariant or not gemv_applies(gate_up, self.weight):
            return None
        return gemv_triton(gate_up, self.weight, self.bias, silu_mul=True)

    def norm_matmul(self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm,
                    first: RMSNorm | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`norm` (after the residual add, when residual is given) then this layer, as one GEMV kernel where the
        GEMV takes the step: (output, the new residual). None elsewhere (see RMSNorm.norm_then). first: a norm
        of x before the add (a sandwich layer's), its own launch before the GEMV's."""
        if self.batch_invariant or not gemv_applies(x, self.weight) or norm.weight.dtype != x.dtype:
            return None
        x = x if first is None else first(x)
        return norm_gemv_triton(x, residual, norm.weight, norm.eps, self.weight, self.bias)


def set_batch_invariant(model: nn.Module) -> None:
    """Batch-invariant mode: every Linear (lm_head included) and every attention layer of `model` switches to
    its row-invariant implementation. Quantized or tensor-parallel layers are rejected by EngineConfig first."""
    for module in model.modules():
        if hasattr(type(module), "batch_invariant"):
            module.batch_invariant = True


class Embedding(nn.Module):
    """Token embedding table, weight [V, H]."""

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)  # [T] -> [T, H]


def load_shard(param: torch.Tensor, loaded: torch.Tensor, offset: int, size: int) -> None:
    """Copy one checkpoint tensor into rows [offset, offset + size) of a fused parameter (dim 0).

    Casts to the parameter's dtype/device in the copy. Raises ValueError when the shapes disagree, so a
    checkpoint for another config never lands silently in the wrong rows.
    """
    if loaded.shape[0] != size or tuple(loaded.shape[1:]) != tuple(param.shape[1:]):
        raise ValueError(
            f"shard shape {tuple(loaded.shape)} does not fit rows [{offset}, {offset + size}) "
            f"of a parameter of shape {tuple(param.shape)}"
        )
    with torch.no_grad():
        param.data.narrow(0, offset, size).copy_(loaded)


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dim, computed in fp32 and cast back before the weight (HF's Llama);
    weight_in_fp32: the weight times the fp32 row, then cast (HF's OLMo2); unit_offset: (1 + weight) in fp32
    times the fp32 row, then cast (HF's Gemma). Both orders run the Triton kernel on the fused path, but not the
    GEMV's norm prologue (it has Llama's order)."""

    def __init__(self, dim: int, eps: float, weight_in_fp32: bool = False, unit_offset: bool = False):
        super().__init__()
        self.eps = eps
        self.weight_in_fp32 = weight_in_fp32 or unit_offset
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_fused_kernels(x.device):
            return rms_norm_triton(x, self.weight, self.eps, weight_in_fp32=self.weight_in_fp32,
                                   unit_offset=self.unit_offset)
        return rms_norm_torch(x, self.weight, self.eps, weight_in_fp32=self.weight_in_fp32,
                              unit_offset=self.unit_offset)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor, first: RMSNorm | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual add in the model dtype (same rounding as HF's `residual + h`), then norm; one kernel
        when fused. Returns (normed, new_residual), both fresh tensors. first: x is normed by it before the add
        (a sandwich layer's norm after its sub-block), in the same launch when fused (the same bits as two);
        a norm with another order, or one a forward hook watches (`replayllm diff --localize` reads its output),
        runs as its own module call."""
        if first is not None:
            if (first._forward_hooks or first._forward_pre_hooks or not use_fused_kernels(x.device)
                    or (first.weight_in_fp32, first.unit_offset) != (self.weight_in_fp32, self.unit_offset)):
                x = first(x)
            else:
                return rms_norm_triton(x, self.weight, self.eps, residual, self.weight_in_fp32, self.unit_offset,
                                       first.weight, first.eps)
        if use_fused_kernels(x.device):
            return rms_norm_triton(x, self.weight, self.eps, residual, self.weight_in_fp32, self.unit_offset)
        return rms_norm_torch(x, self.weight, self.eps, residual, self.weight_in_fp32, self.unit_offset)

    def norm_then(self, x: torch.Tensor, residual: torch.Tensor | None, layer: nn.Module,
                  first: RMSNorm | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """layer(norm(x [+ residual])) and the new residual (x itself without a residual): one GEMV kernel with
        the norm as its prologue where `layer` offers it (Linear.norm_matmul: a small step on CUDA), the norm's
        kernel then the layer otherwise (a quantized layer, a batch-invariant one, larger steps). first: a norm
        of x before the residual add (add_and_norm's), its own launch where the GEMV takes the second one."""
        fused = None if self.weight_in_fp32 else getattr(layer, "norm_matmul", None)  # the GEMV has Llama's order
        out = fused(x, residual, self, first) if fused is not None else None
        if out is not None:
            return out
        if residual is None:
            return layer(self(first(x) if first is not None else x)), x
        x, residual = self.add_and_norm(x, residual, first)
        return layer(x), residual

    def add_and_norm_fp32(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The fp32 head's final norm (enable_fp32_lm_head): x and residual upcast before the add, the norm and
        its weight in fp32, the result left in fp32 [T, H] (no cast back to the model dtype)."""
        return rms_norm_torch(x.float() + residual.float(), self.weight.float(), self.eps,
                              unit_offset=self.unit_offset)


class LayerNorm(nn.Module):
    """(x - mean) / sqrt(var + eps) * weight + bias over the last dim, with fp32 statistics and one rounding: HF's
    nn.LayerNorm (StableLM, GPT-2, ...). On the fused path (CUDA) one Triton kernel with the residual add before it
    (kernels/layer_norm.py: the same fp32 formula, its statistics summed in another order, so a 16-bit output may
    sit one ulp from torch's); elsewhere torch's layer_norm, the same bits as HF. No GEMV prologue. The methods the
    decoder layers call on RMSNorm, with the same meanings."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False, bias: bool = True):
        """unit_offset: the scale is (weight + 1) in the weight's dtype (Nemotron's LayerNorm1P); bias False: a
        weight alone (MPT's)."""
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(dim), requires_grad=False) if bias else None

    def params(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(weight, bias); (None, None) for a norm without parameters (OLMo's)."""
        return self.weight, self.bias

    def _fused(self, x: torch.Tensor) -> bool:
        weight = self.params()[0]
        return (layer_norm_kernel.ENABLED and use_fused_kernels(x.device)
                and (weight is None or weight.dtype == x.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = layer_norm_triton if self._fused(x) else layer_norm_torch
        return norm(x, *self.params(), self.eps, unit_offset=self.unit_offset)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add in the model dtype (HF's `residual + h`), then the norm; one kernel when fused.
        Returns (normed, new_residual)."""
        norm = layer_norm_triton if self._fused(x) else layer_norm_torch
        return norm(x, *self.params(), self.eps, residual, unit_offset=self.unit_offset)

    def norm_then(self, x: torch.Tensor, residual: torch.Tensor | None, layer: nn.Module,
                  first: nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm.norm_then's contract; `first` (a norm of x before the residual add) is its own module call."""
        if first is not None:
            x = first(x)
        if residual is None:
            return layer(self(x)), x
        x, residual = self.add_and_norm(x, residual)
        return layer(x), residual

    def add_and_norm_fp32(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """enable_fp32_lm_head's final norm: the add, the norm and its parameters in fp32, left in fp32."""
        weight = self.weight.float() + 1.0 if self.unit_offset else self.weight.float()
        bias = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float() + residual.float(), self.weight.shape, weight, bias, self.eps)


class SiluAndMul(nn.Module):
    """[..., 2I] (gate | up) -> silu(gate) * up [..., I]. `batch_invariant`: the row-invariant torch form off
    the fused path (the fused kernel computes every element alike already)."""

    batch_invariant = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and use_fused_kernels(x.device):
            return silu_and_mul_triton(x)
        if self.batch_invariant:
            return silu_and_mul_invariant_torch(x)
        return silu_and_mul_torch(x)


class GeluTanhAndMul(nn.Module):
    """[..., 2I] (gate | up) -> gelu_tanh(gate) * up [..., I] (GeGLU: Gemma). `batch_invariant`: the row-invariant
    torch form off the fused path (the fused kernel computes every element alike already)."""

    batch_invariant = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and use_fused_kernels(x.device):
            return silu_and_mul_triton(x, gelu_tanh=True)
        if self.batch_invariant:
            return gelu_tanh_and_mul_invariant_torch(x)
        return gelu_tanh_and_mul_torch(x)


_TABLE_POSITIONS: int | None = None  # rotary_table_positions: the served context, while a model is built


@contextmanager
def rotary_table_positions(max_model_len: int | None) -> Iterator[None]:
    """RotaryEmbedding tables built inside cover positions 0 .. max_model_len - 1 only, not the config's whole
    max_position_embeddings (Llama 4 Scout's 10M positions: ~2.7 GB each of cos and sin in fp32, built and then
    unused). The engine never runs a position past max_model_len - 1: prompts longer are refused, generation
    stops there, and drafts / replay lookaheads are cut to it (scheduler)."""
    global _TABLE_POSITIONS
    saved, _TABLE_POSITIONS = _TABLE_POSITIONS, max_model_len
    try:
        yield
    finally:
        _TABLE_POSITIONS = saved


class RotaryEmbedding(nn.Module):
    """HF's rotary embedding with a cos/sin cache built once up to max_position (or the served context where
    rotary_table_positions gives one): neox / "rotate_half" pairs (i, i + R/2), or GLM's interleaved pairs
    (2i, 2i + 1), over the first R = settings.rotary_dim(head_dim) elements of each head (all of them unless the
    config has a partial_rotary_factor)."""

    def __init__(self, head_dim: int, max_position: int, settings: RopeSettings, interleaved: bool = False,
                 fp32_math: bool = False, rotary_dim: int | None = None, fp32_tables: bool = False):
        """fp32_math: the rotation in fp32 with one rounding (Cohere's), not op by op in the model dtype;
        fp32_tables (with fp32_math): cos/sin not rounded to the model dtype first (DeepSeek-V2's, Ernie 4.5's);
        rotary_dim: R itself (DeepSeek's MLA heads: qk_rope_head_dim of qk_nope + qk_rope), not the settings'
        share of head_dim."""
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary head_dim must be even, got {head_dim}")
        if rotary_dim is not None and (rotary_dim < 2 or rotary_dim % 2 or rotary_dim > head_dim):
            raise ValueError(f"rotary_dim={rotary_dim} must be even, at least 2 and at most head_dim={head_dim}")
        self.head_dim = head_dim
        self.rotary_dim = settings.rotary_dim(head_dim) if rotary_dim is None else rotary_dim
        self.interleaved = interleaved
        self.fp32_math = fp32_math
        self.fp32_tables = fp32_tables
        self.settings = settings
        if _TABLE_POSITIONS is not None:
            max_position = min(max_position, _TABLE_POSITIONS)
        cos, sin = self._tables(max_position)
        self.register_buffer("cos_cache", cos, persistent=False)  # [P, R/2]
        self.register_buffer("sin_cache", sin, persistent=False)

    def _tables(self, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.settings.inv_freq(self.rotary_dim)  # [R/2] fp32
        t = torch.arange(max_position, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq)  # [P, R/2] fp32
        # Kept in fp32 (not converted with the model) and cast to q's dtype at use, as HF does; YaRN and longrope
        # scale both by their attention factor there too (in fp32, before the cast).
        cos, sin = freqs.cos(), freqs.sin()
        if self.settings.attention_factor != 1.0:
            cos, sin = cos * self.settings.attention_factor, sin * self.settings.attention_factor
        return cos, sin

    @torch.no_grad()
    def fit_context(self, max_model_len: int) -> None:
        """Settings that depend on the served context (longrope's short or long factors: RopeSettings.for_context)
        take it; the tables are rebuilt in place where that changes them."""
        settings = self.settings.for_context(max_model_len)
        if settings == self.settings:
            return
        self.settings = settings
        with torch.device(self.cos_cache.device):
            cos, sin = self._tables(self.cos_cache.shape[0])
        self.cos_cache.copy_(cos)
        self.sin_cache.copy_(sin)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
        q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None, kv_write: KVWrite | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """positions [T]; q [T, Hq, D], k [T, Hkv, D] (views of the qkv projection) -> rotated q [T, Hq*D],
        k [T, Hkv*D] in q's dtype. With q_norm/k_norm (Qwen3) each head is RMS-normed first (fused with the
        rotation in one kernel on the Triton path). `kv_write` (the Triton path only): the same kernel writes the
        rotated K and V into the KV cache, and k comes back None."""
        if (q_norm is None) != (k_norm is None):
            raise ValueError("q_norm and k_norm must be given together")
        q_w = None if q_norm is None else q_norm.weight
        k_w = None if k_norm is None else k_norm.weight
        eps = 0.0 if q_norm is None else q_norm.eps
        if q_norm is not None and k_norm.eps != eps:
            raise ValueError(f"q_norm and k_norm must share eps, got {eps} and {k_norm.eps}")
        # the norm's weight step (Gemma 3's (1 + weight), OLMo 2's fp32 weight): both norms' flags, which must agree
        orders = {(n.weight_in_fp32, n.unit_offset) for n in (q_norm, k_norm) if n is not None}
        if len(orders) > 1:
            raise ValueError("q_norm and k_norm must weigh alike (weight_in_fp32, unit_offset)")
        in_fp32, unit_offset = orders.pop() if orders else (False, False)
        if use_fused_kernels(q.device):
            return qk_norm_rope_triton(positions, q, k, self.cos_cache, self.sin_cache, q_w, k_w, eps, kv_write,
                                       interleaved=self.interleaved, fp32_math=self.fp32_math,
                                       fp32_tables=self.fp32_tables, norm_weight_in_fp32=in_fp32,
                                       norm_unit_offset=unit_offset)
        if kv_write is not None:
            raise ValueError("kv_write needs the fused (Triton) path")
        return qk_norm_rope_torch(positions, q, k, self.cos_cache, self.sin_cache, q_w, k_w, eps,
                                  interleaved=self.interleaved, fp32_math=self.fp32_math,
                                  fp32_tables=self.fp32_tables, norm_weight_in_fp32=in_fp32,
                                  norm_unit_offset=unit_offset)
