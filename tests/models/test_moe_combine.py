"""Each MoE block as transformers computes it in bf16, bit for bit: the engine's sparse block against transformers'
on the same bf16 rows, transformers with its default experts implementation (grouped_mm). A router that hands its
experts fp32 weights (DeepSeek-V3's, GLM-4-MoE's, MiniMax-M2's, AFMoE's, HunYuan's with its fp32 `wg`) has each copy
weighed and the k copies summed in fp32, rounded once; a router that casts them (Qwen's, Mellum's, Granite's) has each
copy weighed in bf16 (kernels/fused_moe.combine_copies). The fp32 engine tests cannot tell the two apart; until
session 46 the engine weighed every block's copies in bf16."""

from __future__ import annotations

import pytest
import torch
from helpers.engine_archs import MISSING, _hf
from test_engine_architectures import ENGINE

from replayllm import LLM
from replayllm.model_runner_v2.forward_context import ForwardContext, set_forward_context
from replayllm.model_runner_v2.models.moe import SparseMoeBlock

ARCHS = ["deepseek_v3", "glm4_moe", "minimax_m2", "afmoe", "dots1", "solar_open", "hunyuan_moe", "qwen3_5_moe",
         "mellum", "granitemoe", "flex_olmo", "lara_mini", "axk2-groups", "dots3_note"]


@pytest.mark.parametrize("arch", ARCHS)
def test_the_sparse_block_is_transformers_in_bf16(arch, tmp_path):
    if arch in MISSING:
        pytest.skip(MISSING[arch])
    model = _hf(arch)
    model.save_pretrained(str(tmp_path))  # fp32; each side loads it in bf16 (transformers keeps its fp32 modules)
    hf = type(model).from_pretrained(str(tmp_path), dtype=torch.bfloat16, experts_implementation="grouped_mm").eval()
    llm = LLM(str(tmp_path), **dict(ENGINE, dtype="bfloat16", device="cpu"))  # the rows compared on the CPU
    layers = llm.llm_engine.runner.model.model.layers
    i = next(i for i, layer in enumerate(layers) if isinstance(layer.mlp, SparseMoeBlock))
    x = (torch.randn(9, hf.config.hidden_size, generator=torch.Generator().manual_seed(0)) * 2).to(torch.bfloat16)
    with torch.no_grad(), set_forward_context(ForwardContext(None, [])):
        theirs = getattr(hf.model.layers[i], "mlp", None) or hf.model.layers[i].block_sparse_moe
        theirs = theirs(x[None])
        theirs = (theirs[0] if isinstance(theirs, tuple) else theirs).reshape(x.shape)
        ours = layers[i].mlp(x)
    assert torch.equal(ours, theirs), f"{(ours.float() - theirs.float()).abs().max().item()}"
