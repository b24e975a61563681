"""LLM.load_weights (issue 29): a trainer's new weights go into the engine in place — the whole model or a
subset, from a module, a state dict or (name, tensor) pairs — all checked before any is copied, so a bad
update changes nothing; the engine then computes exactly what an engine built from those weights computes."""

from __future__ import annotations

import pytest
import torch
from helpers.hf_reference import _HF_CLASSES, tiny_configs
from helpers.trace_replay_common import DEVICE, _full, _tiny

PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]},
           {"prompt_token_ids": [30, 31, 32]}]


def _params():
    from replayllm import SamplingParams

    # Prompts computed in full every time (no cached blocks): runs before and after compare like with like.
    return SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True, skip_reading_prefix_cache=True)


def _other_model(name: str, seed: int = 7):
    """A transformers model of the same config as tiny_models[name], other random weights."""
    torch.manual_seed(seed)
    return _HF_CLASSES[name](tiny_configs()[name]).to(torch.float32).eval()


def _outputs(llm):
    return [(o.outputs[0].token_ids, _full(o.outputs[0])) for o in llm.generate(PROMPTS, _params(), use_tqdm=False)]


@pytest.mark.parametrize("name", ["qwen3", "llama"])
def test_full_update_equals_an_engine_built_from_those_weights(tiny_models, tmp_path, name):
    other = _other_model(name)
    other.save_pretrained(str(tmp_path / "other"), safe_serialization=True)
    llm = _tiny(tiny_models[name])
    before = _outputs(llm)
    # Every tensor of the state dict counts, but a tied model's lm_head.weight (skipped: the embedding is the head)
    names = [k for k in other.state_dict() if not (k == "lm_head.weight" and other.config.tie_word_embeddings)]
    assert llm.load_weights(other) == len(names) == len(dict(other.named_parameters()))
    after = _outputs(llm)
    assert after != before
    assert after == _outputs(_tiny(str(tmp_path / "other")))  # the same computation on the same weights: exact


def test_partial_update_and_every_input_form(tiny_models):
    llm = _tiny(tiny_models["llama"])
    model = llm.llm_engine.runner.model
    # The source in the engine's dtype, the tensors it is compared with (load_weights casts in the copy: exact).
    other = {k: v.to(model.lm_head.weight.device, model.lm_head.weight.dtype)
             for k, v in _other_model("llama").state_dict().items()}
    qkv = model.model.layers[0].self_attn.qkv_proj.weight
    q_rows = model.model.layers[0].self_attn.q_size
    k_before = qkv[q_rows:].clone()
    down = model.model.layers[1].mlp.down_proj.weight
    down_before = down.clone()
    # One fused part (k_proj) as a pair list: only its rows of qkv_proj change.
    assert llm.load_weights([("model.layers.0.self_attn.q_proj.weight",
                              other["model.layers.0.self_attn.q_proj.weight"])]) == 1
    assert torch.equal(qkv[:q_rows], other["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(qkv[q_rows:], k_before)
    # A dict in another dtype: cast in the copy.
    llm.load_weights({"model.layers.1.mlp.down_proj.weight": other["model.layers.1.mlp.down_proj.weight"].double()})
    assert torch.equal(down, other["model.layers.1.mlp.down_proj.weight"]) and not torch.equal(down, down_before)


def test_bad_name_or_shape_changes_nothing(tiny_models):
    llm = _tiny(tiny_models["qwen3"])
    before = _outputs(llm)
    other = _other_model("qwen3").state_dict()
    good = ("model.layers.0.mlp.up_proj.weight", other["model.layers.0.mlp.up_proj.weight"])
    with pytest.raises(ValueError, match="model.layers.9.mlp.up_proj.weight"):
        llm.load_weights([good, ("model.layers.9.mlp.up_proj.weight", good[1])])
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(3,\)"):
        llm.load_weights([good, ("model.norm.weight", torch.ones(3))])
    with pytest.raises(ValueError, match=r"weights\[1\] must be a \(name, tensor\) pair"):
        llm.load_weights([good, ("model.norm.weight",)])
    with pytest.raises(ValueError, match=r"'model.norm.weight' must be a torch.Tensor, got list"):
        llm.load_weights([good, ("model.norm.weight", [1.0])])
    with pytest.raises(ValueError, match=r"'model.norm.weight' must be a torch.Tensor, got ndarray"):
        llm.load_weights({"model.norm.weight": torch.ones(64).numpy()})
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(\)"):  # a scalar: no IndexError
        llm.load_weights([good, ("model.norm.weight", torch.tensor(1.0))])
    with pytest.raises(ValueError, match="got NoneType"):
        llm.load_weights(None)
    assert _outputs(llm) == before  # the good tensor listed first was not applied either


def test_prefix_cache_dropped_and_busy_engine_refused(tiny_models):
    from replayllm import SamplingParams

    llm = _tiny(tiny_models["qwen3"])
    llm.generate(PROMPTS, _params(), use_tqdm=False)
    engine = llm.llm_engine
    assert engine.block_manager.cached  # the 17-token prompt filled a block (cached, though not read back)
    llm.load_weights([])
    assert not engine.block_manager.cached  # its KV came from the old weights
    engine.add_request("busy", PROMPTS[0], SamplingParams(max_tokens=5))
    with pytest.raises(ValueError, match="idle engine"):
        llm.load_weights([])
    engine.abort_request("busy")


def test_reset_prefix_cache_as_vllm(tiny_models):
    """LLM.reset_prefix_cache (vLLM's; RL scripts call it after a weight sync): a prompt seen before is served
    from the cache until the reset, then computed afresh; False, and nothing dropped, while a request holds
    blocks; an error after shutdown."""
    from replayllm import SamplingParams

    llm = _tiny(tiny_models["qwen3"])
    prompt, params = {"prompt_token_ids": list(range(3, 40))}, SamplingParams(temperature=0, max_tokens=2)
    llm.generate(prompt, params, use_tqdm=False)
    assert llm.generate(prompt, params, use_tqdm=False)[0].num_cached_tokens > 0
    assert llm.reset_prefix_cache() is True
    assert llm.generate(prompt, params, use_tqdm=False)[0].num_cached_tokens == 0
    engine = llm.llm_engine
    engine.add_request("busy", PROMPTS[0], SamplingParams(max_tokens=5))
    cached = dict(engine.block_manager.cached)
    assert llm.reset_prefix_cache() is False and engine.block_manager.cached == cached
    engine.abort_request("busy")
    llm.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        llm.reset_prefix_cache()


def test_apply_model_as_vllm(tiny_models):
    """LLM.apply_model(func) (vLLM's): func gets the model and its result comes back in a list; an in-place change
    shows in the next generate (the prefix cache dropped: no stale KV), the same as load_weights of that tensor;
    a clear error under tensor parallelism and after shutdown."""
    from replayllm import LLM, SamplingParams

    llm = _tiny(tiny_models["qwen3"])
    prompt, params = {"prompt_token_ids": list(range(3, 40))}, SamplingParams(temperature=0, max_tokens=3, logprobs=1)
    before = llm.generate(prompt, params, use_tqdm=False)[0]
    [count] = llm.apply_model(lambda m: sum(p.numel() for p in m.parameters()))
    assert count == sum(p.numel() for p in llm.llm_engine.runner.model.parameters()) > 0
    layer = "model.layers.1.mlp.down_proj.weight"
    new = llm.apply_model(lambda m: dict(m.named_parameters())[layer].detach().cpu() * 0.5)[0]
    llm.apply_model(lambda m: dict(m.named_parameters())[layer].data.mul_(0.5))
    after = llm.generate(prompt, params, use_tqdm=False)[0]
    assert after.num_cached_tokens == 0
    assert after.outputs[0].logprobs[0] != before.outputs[0].logprobs[0]
    twin = _tiny(tiny_models["qwen3"])
    twin.load_weights([(layer, new)])
    same = twin.generate(prompt, params, use_tqdm=False)[0]
    assert (same.outputs[0].token_ids, same.outputs[0].logprobs[0]) == (after.outputs[0].token_ids,
                                                                        after.outputs[0].logprobs[0])
    tp = LLM(tiny_models["qwen3"], device="cpu", dtype="float32", skip_tokenizer_init=True, max_model_len=64,
             tensor_parallel_size=2)
    try:
        with pytest.raises(ValueError, match="tensor_parallel_size=2.*load_weights"):
            tp.apply_model(lambda m: None)
    finally:
        tp.llm_engine.shutdown()
    llm.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        llm.apply_model(lambda m: None)


def test_tied_embedding_refreshes_the_fp32_head_copy(tiny_models):
    """bf16 engine with enable_fp32_lm_head on a tied model: the head is an fp32 copy of the embedding, which an
    update of the embedding must refresh."""
    from replayllm import LLM

    llm = LLM(tiny_models["qwen3"], device="cpu", dtype="bfloat16", enable_fp32_lm_head=True, max_model_len=64,
              skip_tokenizer_init=True)
    model = llm.llm_engine.runner.model
    new_embed = _other_model("qwen3").state_dict()["model.embed_tokens.weight"]
    llm.load_weights([("model.embed_tokens.weight", new_embed)])
    assert model.lm_head.weight.dtype == torch.float32
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight.float())


def test_a_tied_models_head_alone_is_skipped_counted_zero_and_named(tiny_models, caplog):
    """vLLM skips lm_head.weight on a tied model (the embedding is the head): load_weights counts it as not applied
    (it said 1 before) and a warning names the tensor to update instead."""
    llm = _tiny(tiny_models["qwen3"])
    assert llm.llm_engine.model_config.hf_config.tie_word_embeddings
    embed = llm.llm_engine.runner.model.model.embed_tokens.weight.clone()
    with caplog.at_level("WARNING", logger="replayllm.model_runner_v2.models.weight_update"):
        assert llm.load_weights({"lm_head.weight": torch.zeros_like(embed)}) == 0
    assert "'lm_head.weight' skipped" in caplog.text and "model.embed_tokens.weight" in caplog.text
    assert torch.equal(llm.llm_engine.runner.model.model.embed_tokens.weight, embed)
    caplog.clear()  # with the embedding in the same update (a trainer's whole state dict, every RL step): no warning
    with caplog.at_level("WARNING", logger="replayllm.model_runner_v2.models.weight_update"):
        assert llm.load_weights({"lm_head.weight": embed, "model.embed_tokens.weight": embed}) == 1
    assert "skipped" not in caplog.text


def test_quantized_engine_is_refused(tiny_models):
    llm = _tiny(tiny_models["qwen3"], quantization="int8")
    with pytest.raises(ValueError, match="quantization"):
        llm.load_weights([])


@pytest.mark.skipif(DEVICE == "cuda" and torch.cuda.device_count() < 2,
                    reason="tensor_parallel_size=2 on CUDA needs 2 GPUs (the CPU run covers it with gloo)")
def test_tensor_parallel_workers_take_their_slices(tiny_models, tmp_path):
    other = _other_model("qwen3")
    other.save_pretrained(str(tmp_path / "other"), safe_serialization=True)
    llm = _tiny(tiny_models["qwen3"], tensor_parallel_size=2)
    try:
        llm.load_weights(other)
        after = _outputs(llm)
    finally:
        llm.shutdown()
    fresh = _tiny(str(tmp_path / "other"), tensor_parallel_size=2)
    try:
        assert after == _outputs(fresh)
    finally:
        fresh.shutdown()
