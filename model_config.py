"""Ground floor: ModelConfig, the model facts the engine needs (architecture, shapes, dtype, EOS ids, MoE layout),
read once from a HF checkpoint directory; EngineConfig (config.py) builds one.

Imports no folder of the package (see docs/architecture.md, "Floors")."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch

from .architecture_names import (  # noqa: F401 (SUPPORTED_ARCHITECTURES re-exported)
    RENAMED_ARCHITECTURES,
    SUPPORTED_ARCHITECTURES,
    resolve_architecture,
)
from .dots3_facts import DOTS3_ARCHITECTURES, dots3_attention_limit, dots3_kv_shapes
from .fp8_checkpoint_config import COMPRESSED_TENSORS, FP8_METHOD, fp8_weight_block, is_fp8_checkpoint
from .gemma4_facts import MIMO_ARCHITECTURES, PLE_ARCHITECTURES, layer_plans
from .hf_config_json import read_hf_config
from .hybrid_facts import (
    ATTENTION_FREE_ARCHITECTURES,
    PARALLEL_HYBRID_ARCHITECTURES,
    recurrent_layers,
    shared_block_layers,
)
from .inkling_facts import inkling_kv_shapes
from .model_source import resolve_model_path
from .moe_facts import MLA_ARCHITECTURES, QWEN4_EXP_ARCHITECTURES, moe_facts, sparse_attention_limit
from .multimodal_text import served_language_model
from .rope_settings import RopeSettings

DType = Literal["auto", "half", "float16", "bfloat16", "float", "float32"]

# vLLM's --dtype choices; "auto" takes the checkpoint's dtype (fp32 when the config names none).
_DTYPES: dict[str, torch.dtype] = {
    "half": torch.float16,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float": torch.float32,
    "float32": torch.float32,
}
DTYPE_CHOICES: tuple[str, ...] = get_args(DType)

logger = logging.getLogger(__name__)
# an LM head narrower than the embedding (`output_vocab_size`): Apertus 1.5's text tokens out, its codes in too
PRUNED_HEAD_ARCHITECTURES = ("Apertus1p5ForConditionalGeneration", "Apertus1p5TextForCausalLM")


def _resolve_dtype(dtype: str, hf_config) -> torch.dtype:
    if dtype == "auto":
        found = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if found is None:
            return torch.float32
        if isinstance(found, torch.dtype):
            return found
        name = str(found).removeprefix("torch.")
        if name not in _DTYPES:
            raise ValueError(
                f"config.json dtype {found!r} is not supported; pass dtype= one of {DTYPE_CHOICES}"
            )
        return _DTYPES[name]
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; choose one of {DTYPE_CHOICES}")
    return _DTYPES[dtype]


def auto_dtype_note(dtype: str, device_type: str, resolved: torch.dtype) -> str | None:
    """What dtype="auto" did differently from vLLM, or None: on a GPU vLLM serves a float32 checkpoint (and one
    whose config names no dtype, float32 to transformers) in bfloat16; here "auto" keeps the checkpoint's dtype."""
    if dtype != "auto" or device_type != "cuda" or resolved != torch.float32:
        return None
    return ("dtype='auto' runs this checkpoint in float32, its config's dtype (or none named: float32): vLLM would "
            "serve it in bfloat16, with half the weight and KV memory; pass dtype='bfloat16' for that")


def mlp_width(hf_config) -> int:
    """The dense MLP's width under its config's name: `intermediate_size` (most), `ffn_hidden_size` (Falcon),
    `ffn_dim` (OPT), `n_inner` (GPT-2, GPT-BigCode, GPT-J; null: 4 x hidden_size, as their MLPs take it);
    Granite 4.0's dense form (GraniteMoeHybrid without experts) its `shared_intermediate_size`; a width per layer
    (Gemma 3n's list): the widest."""
    if getattr(hf_config, "model_type", None) == "granitemoehybrid" and not getattr(hf_config, "num_local_experts", 0):
        return int(hf_config.shared_intermediate_size)
    for name in ("intermediate_size", "ffn_hidden_size", "ffn_dim", "n_inner"):
        width = getattr(hf_config, name, None)
        if width:
            return max(int(w) for w in width) if isinstance(width, (list, tuple)) else int(width)
    return 4 * hf_config.hidden_size


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _eos_token_ids(path: str, hf_config) -> tuple[int, ...]:
    """config.json eos ids, then generation_config.json ones, in order, deduplicated."""
    ids = _as_ids(getattr(hf_config, "eos_token_id", None))
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path, encoding="utf-8") as f:
            ids += _as_ids(json.load(f).get("eos_token_id"))
    return tuple(dict.fromkeys(ids))


@dataclass(frozen=True)
class ModelConfig:
    """The model facts the engine needs, read once from a HF checkpoint directory."""

    path: str  # local checkpoint directory (hub ids and embedded ids are resolved first)
    hf_config: Any  # hf_config_json.ConfigJson (config.json's fields), or a transformers config for other types
    architecture: str
    dtype: torch.dtype
    vocab_size: int  # the logits' width: the tokens a model can sample, score or be forced to (traces)
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    # Mixture of experts (docs/moe.md): experts per sparse layer (0: a dense model), experts each token is routed
    # to, and which layers are sparse (the others run the dense MLP).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_layers: tuple[int, ...] = ()
    moe_intermediate_size: int = 0  # each expert's SwiGLU width
    norm_topk_prob: bool = False  # the k chosen experts' probabilities renormalised to sum 1
    # Sliding-window attention (Mistral's `sliding_window`: a token sees the last W positions, itself included), in
    # the layers layer_sliding_windows names, as vLLM: max_model_len defaults to the position limit and the window
    # runs in those layers' attention past W (Attention.fit_context); EngineConfig.disable_sliding_window caps
    # max_model_len at W instead, where full attention is the same computation. None: full attention.
    sliding_window: int | None = None
    recurrent_layers: tuple[int, ...] = ()  # hybrid models' linear-attention layers: a state per request, no KV
    kv_shared_layers: int = 0  # Gemma 4's last layers attending over an earlier layer's cache: none of their own
    recurrent_layers_attend: bool = False  # Falcon-H1: its recurrent layers attend too (a KV cache beside the state)
    shared_block_layers: tuple[int, ...] = ()  # Zamba2's hybrid layers: a shared block's KV cache beside the state
    # (KV heads, head_dim) of each layer with a KV cache where they differ between layers (Gemma 4's full layers);
    # empty: (num_kv_heads, head_dim) in every one
    kv_layer_shapes: tuple[tuple[int, int], ...] = ()
    # DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): a query attends to the `index_topk` keys its indexer scores
    # highest, i.e. to every key while the context holds at most that many: max_model_len is capped there, where the
    # model is exactly its dense MLA (the indexer then left out). None: no such cap.
    dense_attention_limit: int | None = None
    # the embedding's rows where they exceed the logits' width (Apertus 1.5's pruned head: its image / audio codes
    # are prompt tokens only); None: vocab_size
    input_vocab_size: int | None = None
    text_of: str | None = None  # the multimodal wrapper whose language model this is (multimodal_text.py), if mapped

    @property
    def prompt_vocab_size(self) -> int:
        """Prompt token ids are below this (the embedding's rows)."""
        return self.input_vocab_size or self.vocab_size

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_kv_layers(self) -> int:  # the layers with a KV cache (their Attention's layer_idx counts only them)
        return (self.num_layers - (0 if self.recurrent_layers_attend else len(self.recurrent_layers))
                + len(self.shared_block_layers) - self.kv_shared_layers)

    def kv_shape(self, layer: int) -> tuple[int, int]:
        """(KV heads, head_dim) of KV layer `layer`'s cache (all ranks' heads)."""
        return self.kv_layer_shapes[layer] if self.kv_layer_shapes else (self.num_kv_heads, self.head_dim)

    @classmethod
    def from_pretrained(cls, path: str, dtype: str = "auto") -> ModelConfig:
        """`path` may be a local dir, the embedded id or a hub id (see model_source.resolve_model_path)."""
        path = resolve_model_path(path)
        hf_config = read_hf_config(path)  # config.json itself for the types this build runs (no transformers)
        architecture = resolve_architecture(getattr(hf_config, "architectures", None) or [],
                                            getattr(hf_config, "model_type", None))
        architecture = RENAMED_ARCHITECTURES.get((architecture, getattr(hf_config, "model_type", None)), architecture)
        check_checkpoint_quantization(architecture, hf_config)
        # a multimodal wrapper: its language model (Mistral Small 4's a "mistral4" model, GLM-4.5V's GLM-4-MoE)
        architecture, hf_config, text_of = served_language_model(architecture, hf_config)
        gemma4 = layer_plans(architecture, hf_config)
        dots3 = dots3_kv_shapes(architecture, hf_config)  # (opens its per-layer config for the reads below)
        num_heads, num_kv_heads, head_dim = 1, 1, int(hf_config.hidden_size)  # attention-free: placeholders
        if architecture not in ATTENTION_FREE_ARCHITECTURES:
            per_layer = getattr(hf_config, "num_attention_heads_per_layer", None)  # Laguna's: the most, for sizing
            num_heads = max(per_layer) if per_layer else hf_config.num_attention_heads
            num_kv_heads, head_dim = attention_shape(architecture, hf_config)
        return cls(
            path=path,
            hf_config=hf_config,
            architecture=architecture,
            dtype=_resolve_dtype(dtype, hf_config),
            vocab_size=int(getattr(hf_config, "output_vocab_size", None) or hf_config.vocab_size)
            if architecture in PRUNED_HEAD_ARCHITECTURES else hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            # the config's limit, stretched by linear / YaRN rope scaling as vLLM does (rope_settings.py); Gemma 3's
            # limit already counts its global layers' linear scaling (vLLM leaves it alone too); Dots 3 Note's rope is
            # per kind of layer and never scaled (dots3_facts)
            max_position_embeddings=position_limit(hf_config)
            if architecture in _GEMMA3 + PLE_ARCHITECTURES + DOTS3_ARCHITECTURES
            else RopeSettings.from_hf_config(hf_config).max_positions(position_limit(hf_config)),
            eos_token_ids=_eos_token_ids(path, hf_config),
            **moe_facts(architecture, hf_config),
            sliding_window=_sliding_window(architecture, hf_config),
            recurrent_layers=recurrent_layers(architecture, hf_config),
            recurrent_layers_attend=architecture in PARALLEL_HYBRID_ARCHITECTURES,
            shared_block_layers=shared_block_layers(architecture, hf_config),
            kv_shared_layers=sum(p.shares_kv for p in gemma4),
            kv_layer_shapes=tuple((p.kv_heads, p.head_dim) for p in gemma4 if not p.shares_kv) or dots3
            or inkling_kv_shapes(architecture, hf_config),
            dense_attention_limit=sparse_attention_limit(architecture, hf_config)
            or dots3_attention_limit(architecture, hf_config),
            input_vocab_size=int(hf_config.vocab_size) if architecture in PRUNED_HEAD_ARCHITECTURES
            and getattr(hf_config, "output_vocab_size", None) not in (None, hf_config.vocab_size) else None,
            text_of=text_of,
        )


# pre-quantized checkpoint formats (config.json's quantization_config.quant_method) the loader reads, dequantized at
# load: fp8 weights with their scales (fp8_checkpoint_config.py: "fp8", and compressed-tensors' float-quantized) for
# every architecture, and an architecture's own (openai's MXFP4 experts)
CHECKPOINT_QUANT_METHODS = {"GptOssForCausalLM": ("mxfp4",)}


def default_max_model_len(mc: ModelConfig, disable_sliding_window: bool) -> int:
    """max_model_len left unset: the model's position limit, capped at the window under disable_sliding_window and
    at a sparse-attention model's dense_attention_limit (said in a warning: the checkpoint's own context is longer)."""
    limit = mc.max_position_embeddings
    if disable_sliding_window and mc.sliding_window is not None:
        limit = min(limit, mc.sliding_window)
    if mc.dense_attention_limit is not None and mc.dense_attention_limit < limit:
        logger.warning("%s: max_model_len defaults to index_topk=%d, the longest context its sparse attention attends "
                       "in full (sparse attention beyond it is not supported)", mc.architecture,
                       mc.dense_attention_limit)
        limit = mc.dense_attention_limit
    return limit


def check_max_model_len(mc: ModelConfig, max_model_len: int, disable_sliding_window: bool) -> None:
    """ValueError past the model's position limit, the window with disable_sliding_window, a dense_attention_limit."""
    window = mc.sliding_window if disable_sliding_window else None
    if window is not None and max_model_len > window:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's sliding_window={window}, the cap of "
                         "disable_sliding_window=True (leave it off to run the window past it)")
    if mc.dense_attention_limit is not None and max_model_len > mc.dense_attention_limit:
        qsa = mc.architecture in QWEN4_EXP_ARCHITECTURES  # Qwen4-Exp's limit; else DeepSeek Sparse Attention's
        what = "indexer_budget + indexer_compress_ratio - 1" if qsa else "index_topk"
        raise ValueError(f"max_model_len={max_model_len} exceeds {mc.architecture}'s {what}={mc.dense_attention_limit}"
                         ": its indexer's sparse attention beyond it is not supported; up to it every key is attended")
    limit = mc.max_position_embeddings
    if max_model_len > limit:
        stretched = limit != position_limit(mc.hf_config)
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={limit}"
                         + (" (config.json's, stretched by its rope scaling)" if stretched else ""))


def check_checkpoint_quantization(architecture: str, hf_config) -> None:
    """ValueError for a checkpoint stored quantized (a `quantization_config`: AWQ, GPTQ, compressed-tensors' integer
    packs, ...) in a format the loader does not read: its tensors are not the weights the model holds. fp8 checkpoints
    (DeepSeek-V3's blocks, Qwen3-FP8, MiniMax-M2, llm-compressor's FP8 exports) are read, dequantized. (The engine's
    own `quantization` option quantizes an unquantized checkpoint at load.)"""
    quant = getattr(hf_config, "quantization_config", None)
    if not quant:
        return
    if is_fp8_checkpoint(quant):
        fp8_weight_block(quant)  # ValueError for a compressed-tensors form that is not fp8
        return
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    own = CHECKPOINT_QUANT_METHODS.get(architecture, ())
    if method not in own:
        also = f", and {', '.join(repr(m) for m in own)}" if own else ""
        raise ValueError(f"{architecture}: quantization_config {method!r} is not supported (fp8 checkpoints are: "
                         f"{FP8_METHOD!r}, or {COMPRESSED_TENSORS!r} float-quantized{also}, dequantized at load); "
                         "use an unquantized (bf16 / fp16 / fp32) checkpoint, and the engine option `quantization` "
                         "to quantize it at load")


def attention_shape(architecture: str, hf_config) -> tuple[int, int]:
    """(KV heads, head_dim) of the KV cache: the config's `num_key_value_heads` (null: one per q head) and
    `head_dim` (null: hidden_size / heads); MLA's cache one per q head of qk_nope_head_dim + qk_rope_head_dim (its
    V padded to that width), whatever transformers' config puts in head_dim (the rotary width)."""
    num_heads = hf_config.num_attention_heads
    if architecture in MLA_ARCHITECTURES:
        return num_heads, int(hf_config.qk_nope_head_dim) + int(hf_config.qk_rope_head_dim)
    if architecture == "FalconForCausalLM":  # multi_query (not the new architecture): one K/V head; else num_kv_heads
        new = getattr(hf_config, "new_decoder_architecture", False)
        kv = (getattr(hf_config, "num_kv_heads", None) or num_heads) if new or not hf_config.multi_query else 1
        return kv, hf_config.hidden_size // num_heads
    if architecture == "GPTBigCodeForCausalLM":  # `multi_query` (the default): one K/V head for all q heads
        kv = 1 if getattr(hf_config, "multi_query", True) else num_heads
        stated = getattr(hf_config, "num_key_value_heads", None)  # transformers 5's config derives it so
        if stated is not None and stated != kv:
            raise ValueError(f"GPT-BigCode with multi_query={getattr(hf_config, 'multi_query', True)} has {kv} "
                             f"key/value head(s); config.json's num_key_value_heads={stated} contradicts it")
        return kv, hf_config.hidden_size // num_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    if architecture == "HrmTextForCausalLM":  # multi-head always (an old file's num_key_value_heads is ignored)
        return num_heads, int(head_dim)
    return getattr(hf_config, "num_key_value_heads", None) or num_heads, int(head_dim)


# keys naming a position limit in configs without `max_position_embeddings` (vLLM's list); none of them: 2048
_POSITION_KEYS = ("n_positions", "max_seq_len", "seq_length", "model_max_length", "max_sequence_length",
                  "max_seq_length", "seq_len")


def position_limit(hf_config) -> int:
    """The config's position limit: `max_position_embeddings`, or where it names none (BLOOM, MPT: ALiBi has no
    position table) the first of vLLM's other keys, else vLLM's default 2048. Read, never written back."""
    limit = getattr(hf_config, "max_position_embeddings", None)
    if limit:
        return int(limit)
    return next((int(v) for v in (getattr(hf_config, k, None) for k in _POSITION_KEYS) if v), 2048)


_GEMMA3 = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")


def _sliding_window(architecture: str, hf_config) -> int | None:
    """The window W (disable_sliding_window's max_model_len cap); None: no layer slides. Mistral, Mixtral, Phi-3,
    Phi-3.5-MoE, StarCoder2: `sliding_window` (null or absent: none). Qwen2 / Qwen3 / Qwen3-MoE: `sliding_window`
    only with `use_sliding_window`, and only when a layer uses it: transformers' `layer_types` where the config lists
    them, else Qwen2's and Qwen3's rule (the layers from `max_window_layers` on) or Qwen3-MoE's (every layer). Gemma 2 /
    3, OLMo 3: `sliding_window`, in its `layer_types`' "sliding_attention" layers (transformers derives them: every
    other layer, Gemma 3's five of every six from `sliding_window_pattern`, OLMo 3's and Cohere 2's three of every
    four)."""
    if architecture in ("MistralForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM", "Starcoder2ForCausalLM",
                        "PhimoeForCausalLM", "Ministral3ForCausalLM", "Mistral3ForConditionalGeneration",
                        "MiniMaxForCausalLM"):
        window = getattr(hf_config, "sliding_window", None)
    elif architecture == "GPTNeoForCausalLM":  # `window_size` in its "local" layers
        window = getattr(hf_config, "window_size", None) if "local" in _gpt_neo_layers(hf_config) else None
    elif architecture in _LAYER_TYPED or (architecture in _QWEN_WINDOWED
                                          and getattr(hf_config, "use_sliding_window", False)):
        window = getattr(hf_config, "sliding_window", None)
        if window is not None and not any(_sliding_layers(architecture, hf_config)):
            window = None
    else:
        return None
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"config.json: sliding_window must be a positive integer or null, got {window!r}")
    return window


def layer_sliding_windows(architecture: str, hf_config) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention), transformers' rules: every layer of Mistral, Mixtral,
    Phi-3 and StarCoder2; the Qwen family's, Gemma 2 / 3's, OLMo 3's and Cohere 2's sliding layers
    (_sliding_layers); an architecture not listed here has none."""
    num_layers = hf_config.num_hidden_layers
    window = _sliding_window(architecture, hf_config) if architecture in SUPPORTED_ARCHITECTURES else None
    if window is None:
        return (None,) * num_layers
    if architecture not in _QWEN_WINDOWED + _LAYER_TYPED:
        return (window,) * num_layers
    return tuple(window if slides else None for slides in _sliding_layers(architecture, hf_config))


_QWEN_WINDOWED = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM",
                  "SmolLM3ForCausalLM")
# a window in the layers `layer_types` calls sliding (no use_sliding_window switch)
_LAYER_TYPED = ("Gemma2ForCausalLM", *_GEMMA3, *PLE_ARCHITECTURES, *MIMO_ARCHITECTURES, "Olmo3ForCausalLM",
                "Cohere2ForCausalLM", "GptOssForCausalLM", "Exaone4ForCausalLM", "Dots1ForCausalLM",
                "MinistralForCausalLM", "ExaoneMoeForCausalLM", "CwmForCausalLM", "VaultGemmaForCausalLM",
                "GPTNeoForCausalLM", "GraniteSWAForCausalLM", "GraniteMoeSWAForCausalLM", "MellumForCausalLM",
                "Cohere2MoeForCausalLM", "AfmoeForCausalLM", "Lfm3ForCausalLM", "LagunaForCausalLM",
                "FlintForCausalLM", "Kolibri1ForCausalLM", "BeamForCausalLM", "LaraMiniForCausalLM",
                "Dots3NoteForCausalLM")


def _sliding_layers(architecture: str, hf_config) -> tuple[bool, ...]:
    """Which layers of a layer-typed config (Qwen family with use_sliding_window, Gemma 2 / 3, OLMo 3, Cohere 2)
    slide: its `layer_types` where it lists them, else Qwen3-MoE's every layer and the others' layers from
    `max_window_layers` on."""
    if architecture == "GPTNeoForCausalLM":
        return tuple(kind == "local" for kind in _gpt_neo_layers(hf_config))
    types = getattr(hf_config, "layer_types", None)
    if types:
        return tuple(t == "sliding_attention" for t in types)
    num_layers = hf_config.num_hidden_layers
    if architecture == "Qwen3MoeForCausalLM":
        return (True,) * num_layers
    first = getattr(hf_config, "max_window_layers", 28)
    return tuple(i >= first for i in range(num_layers))


def _gpt_neo_layers(hf_config) -> list[str]:
    """GPT-Neo's "global" / "local" per layer: transformers' `attention_layers`, else expanded from `attention_types`
    ([[["global", "local"], 12]]: the pair repeated)."""
    layers = getattr(hf_config, "attention_layers", None)
    if layers is None:
        layers = [kind for kinds, times in getattr(hf_config, "attention_types", []) for _ in range(times)
                  for kind in kinds]
    return list(layers)
