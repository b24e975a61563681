"""Mistral 4 (models/mistral4.py) beyond test_engine_architectures.py[mistral4] (logprobs against transformers, weight
updates, batch invariance): Mistral Small 4's multimodal checkpoint (Mistral3ForConditionalGeneration around a
"mistral4" text model) served as that language model under both namings, its router against transformers' own in
fp32 and bf16, and the routes reported and replayed."""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers.engine_archs import _MLA, ARCHS, MISSING, _hf
from helpers.hf_reference import max_gap_to_transformers, save_both_namings, spread_norms, trace_logprobs
from helpers.moe_routes import assert_routes_match_transformers_and_replay
from helpers.tolerances import LOGPROB_TOL

from replayllm import LLM
from replayllm.config import ModelConfig
from replayllm.model_runner_v2.models.mistral4 import route_softmax_top2_groups

pytestmark = pytest.mark.skipif("mistral4" in MISSING, reason=MISSING.get("mistral4", ""))
ENGINE = dict(device="cpu", dtype="float32", skip_tokenizer_init=True, enable_trace_replay=True, max_model_len=128)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, head_dim=16,
              image_size=28, patch_size=14)


def test_mistral_small_4s_multimodal_checkpoint_is_its_language_model(tmp_path):
    _, _, text = ARCHS["mistral4"]
    text = dict(text, vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                rms_norm_eps=1e-6, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                model_type="mistral4", first_k_dense_replace=1, moe_intermediate_size=32, n_routed_experts=8,
                num_experts_per_tok=2, n_shared_experts=1)
    torch.manual_seed(0)
    config = transformers.Mistral3Config(text_config=text, vision_config=VISION)
    hf = transformers.Mistral3ForConditionalGeneration(config).to(torch.float32).eval()
    spread_norms(hf)
    hub, module = tmp_path / "hub", tmp_path / "module"
    module.mkdir()
    save_both_namings(hf, hub, module)
    mc = ModelConfig.from_pretrained(str(hub))
    assert (mc.architecture, mc.num_layers, mc.moe_layers, mc.num_kv_heads) == ("Mistral4ForCausalLM", 3, (1, 2), 4)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (4, 17, 60)]  # up to 4x the context of 16
    traces = [torch.randint(3, 300, (8,), generator=g).tolist() for _ in prompts]
    runs = [trace_logprobs(LLM(str(path), **ENGINE), prompts, traces) for path in (hub, module)]
    assert runs[0] == runs[1]
    assert max_gap_to_transformers(hf, prompts, traces, runs[0]) <= LOGPROB_TOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_router_is_transformers(dtype):
    """route_softmax_top2_groups against Mistral4TopkRouter on the same gate in the same dtype (its softmax and
    weights in that dtype): the same experts and weights, bit for bit; 16 experts in 4 groups, the best 2."""
    config = transformers.Mistral4Config(**dict(_MLA, hidden_size=32, n_routed_experts=16, num_experts_per_tok=3,
                                                n_group=4, topk_group=2, routed_scaling_factor=1.5))
    torch.manual_seed(0)
    router = transformers.models.mistral4.modeling_mistral4.Mistral4TopkRouter(config).to(dtype)
    torch.nn.init.normal_(router.weight, std=0.5)
    x = torch.randn(60, 32, dtype=dtype)
    with torch.no_grad():
        logits, hf_weights, hf_ids = router(x)
    weights, ids = route_softmax_top2_groups(logits, 3, 4, 2, True, 1.5)
    order, hf_order = ids.argsort(-1), hf_ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), hf_ids.gather(1, hf_order))
    assert torch.equal(weights.gather(1, order), hf_weights.float().gather(1, hf_order))


def test_routes_match_transformers_and_replay_bit_for_bit(tmp_path):
    hf = _hf("mistral4")
    hf.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), **ENGINE, enable_return_routed_experts=True)
    assert_routes_match_transformers_and_replay(llm, hf, dense_layers=(0,), sparse_layers=(1, 2))
