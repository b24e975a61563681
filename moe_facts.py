"""Ground floor: moe_facts, the mixture-of-experts layout of a HF config (experts, top-k, which layers are sparse,
each expert's width, renormalisation), read into ModelConfig. Imports no folder of the package."""

from __future__ import annotations

from typing import Any

from .hybrid_facts import layer_types

# multi-head latent attention (models/mla.py): every q head its own K and V of qk_nope + qk_rope elements in the cache
MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM", "Mistral4ForCausalLM",
                     "LongcatFlashForCausalLM", "KimiLinearForCausalLM",
                     "YoutuForCausalLM", "MiniCPM3ForCausalLM", "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM",
                     "AXK1ForCausalLM", "AXK2ForCausalLM", "HYV4ForCausalLM",
                     "BailingHybridForCausalLM", "Dots3NoteForCausalLM")
# DeepSeek Sparse Attention: DeepSeek-V3's MLA with an indexer choosing each query's `index_topk` keys (model_config:
# dense_attention_limit)
DSA_ARCHITECTURES = ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM", "AXK2ForCausalLM", "HYV4ForCausalLM")
# MLA over dense layers: no experts (their configs have no MoE keys)
DENSE_MLA_ARCHITECTURES = ("YoutuForCausalLM", "MiniCPM3ForCausalLM")


# Qwen3.5-MoE: every layer sparse, the top-k always renormalised (its config has no key for either)
_QWEN3_5_MOE = ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
# Qwen4-Exp: Qwen3.5-MoE's layers whose indexed attention is QSA (sparse_attention_limit); the top-k renormalised as
# `norm_topk_prob` says (Qwen3-Next's router)
QWEN4_EXP_ARCHITECTURES = ("Qwen4ExpForCausalLM", "Qwen4ExpForConditionalGeneration")


def sparse_attention_limit(architecture: str, hf_config) -> int | None:
    """The longest context a sparse-attention model attends in full, where it is run (model_config's
    dense_attention_limit): DSA's `index_topk`; Qwen4-Exp's QSA indexer_budget + indexer_compress_ratio - 1 (below
    budget + ratio tokens there are at most budget / ratio complete blocks, all chosen, the tail always kept:
    models/qwen4_exp.py); None for another model or a Qwen4-Exp without an indexer (Dots 3 Note's: dots3_facts)."""
    if architecture in DSA_ARCHITECTURES:
        return int(hf_config.index_topk)
    budget, ratio = getattr(hf_config, "indexer_budget", None), getattr(hf_config, "indexer_compress_ratio", None)
    if architecture not in QWEN4_EXP_ARCHITECTURES or budget is None or ratio is None:
        return None
    return int(budget) + int(ratio) - 1


def uniform(value: Any, name: str) -> Any:
    """A config value some configs give per layer (HunYuan's lists): the one value, refused where layers differ."""
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise ValueError(f"config.json: {name}={list(value)} differs between layers; not supported")
        return value[0]
    return value


def ernie_text_width(hf_config) -> int:
    """Ernie 4.5 MoE's expert width; ERNIE-4.5-VL's [text, vision] widths: the text experts' (the first)."""
    width = hf_config.moe_intermediate_size
    return int(width[0] if isinstance(width, (list, tuple)) else width)


def moe_facts(architecture: str, hf_config) -> dict:
    """The MoE fields of ModelConfig for a MoE architecture (none for a dense one): experts per sparse layer, experts
    per token, the sparse layers, each expert's width and whether the top-k probabilities are renormalised.
    Qwen3-MoE, Qwen2-MoE: layer i is sparse unless in mlp_only_layers, when (i + 1) % decoder_sparse_step == 0; its
    `moe_intermediate_size` and `norm_topk_prob` (Qwen3-VL-MoE's router always renormalises); Qwen3-Next, Flint and
    Lara-4-Mini the same (Lara's config has neither key: every layer), Qwen3.5-MoE every layer, always renormalised
    (Qwen4-Exp: every layer, `norm_topk_prob`).
    Mixtral: every layer, `num_local_experts` of `intermediate_size`, always renormalised (its router's softmax ->
    top-k -> divide by their sum);
    GPT-OSS the same (a softmax over the top-k logits: the renormalised top-k of the softmax),
    Granite MoE (and its shared-MLP and Granite 4.0 forms; none without experts), MiniMax-Text-01 (Mixtral's) and
    MiniMax-M2 (sigmoid scores, renormalised). GLM-4-MoE: the layers from `first_k_dense_replace`
    on, `n_routed_experts` of `moe_intermediate_size`, `norm_topk_prob`; DeepSeek-V2 / V3 the same, every
    `moe_layer_freq`-th of those layers (DeepSeek's own code), GLM-4.7-Flash's the layers its `mlp_layer_types`
    calls sparse (transformers' config class writes them: the first dense). OLMoE: every layer, `num_experts` of
    `intermediate_size`, renormalised as `norm_topk_prob` says. Llama 4: `moe_layers` (else every
    `interleave_moe_layer_step`-th), `num_local_experts` of `intermediate_size`, one sigmoid score, not renormalised.
    HunYuan-MoE: every layer, `num_experts` (`moe_topk` per token) of `intermediate_size`, renormalised. LFM2-MoE:
    the layers from `num_dense_layers` on, `num_experts` of `moe_intermediate_size`, `norm_topk_prob`. NemotronH: its
    "moe" layers, `n_routed_experts` of `moe_intermediate_size`, `norm_topk_prob`. Gemma 4 with `enable_moe_block`:
    every layer (its experts beside the dense MLP), `num_experts`, `top_k_experts` per token, renormalised. Jamba:
    the layers `layers_num_experts` gives more than one, `num_experts` of `intermediate_size`, not renormalised.
    Mellum, Cohere 2 MoE: `mlp_layer_types`' sparse layers (Cohere's experts `intermediate_size` wide, its softmax
    router's k summing to 1); AFMoE: from `num_dense_layers` on, renormalised; MiniCPM5-MoE, DeepSeek-V3.2, GLM-5,
    A.X-K2, HY-V4, Dots 3 Note: GLM-4.7-Flash's rule; DBRX: every layer, its nested `ffn_config` (moe_num_experts,
    moe_top_k, ffn_hidden_size); Youtu-LLM, MiniCPM3: none (MLA over dense layers); Inkling: `mlp_layer_types`'
    sparse layers, `n_routed_experts` of `moe_intermediate_size` (its shared experts in the routed normalisation)."""
    if architecture in ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "Qwen3VLMoeForConditionalGeneration",
                        "Qwen3NextForCausalLM", "FlintForCausalLM", "LaraMiniForCausalLM", *_QWEN3_5_MOE,
                        *QWEN4_EXP_ARCHITECTURES):
        num_experts = int(getattr(hf_config, "num_experts", 0) or 0)
        step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
        dense = set(getattr(hf_config, "mlp_only_layers", None) or ())
        layers = tuple(i for i in range(hf_config.num_hidden_layers) if i not in dense and (i + 1) % step == 0)
        always = architecture in ("Qwen3VLMoeForConditionalGeneration", *_QWEN3_5_MOE)  # their routers renormalise
        renorm = always or getattr(hf_config, "norm_topk_prob", False)
        width, renorm = int(hf_config.moe_intermediate_size), bool(renorm)
    elif architecture in ("MixtralForCausalLM", "GptOssForCausalLM", "GraniteMoeForCausalLM",
                          "GraniteMoeSharedForCausalLM", "GraniteMoeHybridForCausalLM", "MiniMaxM2ForCausalLM",
                          "PhimoeForCausalLM", "GraniteMoeSWAForCausalLM", "MiniMaxForCausalLM"):
        num_experts = int(getattr(hf_config, "num_local_experts", 0) or 0)
        if not num_experts and architecture == "GraniteMoeHybridForCausalLM":
            return {}  # granite-4.0-micro: dense
        layers = tuple(range(hf_config.num_hidden_layers))
        width, renorm = int(hf_config.intermediate_size), True
    elif architecture == "MellumForCausalLM":  # the layers mlp_layer_types calls sparse (default: every layer)
        num_experts = int(getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", 0) or 0)
        types = getattr(hf_config, "mlp_layer_types", None) or ["sparse"] * hf_config.num_hidden_layers
        layers = tuple(i for i, kind in enumerate(types) if kind == "sparse")
        width, renorm = int(hf_config.moe_intermediate_size), bool(getattr(hf_config, "norm_topk_prob", True))
    elif architecture == "Cohere2MoeForCausalLM":  # mlp_layer_types' sparse layers; experts of intermediate_size
        num_experts = int(getattr(hf_config, "num_experts", 0) or 0)
        types = getattr(hf_config, "mlp_layer_types", None) or ["sparse"] * hf_config.num_hidden_layers
        layers = tuple(i for i, kind in enumerate(types) if kind == "sparse")
        sigmoid = getattr(hf_config, "expert_selection_fn", "softmax") == "sigmoid"  # a softmax's k sum to 1
        renorm = bool(getattr(hf_config, "norm_topk_prob", True) or not sigmoid)
        width = int(hf_config.intermediate_size)
    elif architecture == "AfmoeForCausalLM":  # dense below num_dense_layers; always renormalised
        num_experts = int(getattr(hf_config, "num_experts", 0) or 0)
        first = int(getattr(hf_config, "num_dense_layers", 1) or 0)
        layers = tuple(range(first, hf_config.num_hidden_layers))
        width, renorm = int(hf_config.moe_intermediate_size), True
    elif architecture == "DbrxForCausalLM":  # every layer; its nested ffn_config
        ffn = getattr(hf_config, "ffn_config", None)
        get = ffn.get if isinstance(ffn, dict) else (lambda key, default=None: getattr(ffn, key, default))
        num_experts, top_k = int(get("moe_num_experts", 4) or 0), int(get("moe_top_k", 1) or 0)
        layers = tuple(range(hf_config.num_hidden_layers))
        width, renorm = int(get("ffn_hidden_size", 3584)), get("moe_normalize_expert_weights", 1.0) is not None
    elif architecture in DENSE_MLA_ARCHITECTURES:
        return {}
    elif architecture in ("KimiLinearForCausalLM", "BailingHybridForCausalLM"):  # mlp_layer_types' sparse layers
        num_experts = int(hf_config.num_local_experts)
        layers = tuple(i for i, kind in enumerate(hf_config.mlp_layer_types) if kind == "sparse")
        width, renorm = int(hf_config.moe_intermediate_size), bool(getattr(hf_config, "norm_topk_prob", True))
    elif architecture == "JetMoeForCausalLM":  # every layer's MLP (its attention's experts: models/jetmoe.py)
        num_experts = int(hf_config.num_local_experts)
        layers = tuple(range(hf_config.num_hidden_layers))
        width, renorm = int(hf_config.intermediate_size), True
    elif architecture == "LongcatFlashForCausalLM":  # each block's shortcut MoE, at its first sub-layer (2b)
        num_experts = int(hf_config.n_routed_experts) + int(getattr(hf_config, "zero_expert_num", 0) or 0)
        layers = tuple(range(0, int(hf_config.num_hidden_layers), 2))  # (ids >= n_routed_experts: zero experts)
        width, renorm = int(hf_config.expert_ffn_hidden_size), False
    elif architecture in ("Glm4MoeForCausalLM", "Dots1ForCausalLM", "SolarOpenForCausalLM", "MiniCPM5MoeForCausalLM",
                          "MiMoV2FlashForCausalLM", *MLA_ARCHITECTURES):  # dense below first_k_dense_replace
        num_experts = int(getattr(hf_config, "n_routed_experts", 0) or 0)
        first = int(getattr(hf_config, "first_k_dense_replace", 0) or 0)
        freq = int(getattr(hf_config, "moe_layer_freq", 1) or 1) if architecture in MLA_ARCHITECTURES else 1
        layers = tuple(i for i in range(first, hf_config.num_hidden_layers) if i % freq == 0)
        types = getattr(hf_config, "mlp_layer_types", None)  # GLM-4.7-Flash's config class: "dense" / "sparse"
        if architecture in ("Glm4MoeLiteForCausalLM", "MiniCPM5MoeForCausalLM", "AXK1ForCausalLM",
                            "MiMoV2FlashForCausalLM", "Dots3NoteForCausalLM", *DSA_ARCHITECTURES) and types:
            layers = tuple(i for i, kind in enumerate(types) if kind == "sparse")
        renorm = getattr(hf_config, "norm_topk_prob", architecture != "DeepseekV2ForCausalLM")
        width, renorm = int(hf_config.moe_intermediate_size), bool(renorm)
    elif architecture in ("Llama4ForCausalLM", "Llama4ForConditionalGeneration"):
        num_experts = int(getattr(hf_config, "num_local_experts", 0) or 0)
        step = int(getattr(hf_config, "interleave_moe_layer_step", 1) or 1)
        layers = getattr(hf_config, "moe_layers", None)
        layers = tuple(range(step - 1, hf_config.num_hidden_layers, step)) if layers is None else tuple(layers)
        width, renorm = int(hf_config.intermediate_size), False
    elif architecture == "HunYuanMoEV1ForCausalLM":  # every layer; counts possibly per layer (one value)
        num_experts = int(uniform(getattr(hf_config, "num_experts", 0), "num_experts") or 0)
        layers = tuple(range(hf_config.num_hidden_layers))
        width, renorm = int(hf_config.intermediate_size), True
    elif architecture in ("ExaoneMoeForCausalLM", "HYV3ForCausalLM", "LagunaForCausalLM", "BeamForCausalLM"):
        # mlp_layer_types' sparse layers
        num_experts = int(getattr(hf_config, "num_experts", 0) or 0)
        first = int(getattr(hf_config, "first_k_dense_replace", 1) or 0)
        types = getattr(hf_config, "mlp_layer_types", None) or [
            "dense" if i < first else "sparse" for i in range(hf_config.num_hidden_layers)]
        layers = tuple(i for i, kind in enumerate(types) if kind == "sparse")
        width, renorm = int(hf_config.moe_intermediate_size), bool(getattr(hf_config, "norm_topk_prob", True))
    elif architecture == "Ernie4_5_MoeForCausalLM":  # every interval-th layer from start to end (-1: the last)
        num_experts = int(getattr(hf_config, "moe_num_experts", 0) or 0)
        last = hf_config.num_hidden_layers - 1
        types = getattr(hf_config, "mlp_layer_types", None)  # ERNIE-4.5-VL's text model names its layers instead
        end = int(getattr(hf_config, "moe_layer_end_index", -1))
        start, step = int(getattr(hf_config, "moe_layer_start_index", 1)), int(getattr(
            hf_config, "moe_layer_interval", 1) or 1)
        layers = tuple(i for i in range(hf_config.num_hidden_layers) if (types[i] == "sparse" if types else (
            (i + 1) % step == 0 and start <= i <= (last if end == -1 else end))))
        width, renorm = ernie_text_width(hf_config), True
    elif architecture == "InklingForCausalLM":  # mlp_layer_types' sparse layers; its router's own normalisation
        layers = tuple(i for i, kind in enumerate(hf_config.mlp_layer_types or ()) if kind == "sparse")
        if not layers:
            return {}
        num_experts = int(hf_config.n_routed_experts)
        width, renorm = int(hf_config.moe_intermediate_size), True
    elif architecture == "NemotronHForCausalLM":  # its "moe" layers ("E" in the pattern string), if any
        kinds = layer_types(hf_config, ("linear_attention", "full_attention", "mlp", "moe"))
        layers = tuple(i for i, kind in enumerate(kinds) if kind == "moe")
        if not layers:
            return {}
        num_experts = int(getattr(hf_config, "n_routed_experts", 0) or 0)
        width, renorm = int(hf_config.moe_intermediate_size), bool(getattr(hf_config, "norm_topk_prob", True))
    elif architecture == "Lfm2MoeForCausalLM":  # dense below num_dense_layers
        num_experts = int(getattr(hf_config, "num_experts", 0) or 0)
        first = int(getattr(hf_config, "num_dense_layers", 0) or 0)
        layers = tuple(range(first, hf_config.num_hidden_layers))
        width, renorm = int(hf_config.moe_intermediate_size), bool(getattr(hf_config, "norm_topk_prob", True))
    elif architecture == "Kolibri1ForCausalLM":  # every layer; not renormalised unless norm_topk_prob
        num_experts = int(getattr(hf_config, "num_experts", 0) or 0)
        layers = tuple(range(hf_config.num_hidden_layers))
        width, renorm = int(hf_config.moe_intermediate_size), bool(getattr(hf_config, "norm_topk_prob", False))
    elif architecture in ("OlmoeForCausalLM", "FlexOlmoForCausalLM"):
        num_experts = int(getattr(hf_config, "num_experts", 0) or 0)
        layers = tuple(range(hf_config.num_hidden_layers))
        width, renorm = int(hf_config.intermediate_size), bool(getattr(hf_config, "norm_topk_prob", False))
    elif architecture == "JambaForCausalLM":  # layers_num_experts: > 1 in the sparse layers
        counts = list(getattr(hf_config, "layers_num_experts", None) or [])
        layers = tuple(i for i, n in enumerate(counts) if n > 1)
        if not layers:
            return {}
        num_experts = int(hf_config.num_experts)
        width, renorm = int(hf_config.intermediate_size), False  # the top k of a softmax, left unnormalised
    elif architecture in ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"):  # every layer, beside its MLP
        if not getattr(hf_config, "enable_moe_block", False):
            return {}
        num_experts, layers = int(hf_config.num_experts or 0), tuple(range(hf_config.num_hidden_layers))
        width, renorm = int(hf_config.moe_intermediate_size), True
    else:
        return {}
    if architecture != "DbrxForCausalLM":  # DBRX's: its ffn_config's moe_top_k
        top_k_key = "top_k_experts" if architecture.startswith("Gemma4") else "num_experts_per_tok"
        top_k = int(uniform(getattr(hf_config, top_k_key, 0), top_k_key) or 0)
    if num_experts < 1 or not 1 <= top_k <= num_experts:
        raise ValueError(f"a MoE config needs num_experts >= 1 and 1 <= num_experts_per_tok <= num_experts, got "
                         f"{num_experts} and {top_k}")
    return {"num_experts": num_experts, "num_experts_per_tok": top_k, "moe_layers": layers,
            "moe_intermediate_size": width, "norm_topk_prob": renorm}
