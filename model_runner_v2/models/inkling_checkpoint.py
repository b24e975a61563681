"""Inkling's hub checkpoint form (what transformers' conversion mapping for `inkling_mm_model` reads, and what its
save_pretrained writes back) as transformers' module names, tensor by tensor (models/inkling.py's checkpoint_parts):
the language model under `model.llm.*` (`embed`, `embed_norm`, `unembed`), the attention's projections as `wq_du`,
`wk_dv`, `wv_dv`, `wr_du`, `wo_ud`, the norms `attn_norm` / `mlp_norm`, the convolutions without their `conv1d`
level, the router's correction as `gate.bias`, and every gate | up pair stored interleaved row by row (g0, u0, g1,
u1, ...): the dense `mlp.w13_dn` [2I, H], the routed `experts.w13_weight` [E, 2I, H] and the shared
`shared_experts.shared_w13_weight` [S, 2I, H]. The towers (`model.visual.*`, `model.audio.*`) and the MTP layers are
skipped."""

from __future__ import annotations

from collections.abc import Iterable

import torch

# prefix renames (the first that matches), then, for a hub name, the layer-level renames (substrings, in order)
_PREFIXES = (("model.llm.embed_norm.", "model.embed_tokens.embed_norm."), ("model.llm.embed.", "model.embed_tokens."),
             ("model.llm.unembed.", "lm_head."), ("model.llm.", "model."))
_SKIPPED = ("model.mtp.", "model.mtp_layers.", "model.audio.", "model.visual.")
_LAYER_RENAMES = ((".attn.wq_du.", ".self_attn.q_proj."), (".attn.wk_dv.", ".self_attn.k_proj."),
                  (".attn.wv_dv.", ".self_attn.v_proj."), (".attn.wr_du.", ".self_attn.r_proj."),
                  (".attn.wo_ud.", ".self_attn.o_proj."), (".attn.k_sconv.", ".self_attn.k_sconv.conv1d."),
                  (".attn.v_sconv.", ".self_attn.v_sconv.conv1d."), (".attn.", ".self_attn."),
                  (".attn_sconv.weight", ".attn_sconv.conv1d.weight"),
                  (".mlp_sconv.weight", ".mlp_sconv.conv1d.weight"), (".attn_norm.", ".input_layernorm."),
                  (".mlp_norm.", ".post_attention_layernorm."), (".mlp.gate.bias", ".mlp.gate.e_score_correction_bias"),
                  (".mlp.w2_md.", ".mlp.down_proj."), (".mlp.experts.w2_weight", ".mlp.experts.down_proj"),
                  (".shared_experts.shared_w2_weight", ".shared_experts.down_proj"))


def deinterleave(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """Rows g0, u0, g1, u1, ... along `dim` as g0, g1, ..., u0, u1, ... (transformers' Interleave)."""
    pairs = tensor.unflatten(dim, (-1, 2))  # [..., n / 2, 2, ...]: (g_i, u_i) pairs
    return pairs.transpose(dim, dim + 1).flatten(dim, dim + 1).contiguous()


def inkling_checkpoint_parts(name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
    """One checkpoint tensor (hub or transformers form) as transformers' named tensors; () for skipped ones."""
    if name.startswith(_SKIPPED):
        return ()
    hub = name.startswith("model.llm.")
    for old, new in _PREFIXES:
        if name.startswith(old):
            name = new + name[len(old) :]
            break
    if not hub:
        return ((name, tensor),)
    for old, new in _LAYER_RENAMES:
        name = name.replace(old, new)
    if name.endswith(".mlp.w13_dn.weight"):  # [2I, H] interleaved -> gate_proj, up_proj
        gate, up = deinterleave(tensor, 0).chunk(2, dim=0)
        base = name[: -len("w13_dn.weight")]
        return ((base + "gate_proj.weight", gate), (base + "up_proj.weight", up))
    if name.endswith(".mlp.experts.w13_weight"):  # [E, 2I, H] interleaved -> gate_up_proj (gates first)
        return ((name[: -len("w13_weight")] + "gate_up_proj", deinterleave(tensor, 1)),)
    if name.endswith(".shared_experts.shared_w13_weight"):  # [S, 2I, H] interleaved -> gate_proj, up_proj
        gate, up = deinterleave(tensor, 1).chunk(2, dim=1)
        base = name[: -len("shared_w13_weight")]
        return ((base + "gate_proj", gate), (base + "up_proj", up))
    return ((name, tensor),)
