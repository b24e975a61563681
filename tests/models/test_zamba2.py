"""Zamba2 beyond test_engine_architectures' (its logprobs against transformers' stepwise forward, weight updates from a
transformers module, batch invariance) and test_hybrid_models' (the same bits however the tokens are cut into steps):
a KV cache per application of a shared block and a state in every layer, a checkpoint that repeats the tied blocks
under every hybrid layer (a state dict's form), and the options refused."""

from __future__ import annotations

import json

import pytest
from helpers.engine_archs import ENGINE, MISSING, _hf
from helpers.hf_reference import save_both_namings, trace_logprobs

from replayllm import LLM
from replayllm.config import EngineConfig


@pytest.fixture(scope="module")
def zamba2(tmp_path_factory):
    if "zamba2" in MISSING:
        pytest.skip(MISSING["zamba2"])
    hf = _hf("zamba2")
    hub, module = tmp_path_factory.mktemp("zamba2-hub"), tmp_path_factory.mktemp("zamba2-module")
    state = save_both_namings(hf, hub, module)
    return hub, module, state


def test_a_kv_cache_per_application_and_a_state_in_every_layer(zamba2):
    """Layers 1, 3 and 4 apply blocks 0, 1, 0: three KV caches (4 heads of 2 x 64 / 4 = 32), six Mamba states (8
    heads of 16 x 16); each application its own KV layer, block 0 serving hybrid layers 0 and 2 with their adapters."""
    hub, _, _ = zamba2
    llm = LLM(str(hub), max_num_seqs=4, **ENGINE)
    runner, mc = llm.llm_engine.runner, llm.llm_engine.model_config
    assert mc.recurrent_layers == tuple(range(6)) and mc.shared_block_layers == (1, 3, 4) and mc.num_kv_layers == 3
    assert [tuple(c.shape[3:]) for c in runner.kv_caches] == [(4, 32)] * 3
    assert [tuple(layer.mamba.state.shape) for layer in runner.model.model.layers] == [(5, 8, 16, 16)] * 6
    blocks = runner.model.model.blocks
    assert [[a.layer_idx for a in b.self_attn.visits] for b in blocks] == [[0, 2], [1]]
    assert sorted(blocks[0].feed_forward.gate_up_proj_adapter_list) == ["0", "2"]


def test_every_tied_copy_in_the_checkpoint_loads_the_same_model(zamba2):
    """save_pretrained keeps a block once (under layer 1 for block 0); a state dict repeats it under layer 4, with
    every adapter of the block: both load to the same logprobs, bit for bit."""
    hub, module, state = zamba2
    assert "model.layers.4.shared_transformer.self_attn.q_proj.weight" in state
    prompts, traces = [[5, 17, 33, 250, 8, 91], [7, 3]], [[9, 41, 77, 120, 3], [200, 11, 4]]
    assert trace_logprobs(LLM(str(module), **ENGINE), prompts, traces) == trace_logprobs(
        LLM(str(hub), **ENGINE), prompts, traces)


def test_tensor_parallelism_missing_adapters_and_a_long_context_rope_are_refused(zamba2, tmp_path):
    hub, _, state = zamba2
    with pytest.raises(ValueError, match="Zamba2's shared blocks"):
        EngineConfig(model=str(hub), device="cpu", skip_tokenizer_init=True, tensor_parallel_size=2)
    from safetensors.torch import save_file

    for f in hub.iterdir():
        if f.name != "model.safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    save_file({n: t for n, t in state.items() if "adapter_list.2." not in n}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing .*adapter_list\.2\."):
        LLM(str(tmp_path), **ENGINE)
    config = json.loads((hub / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(config, use_long_context=True)))
    with pytest.raises(ValueError, match="use_long_context"):  # transformers: a rescaled theta said, not applied
        LLM(str(tmp_path), **ENGINE)

