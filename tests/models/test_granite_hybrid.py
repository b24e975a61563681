"""Granite 4.0 (GraniteMoeHybridForCausalLM, models/granitemoehybrid.py) beyond test_engine_architectures.py
[granitemoehybrid, granitemoehybrid-moe, granitemoeshared] (logprobs against transformers, weight updates, batch
invariance, TP=2): the hybrid checkpoints' Mamba-2 layers with their state, routes of the MoE form recorded."""

from __future__ import annotations

import pytest
import transformers
from helpers.engine_archs import ARCHS, MISSING, SMALL, _hf
from helpers.moe_routes import assert_routes_match_transformers_and_replay

from replayllm import LLM, SamplingParams

ENGINE = dict(device="cpu", dtype="float32", skip_tokenizer_init=True, enable_trace_replay=True, max_model_len=128)


def _needs(arch: str) -> None:
    if arch in MISSING:
        pytest.skip(MISSING[arch])


def test_mamba_layers_keep_a_state_and_no_kv_cache(tmp_path):
    """granite-4.0-h-*: Mamba-2 layers beside the attention ones (released configs' names, one group of B / C here):
    each a Mamba-2 mixer with its state rows bound, the KV cache for the attention layer alone (docs/hybrid_models.md;
    the logprobs against transformers: test_engine_architectures.py[granitemoehybrid-mamba])."""
    _needs("granitemoehybrid")
    config_cls, model_cls, extra = ARCHS["granitemoehybrid"]
    config = config_cls(**{**SMALL, **extra, "layer_types": ["mamba", "attention", "mamba"],
                           "mamba_n_heads": 4, "mamba_d_head": 32, "mamba_n_groups": 1, "mamba_d_state": 16})
    model_cls(config).save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), max_num_seqs=4, **ENGINE)
    runner = llm.llm_engine.runner
    assert llm.llm_engine.model_config.recurrent_layers == (0, 2) and len(runner.kv_caches) == 1
    mixers = [layer.mamba for layer in runner.model.model.layers if layer.mamba is not None]
    assert [tuple(m.conv_state.shape) for m in mixers] == [(5, 3, 128 + 2 * 16)] * 2  # x | B | C, 4 slots + pad
    assert [tuple(m.state.shape) for m in mixers] == [(5, 4, 32, 16)] * 2
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4


def test_the_dense_form_reads_the_shared_width(tmp_path):
    """granite-4.0-micro: no experts, each layer's MLP the shared one, of shared_intermediate_size (80 here), not
    intermediate_size (96); a dense model (no routes to return)."""
    _needs("granitemoehybrid")
    _hf("granitemoehybrid").save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), **ENGINE)
    assert not llm.llm_engine.model_config.is_moe
    mlp = llm.llm_engine.runner.model.model.layers[0].mlp
    assert mlp.gate_up_proj.weight.shape == (160, 64)
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        LLM(str(tmp_path), **ENGINE, enable_return_routed_experts=True)


@pytest.mark.parametrize("arch", ["granitemoehybrid-moe", "granitemoeshared"])
def test_routes_match_transformers_and_replay_bit_for_bit(tmp_path, arch):
    """The top-2 experts of transformers' router in every layer; replayed bit for bit."""
    _needs(arch)
    hf = _hf(arch)
    hf.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), **ENGINE, enable_return_routed_experts=True)
    assert llm.llm_engine.model_config.moe_layers == (0, 1, 2)
    assert_routes_match_transformers_and_replay(
        llm, hf, dense_layers=(), sparse_layers=(0, 1, 2),
        router=lambda m, i: (m.model.layers[i].block_sparse_moe.router, _top2_of(hf.config.num_local_experts)))


def _top2_of(num_experts: int):
    """The router's two best experts from its logits [T, E]: transformers 5.25's router returns (logits, weights,
    ids), older ones (the GPU machine's 5.17) (sorted experts, batch index, gates, sizes, logits); the logits are
    the one [T, E] output in both."""
    def ids(out: tuple) -> object:
        logits = next(t for t in out if t.dim() == 2 and t.shape[-1] == num_experts)
        return logits.topk(2, dim=-1).indices
    return ids


def test_the_transformers_class_names_the_layer_types_we_refuse():
    """transformers normalises the released configs' "mamba" / "attention" to "linear_attention" /
    "full_attention": both spellings are what the engine checks."""
    _needs("granitemoehybrid")
    config = transformers.GraniteMoeHybridConfig(num_hidden_layers=2, layer_types=["mamba", "attention"])
    assert list(config.layer_types) == ["linear_attention", "full_attention"]
