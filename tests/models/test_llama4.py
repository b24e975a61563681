"""Llama 4 (models/llama4.py) beyond test_engine_architectures.py[llama4, llama4-maverick] (logprobs against
transformers, weight updates, batch invariance, TP=2): the multimodal checkpoints (Scout's and Maverick's released
form) served as their language model, the sparse block against transformers' Llama4TextMoe bit for bit, the NoPE
layers' query temperature, chunks only where a sequence can outgrow one, the routes reported and replayed, and the
forms refused."""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers.engine_archs import ARCHS, SMALL, _hf
from helpers.gpt_family import cases
from helpers.hf_reference import max_gap_to_transformers, trace_logprobs
from helpers.moe_routes import assert_routes_match_transformers_and_replay
from helpers.tolerances import LOGPROB_TOL

from replayllm import LLM
from replayllm.model_runner_v2.attention import Attention
from replayllm.model_runner_v2.forward_context import ForwardContext, set_forward_context
from replayllm.model_runner_v2.models.layers import RotaryEmbedding
from replayllm.model_runner_v2.models.llama4 import Llama4ForCausalLM, Llama4MoeBlock, NoPETemperature

modeling_llama4 = pytest.importorskip("transformers.models.llama4.modeling_llama4")
ENGINE = dict(device="cpu", dtype="float32", skip_tokenizer_init=True, enable_trace_replay=True, max_model_len=128)
_TEXT = {**SMALL, **ARCHS["llama4"][2]}
# a vision tower and projector of one small layer: their tensors are in the checkpoint, the engine skips them
_VISION = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=28,
               patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=64)


def test_the_multimodal_checkpoint_serves_its_language_model(tmp_path):
    """Llama4ForConditionalGeneration as the hub ships Scout and Maverick (language_model.* tensors beside
    vision_model.* and the projector's): the engine's logprobs within rounding of transformers' whole model on
    text, and equal to the text-only checkpoint of the same weights."""
    torch.manual_seed(0)
    config = transformers.Llama4Config(text_config=_TEXT, vision_config=_VISION)
    hf = transformers.Llama4ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    hf.save_pretrained(tmp_path / "mm")
    prompts, traces = cases()
    llm = LLM(str(tmp_path / "mm"), **ENGINE)
    assert llm.llm_engine.model_config.architecture == "Llama4ForConditionalGeneration"
    got = trace_logprobs(llm, prompts, traces)
    assert max_gap_to_transformers(hf, prompts, traces, got) <= LOGPROB_TOL
    text = transformers.Llama4ForCausalLM(config.text_config).eval()
    text.load_state_dict(hf.language_model.state_dict())
    text.save_pretrained(tmp_path / "text")
    assert trace_logprobs(LLM(str(tmp_path / "text"), **ENGINE), prompts, traces) == got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_sparse_block_is_transformers(dtype):
    """Llama4MoeBlock (CPU experts) against transformers' Llama4TextMoe on the same weights: the token scaled by
    sigmoid(its top logit) before its expert, the shared expert on the unscaled token; bit for bit."""
    config = transformers.Llama4TextConfig(**_TEXT)
    torch.manual_seed(1)
    theirs = modeling_llama4.Llama4TextMoe(config).to(dtype)
    for param in theirs.parameters():
        torch.nn.init.normal_(param, std=0.3)
    with torch.device("cpu"):
        ours = Llama4MoeBlock(config, 0, dict(num_experts=4, num_experts_per_tok=1, moe_intermediate_size=96,
                                              moe_layers=(0,), norm_topk_prob=False),
                              Llama4ForCausalLM.spec(config)).to(dtype)
    model = Llama4ForCausalLM.__new__(Llama4ForCausalLM)
    params = dict(ours.named_parameters())
    with torch.no_grad():
        for name, tensor in theirs.state_dict().items():
            for hf_name, part in model.checkpoint_parts(f"model.layers.0.feed_forward.{name}", tensor):
                target = hf_name[len("model.layers.0.mlp."):]
                if target.startswith("shared_expert.") and target.split(".")[1] in ("gate_proj", "up_proj"):
                    rows = part.shape[0]
                    offset = 0 if ".gate_proj." in target else rows
                    params["shared_expert.gate_up_proj.weight"][offset:offset + rows] = part
                else:
                    params[target].copy_(part.reshape(params[target].shape))
    x = torch.randn(40, 64, dtype=dtype)
    with set_forward_context(ForwardContext(None, [])):
        got = ours(x)
    want, _ = theirs(x)
    assert torch.equal(got, want)


def test_the_nope_temperature_is_transformers_formula():
    """log1p(floor((p + 1) / floor_scale)) * attn_scale + 1 per token, the product in fp32 rounded once; exactly 1
    (and skipped) while no position reaches floor_scale - 1."""
    temp = NoPETemperature(0.1, 8)
    positions = torch.tensor([0, 6, 7, 15, 100, 8191])
    q = torch.randn(6, 32, dtype=torch.bfloat16)
    factor = torch.log1p(torch.floor((positions.float() + 1.0) / 8)) * 0.1 + 1.0
    assert torch.equal(temp(positions, q), (q * factor[:, None]).to(torch.bfloat16))
    assert torch.equal(temp(positions[:2], q[:2]), q[:2])  # positions 0 and 6: factor 1
    temp.fit_context(7)  # positions <= 6: never scaled
    assert not temp.active
    temp.fit_context(8)
    assert temp.active


def test_chunks_and_temperature_follow_the_served_context(tmp_path):
    """Chunked layers (0 and 2 of the tiny Scout) run the chunk variants only when max_model_len exceeds the chunk
    (8); the NoPE layer's temperature only from floor_scale (4)."""
    _hf("llama4").save_pretrained(tmp_path)
    for max_len, chunked, tempered in ((8, False, True), (9, True, True), (3, False, False)):
        llm = LLM(str(tmp_path), **{**ENGINE, "max_model_len": max_len})
        model = llm.llm_engine.runner.model
        chunks = [m.chunk for m in model.modules() if isinstance(m, Attention)]
        assert chunks == ([8, 0, 8] if chunked else [0, 0, 0])
        assert model.model.layers[1].self_attn.temperature.active == tempered


def test_routes_match_transformers_and_replay_bit_for_bit(tmp_path):
    """The top-1 expert of transformers' router logits (Llama4Router's second output) on the sparse layers 0 and 2,
    -1 on the dense layer 1; replayed bit for bit."""
    hf = _hf("llama4")
    hf.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), **ENGINE, enable_return_routed_experts=True)
    assert llm.llm_engine.model_config.moe_layers == (0, 2)
    assert_routes_match_transformers_and_replay(
        llm, hf, dense_layers=(1,), sparse_layers=(0, 2),
        router=lambda m, i: (m.model.layers[i].feed_forward.router, lambda out: out[1].topk(1, dim=-1).indices))


def test_more_than_one_expert_per_token_is_refused(tmp_path):
    config = transformers.Llama4TextConfig(**{**_TEXT, "num_experts_per_tok": 2})
    transformers.Llama4ForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="num_experts_per_tok=2 is not supported"):
        LLM(str(tmp_path), **ENGINE)


def test_rope_tables_span_the_served_context_not_the_config(tmp_path):
    """Scout's config names 10M positions (~2.7 GB each of cos and sin in fp32, twice with the L2 norms' identity
    rotary): the engine builds every rotary table for max_model_len positions only (loader's
    rotary_table_positions), and a trace that fills the context to its last position still matches transformers."""
    config = transformers.Llama4TextConfig(**{**_TEXT, "max_position_embeddings": 1 << 20})
    torch.manual_seed(0)
    hf = transformers.Llama4ForCausalLM(config).eval()
    hf.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), **{**ENGINE, "max_model_len": 40})
    rotaries = [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, RotaryEmbedding)]
    assert len(rotaries) == 2  # the rope and the identity rotary, shared by the layers
    assert all(r.cos_cache.shape[0] == r.sin_cache.shape[0] == 40 for r in rotaries)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 30)]
    traces = [torch.randint(3, 300, (40 - len(p),), generator=g).tolist() for p in prompts]  # the context filled
    got = trace_logprobs(llm, prompts, traces)
    assert [len(row) for row in got] == [35, 10]
    assert max_gap_to_transformers(hf, prompts, traces, got) <= LOGPROB_TOL
