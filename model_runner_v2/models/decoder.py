"""One decoder-only transformer (Llama/Qwen2/Qwen3 family), parameterised by a small DecoderSpec."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from ...model_config import layer_sliding_windows, position_limit
from ...rope_settings import RopeSettings
from ..attention import Attention
from .layers import GeluTanhAndMul, RMSNorm, RotaryEmbedding, SiluAndMul, load_shard
from .parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    attach_lm_head,
    checkpoint_piece,
    divide,
    embedding,
    get_tp_state,
)
from .weight_update import apply_update, flatten_experts, named_tensors, plan_update

logger = logging.getLogger(__name__)

# hidden_act -> the gated MLP's activation module (silu: SwiGLU, the fused Triton path on CUDA; GeGLU: Gemma)
_GATED_ACTS = {"silu": SiluAndMul, "gelu_pytorch_tanh": GeluTanhAndMul}
# Old checkpoints carry rotary buffers; we rebuild them from the config.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


@dataclass(frozen=True)
class DecoderSpec:
    """What differs between the architectures sharing DecoderLM."""

    qkv_bias: bool  # bias on q/k/v projections (Qwen2 always; Llama/Qwen3 when attention_bias)
    o_bias: bool  # bias on o_proj (Llama/Qwen3 when attention_bias)
    mlp_bias: bool  # bias on gate/up/down (Llama when mlp_bias)
    qk_norm: bool  # per-head RMSNorm on q and k before rope (Qwen3)
    rope_interleaved: bool = False  # rotary pairs (2i, 2i + 1), not (i, i + R/2) (GLM)
    partial_rotary_factor: float = 1.0  # the share of each head that rotates when the config names none (GLM: 0.5)
    rope_fp32: bool = False  # the rotation in fp32, one rounding (Cohere), not op by op in the model dtype
    rope_fp32_tables: bool = False  # with rope_fp32: cos/sin not rounded to the model dtype first (DeepSeek-V2)
    head_dim: int = 0  # each head's q/k width when not the config's head_dim (DeepSeek's MLA: qk_nope + qk_rope)
    rotary_dim: int = 0  # how many of them rotate when not the rope settings' share (MLA: qk_rope_head_dim)
    clip_qkv: float | None = None  # q, k and v clamped to [-clip, clip] after their projection (OLMo's clip_qkv)
    num_kv_heads: int = 0  # K/V heads when not the config's num_key_value_heads (multi-query: GPT-BigCode, Falcon)

    @classmethod
    def with_attention_bias(cls, hf_config, qk_norm: bool = False, **fields) -> DecoderSpec:
        """The spec most architectures' configs imply: biases on q, k, v and o as `attention_bias` says (default
        none), none on the MLP; `fields` the others."""
        bias = bool(getattr(hf_config, "attention_bias", False))
        return cls(qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=qk_norm, **fields)


BIASLESS = DecoderSpec(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False)  # no bias, no q/k norm

def norm_eps(hf_config) -> float:
    """The config's norm epsilon: `rms_norm_eps`, or for the LayerNorm architectures, whose configs have none,
    `layer_norm_eps` (StableLM, GPT-NeoX), `norm_epsilon` (StarCoder2), `layer_norm_epsilon` (GPT-2) or `norm_eps`
    (Nemotron)."""
    for name in ("rms_norm_eps", "layer_norm_eps", "norm_epsilon", "layer_norm_epsilon", "norm_eps"):
        eps = getattr(hf_config, name, None)
        if eps is not None:
            return float(eps)
    return 1e-6


def rename_first(name: str, renames) -> str:
    """`name` rewritten by the first (compiled pattern, replacement) of `renames` that matches it, else as it is
    (checkpoints whose names differ from the decoder's: GPT-NeoX, GPT-2, OPT)."""
    for pattern, repl in renames:
        if pattern.match(name):
            return pattern.sub(repl, name)
    return name


def _head_dim(hf_config) -> int:
    head_dim = getattr(hf_config, "head_dim", None)
    return int(head_dim) if head_dim else hf_config.hidden_size // hf_config.num_attention_heads


class DecoderAttention(nn.Module):
    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary: RotaryEmbedding):
        super().__init__()
        hidden = hf_config.hidden_size
        tp = get_tp_state().size  # heads are split across tensor-parallel ranks (parallel.py); 1 = all here
        total_heads = hf_config.num_attention_heads
        total_kv_heads = spec.num_kv_heads or getattr(hf_config, "num_key_value_heads", None) or total_heads
        self.num_heads = divide(total_heads, tp, "num_attention_heads")  # this rank's heads
        self.num_kv_heads = divide(total_kv_heads, tp, "num_key_value_heads")
        self.head_dim = _head_dim(hf_config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        qkv_parts = [total_heads * self.head_dim, total_kv_heads * self.head_dim, total_kv_heads * self.head_dim]
        self.qkv_proj = ColumnParallelLinear(hidden, qkv_parts, bias=spec.qkv_bias)  # q | k | v rows (local)
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, hidden, bias=spec.o_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, hf_config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, hf_config.rms_norm_eps)
        self.qk_norm = spec.qk_norm
        self.clip_qkv = spec.clip_qkv
        self.rotary = rotary  # shared by all layers: one cos/sin cache per model
        scale = self.head_dim**-0.5
        self.attn = Attention(layer_idx, self.num_heads, self.num_kv_heads, self.head_dim, scale)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's input norm (after the deferred residual add), then the block: (output [T, H], the new
        residual). The norm runs with the qkv projection (RMSNorm.norm_then: one GEMV kernel in a small step)."""
        qkv, residual = norm.norm_then(x, residual, self.qkv_proj)  # [T, (Hq + 2 Hkv) * D]
        if self.clip_qkv is not None:  # OLMo: before the q/k norm and rope, as transformers clamps them
            qkv = qkv.clamp(-self.clip_qkv, self.clip_qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)  # [T, *] strided views, no copy
        # q/k norm (Qwen3, per local head under tensor parallelism) + rope, then the KV-cache write: one kernel on
        # the fused path (Attention.forward).
        q_norm, k_norm = (self.q_norm, self.k_norm) if self.qk_norm else (None, None)
        return self.o_proj(self.attn(positions, q, k, v, self.rotary, q_norm, k_norm)), residual  # -> [T, H]


class DecoderMLP(nn.Module):
    def __init__(self, hf_config, spec: DecoderSpec, intermediate_size: int | None = None, act: str | None = None):
        """intermediate_size: the width (None: the config's; Qwen2-MoE's shared expert has its own); act: the
        activation's name (None: the config's `hidden_act`; Gemma 3 names it `hidden_activation`)."""
        super().__init__()
        act = act or getattr(hf_config, "hidden_act", "silu")
        if act not in _GATED_ACTS:
            raise ValueError(f"hidden_act {act!r} is not supported (supported: {', '.join(_GATED_ACTS)})")
        hidden = hf_config.hidden_size
        inter = hf_config.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_up_proj = ColumnParallelLinear(hidden, [inter, inter], bias=spec.mlp_bias)  # gate | up rows
        self.intermediate_size = self.gate_up_proj.part_sizes[0]  # this rank's share
        self.down_proj = RowParallelLinear(inter, hidden, bias=spec.mlp_bias)
        self.act = _GATED_ACTS[act]()

    def forward(self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm, first: RMSNorm | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The post-attention norm (after the residual add), then the MLP: (output [T, H], the new residual). In a
        small step on CUDA the norm runs inside the gate | up GEMV (RMSNorm.norm_then) and SiluAndMul inside
        down_proj's (one launch less each); a quantized down_proj (quantization/ replaces the module) has no
        such method. first: a norm of x before the residual add (Gemma 2's post-attention norm, GLM-4's
        post-self-attention norm), in the same launch where the norms are fused (RMSNorm.norm_then)."""
        gate_up, residual = norm.norm_then(x, residual, self.gate_up_proj, first)  # [T, 2I]
        return self.down(gate_up), residual

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2I] (gate | up) -> down_proj(silu(gate) * up) [T, H]; SiluAndMul inside down_proj's GEMV where it
        offers one (a small step on CUDA)."""
        fused = getattr(self.down_proj, "silu_mul_matmul", None) if isinstance(self.act, SiluAndMul) else None
        y = fused(gate_up) if fused is not None else None
        return y if y is not None else self.down_proj(self.act(gate_up))


class DecoderLayer(nn.Module):
    attention_class: type[nn.Module] = DecoderAttention  # OLMoE: q/k norms over whole projections (olmo2.py)

    def __init__(self, hf_config, spec: DecoderSpec, layer_idx: int, rotary: RotaryEmbedding, mlp: nn.Module):
        super().__init__()
        self.self_attn = self.attention_class(hf_config, spec, layer_idx, rotary)
        self.mlp = mlp  # [T, H] -> [T, H]: DecoderMLP, or a MoE model's sparse block (moe.py)
        self.input_layernorm = self.make_norm(hf_config)
        self.post_attention_layernorm = self.make_norm(hf_config)

    @classmethod
    def make_norm(cls, hf_config) -> nn.Module:
        """The architecture's norm over the hidden size: the layer's two and the model's final one (DecoderModel).
        Llama's RMSNorm here; a subclass whose model uses another norm (LayerNorm, Gemma's, OLMo 2's order) says so
        by overriding this alone."""
        return RMSNorm(hf_config.hidden_size, norm_eps(hf_config))

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual add of the previous sub-block is deferred into the next norm, and the dense blocks run their
        # norm with the projection after it (RMSNorm.norm_then). Both are module calls: forward hooks see the
        # blocks' outputs (entrypoints/diff/localize.py), the first element of each tuple.
        x, residual = self.self_attn(positions, x, residual, self.input_layernorm)
        if isinstance(self.mlp, DecoderMLP):
            return self.mlp(x, residual, self.post_attention_layernorm)
        x, residual = self.post_attention_layernorm.add_and_norm(x, residual)
        return self.mlp(x), residual


def sandwich_mlp(mlp: nn.Module, x: torch.Tensor, residual: torch.Tensor, pre_norm: nn.Module, post_block: nn.Module,
                 post_mlp: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """A sandwich layer's second half: the first sub-block's output x normed (post_block), added to the residual,
    normed again (pre_norm), the MLP (dense, with the norm fused where it can be, or a sparse block), its output
    normed (post_mlp): (output [T, H], the new residual). AFMoE, LFM3, Kolibri-1."""
    if isinstance(mlp, DecoderMLP):
        x, residual = mlp(x, residual, pre_norm, first=post_block)
    else:
        x, residual = pre_norm.add_and_norm(x, residual, first=post_block)
        x = mlp(x)
    return post_mlp(x), residual


class DecoderModel(nn.Module):
    """Embedding -> layers -> final norm. Named `model` inside DecoderLM so parameter names follow HF."""

    def __init__(self, hf_config, spec: DecoderSpec, build_mlp: Callable[[int], nn.Module],
                 layer_class: type[nn.Module] = DecoderLayer):
        super().__init__()
        self.embed_tokens = embedding(hf_config.vocab_size, hf_config.hidden_size)  # vocab-parallel under TP
        rope = RopeSettings.from_hf_config(hf_config, spec.partial_rotary_factor)
        rotary = RotaryEmbedding(spec.head_dim or _head_dim(hf_config),
                                 rope.max_positions(position_limit(hf_config)), rope,
                                 interleaved=spec.rope_interleaved, fp32_math=spec.rope_fp32,
                                 rotary_dim=spec.rotary_dim or None, fp32_tables=spec.rope_fp32_tables)
        self.layers = nn.ModuleList(
            layer_class(hf_config, spec, i, rotary, build_mlp(i)) for i in range(hf_config.num_hidden_layers)
        )
        self.norm = layer_class.make_norm(hf_config)
        self.fp32_final_norm = False  # DecoderLM.enable_fp32_lm_head: the output is then fp32
        self.embed_scale: float | None = None  # Granite's embedding_multiplier: the embeddings times it
        self.embed_positions: nn.Module | None = None  # GPT-2's learned absolute positions, added to the embeddings
        self.embed_norm: nn.Module | None = None  # BLOOM's word_embeddings_layernorm, on the embeddings

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None  # [T, H]
        if self.embed_scale is not None:
            x = x * self.embed_scale
        if self.embed_positions is not None:
            x = x + self.embed_positions(positions)
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        if self.fp32_final_norm:
            return self.norm.add_and_norm_fp32(x, residual)  # [T, H] fp32
        x, _ = self.norm.add_and_norm(x, residual)
        return x


def rotary_per_layer_type(model: DecoderModel, hf_config) -> None:
    """A config whose `rope_parameters` are per kind of layer (Gemma 3, OLMo 3): the sliding layers' attention
    rotates with rope_parameters["sliding_attention"] (one RotaryEmbedding they share), the full layers keep the
    model's (the "full_attention" entry, RopeSettings.from_hf_config's default)."""
    types = list(getattr(hf_config, "layer_types", None) or [])
    if "sliding_attention" not in types:
        return
    full = next(layer.self_attn for layer in model.layers if hasattr(layer, "self_attn")).rotary  # LFM3: conv first
    settings = RopeSettings.from_hf_config(hf_config, layer_type="sliding_attention")
    local = RotaryEmbedding(full.head_dim, full.cos_cache.shape[0], settings, interleaved=full.interleaved,
                            fp32_math=full.fp32_math, fp32_tables=full.fp32_tables)
    for layer, kind in zip(model.layers, types):
        if kind == "sliding_attention":
            layer.self_attn.rotary = local


class DecoderLM(nn.Module):
    """Causal LM over DecoderModel. Subclasses say which DecoderSpec their HF config implies (and, where their
    layers differ, which layer class builds them)."""

    layer_class: type[nn.Module] = DecoderLayer
    lm_head_bias = False  # Phi-2's head has one
    # checkpoint tensors (by name suffix) read in fp32 rather than the model dtype: parameters the model keeps in
    # fp32 whatever its dtype (GLM-4-MoE's router), loaded without a rounding (loader.iterate_weights)
    checkpoint_fp32_suffixes: tuple[str, ...] = ()

    @classmethod
    def spec(cls, hf_config) -> DecoderSpec:
        raise NotImplementedError

    def __init__(self, hf_config):
        super().__init__()
        self.config = hf_config
        self.model = DecoderModel(hf_config, self.spec(hf_config), self.build_mlp, self.layer_class)
        attach_lm_head(self, hf_config, bias=self.lm_head_bias)  # vocab-parallel (TP); tied: one Parameter
        # each decoder layer's window (the class is named as its architecture), set by the layer: an Attention's
        # layer_idx counts KV layers only (a hybrid model's linear layers have none)
        windows = layer_sliding_windows(type(self).__name__, hf_config)
        for layer, window in zip(self.model.layers, windows):
            for module in layer.modules():
                if isinstance(module, Attention):
                    module.set_window(window)

    def build_mlp(self, layer_idx: int) -> nn.Module:
        """Layer `layer_idx`'s MLP: the dense SwiGLU (a MoE model returns its sparse block for sparse layers)."""
        return DecoderMLP(self.config, self.spec(self.config))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids [T] int64, positions [T] int64 -> hidden [T, H]. Needs set_forward_context(...)."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # [N, H] -> [N, V], model dtype (fp32 after enable_fp32_lm_head)

    @torch.no_grad()
    def enable_fp32_lm_head(self) -> None:
        """The engine option enable_fp32_lm_head: the final residual add and norm, the lm_head matmul and so the
        logits (which the sampler's log-softmax reads) in fp32 for a bf16/fp16 model. The head gets an fp32 copy
        of its loaded weight ([V, H] x 4 bytes; a tied head its own copy, the embedding stays in the model
        dtype). An fp32 model already computes all of this in fp32: nothing changes (the same kernels, the same
        bits)."""
        if self.model.embed_tokens.weight.dtype == torch.float32:  # the model's dtype (a norm may hold no weight)
            return
        self.model.fp32_final_norm = True
        self.lm_head.weight = nn.Parameter(self.lm_head.weight.float(), requires_grad=False)
        if self.lm_head.bias is not None:  # Phi-2's
            self.lm_head.bias = nn.Parameter(self.lm_head.bias.float(), requires_grad=False)

    def checkpoint_parts(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """A checkpoint tensor as the HF-named tensors the loader maps: itself here; an architecture whose
        checkpoints store fused projections (Phi-3) splits them into their q/k/v or gate/up parts."""
        return ((name, tensor),)

    def _fused_shards(self) -> dict[str, tuple[str, int, int]]:
        """HF projection name -> (fused name, row offset, rows) inside qkv_proj / gate_up_proj."""
        # the first attention layer's (a hybrid model's layer 0 may be a Mamba layer: granitemoehybrid.py)
        attn = next((layer.self_attn for layer in self.model.layers if hasattr(layer, "self_attn")), None)
        shards = {}
        if hasattr(attn, "qkv_proj"):  # DeepSeek's MLA has no fused q | k | v (models/mla.py)
            # this rank's rows (all of them without tensor parallelism); q_rows: a q projection carrying more than q
            # (MiniCPM5's output gate beside each head)
            q, kv = getattr(attn, "q_rows", attn.q_size), attn.kv_size
            shards.update(q_proj=("qkv_proj", 0, q), k_proj=("qkv_proj", q, kv), v_proj=("qkv_proj", q + kv, kv))
        dense = [layer.mlp for layer in self.model.layers if isinstance(getattr(layer, "mlp", None), DecoderMLP)]
        if dense:  # a MoE model whose every layer is sparse has no dense gate_up_proj
            inter = dense[0].intermediate_size
            shards.update(gate_proj=("gate_up_proj", 0, inter), up_proj=("gate_up_proj", inter, inter))
        return shards

    def weight_pieces(self, params: dict[str, nn.Parameter],
                      shards: dict[str, tuple[str, int, int]]) -> dict[str, set[int]]:
        """Parameter name -> the first rows of the pieces a full checkpoint writes into it (load_checkpoint reports
        the ones no tensor wrote): one per part of a fused qkv / gate_up parameter, {0} for the others."""
        pieces: dict[str, set[int]] = {}
        for name in params:
            fused = [off for fused_name, off, _ in shards.values() if name.split(".")[-2] == fused_name]
            pieces[name] = set(fused or [0])
        return pieces

    def weight_target(self, name: str, params: dict[str, nn.Parameter],
                      shards: dict[str, tuple[str, int, int]]) -> tuple[str, int, int] | None:
        """Where HF tensor `name` goes: (parameter name, first row, rows) — rows of a fused qkv / gate_up part, or
        all of them — or None for a tensor that is not loaded (rotary caches; a tied checkpoint's lm_head).
        ValueError for a name that matches no parameter. `params`: named_parameters(); `shards`:
        _fused_shards() (passed in: callers resolve many names)."""
        if name.endswith(_IGNORED_SUFFIXES):
            return None
        if name == "lm_head.weight" and self.tie_word_embeddings:
            return None  # tied: the embedding is the head (some tied checkpoints store both)
        parts = name.split(".")
        target, offset, rows = name, 0, None
        if len(parts) >= 2 and parts[-2] in shards:
            fused_name, offset, rows = shards[parts[-2]]
            target = ".".join(parts[:-2] + [fused_name, parts[-1]])
        param = params.get(target)
        if param is None:
            raise ValueError(f"tensor {name!r} matches no parameter of {type(self).__name__}")
        return target, offset, param.shape[0] if rows is None else rows

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """vLLM's `model.load_weights(weights)`, which RL frameworks call on the worker's model: any subset of the
        HF-named tensors, copied in place (CUDA graphs keep their addresses), all checked before any is copied
        (weight_update.py; a bad one is a ValueError and changes nothing). Returns the parameter names written.
        The first load of a checkpoint, where a missing tensor is an error, is load_checkpoint."""
        apply_update(self, plan := plan_update(self, named_tensors(weights)))
        if any(c.param.is_cuda for c in plan):
            torch.cuda.current_stream().synchronize()  # the caller may change its tensors next
        return {name for name, p in self.named_parameters() if any(c.param is p for c in plan)}

    def load_checkpoint(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load a checkpoint's HF-named tensors. Unknown names and, at the end, missing ones raise ValueError."""
        params = dict(self.named_parameters())
        shards = self._fused_shards()
        # Every (parameter, row offset) that must be written before the model is usable.
        pending = self.weight_pieces(params, shards)

        for name, tensor in (part for pair in weights for part in self.checkpoint_parts(*pair)):
            found = self.weight_target(name, params, shards)
            if found is None:
                continue
            target, offset, rows = found
            param = params[target]
            try:
                tensor = checkpoint_piece(param, flatten_experts(tensor))  # tensor parallelism: this rank's piece
                load_shard(param, tensor, offset, rows)
            except ValueError as e:
                raise ValueError(f"checkpoint tensor {name!r}: {e}") from None
            # Every piece inside the rows written (a stacked experts tensor writes all experts' pieces at once).
            left = pending.get(target, ())
            for first in [f for f in left if offset <= f < offset + rows]:
                left.discard(first)

        if pending.get("lm_head.weight") and not pending.get("model.embed_tokens.weight"):
            # A checkpoint without lm_head.weight is a tied one whatever its config says.
            logger.warning("checkpoint has no lm_head.weight: tying lm_head to embed_tokens")
            self.lm_head.weight = self.model.embed_tokens.weight
            self.tie_word_embeddings = True
            pending.pop("lm_head.weight", None)
        missing = sorted(name for name, left in pending.items() if left)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")
