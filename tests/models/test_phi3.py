"""Phi3ForCausalLM beyond the logits (tests/models/test_models.py compares those with transformers): a checkpoint's
fused qkv_proj / gate_up_proj split into parts, in-place weight updates from a transformers module, the sliding
window's cap, what is refused, tensor parallelism. Phi-4-mini's partial longrope: test_rope_scaling.py and
test_engine_architectures.py."""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers.tolerances import LOGPROB_TOL

from replayllm import LLM, SamplingParams

SMALL = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, rms_norm_eps=1e-5, initializer_range=0.5, max_position_embeddings=128,
             pad_token_id=0, bos_token_id=1, eos_token_id=2, dtype="float32")
PROMPTS = [{"prompt_token_ids": [5 + i, 40, 77, 120 + i]} for i in range(3)]


def _phi3(seed: int = 0, **kw) -> transformers.Phi3ForCausalLM:
    torch.manual_seed(seed)
    return transformers.Phi3ForCausalLM(transformers.Phi3Config(**{**SMALL, **kw})).to(torch.float32).eval()


def _outputs(llm: LLM) -> list:
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, ignore_eos=True)
    return [(o.outputs[0].token_ids, [sorted(d.items()) for d in o.outputs[0].logprobs])
            for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_an_engine_generates_what_transformers_scores_within_the_window(tmp_path):
    """disable_sliding_window caps max_model_len at sliding_window 16 (full attention is the same computation
    there, as Mistral's; past it: tests/models/test_sliding_window.py); greedy tokens and logprobs against
    transformers' teacher-forced log_softmax, which applies the window."""
    hf = _phi3(sliding_window=16)
    hf.save_pretrained(str(tmp_path / "m"))
    llm = LLM(str(tmp_path / "m"), device="cpu", dtype="float32", skip_tokenizer_init=True, disable_sliding_window=True)
    assert llm.llm_engine.config.max_model_len == 16
    prompt = [7, 99, 140, 3, 250, 18, 61, 205, 12, 33]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=6, temperature=0.0, logprobs=0,
                                                                    ignore_eos=True), use_tqdm=False)[0].outputs[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt + list(out.token_ids)])).logits[0].float(), -1)
    for i, tok in enumerate(out.token_ids):
        row = ref[len(prompt) - 1 + i]
        assert row.max().item() - row[tok].item() <= LOGPROB_TOL
        assert abs(out.logprobs[i][tok].logprob - row[tok].item()) <= LOGPROB_TOL


def test_load_weights_from_a_transformers_module_equals_its_checkpoint(tmp_path):
    """LLM.load_weights takes the trainer's fused tensors part by part: the engine then computes exactly what an
    engine built from that module's checkpoint computes."""
    _phi3(0).save_pretrained(str(tmp_path / "a"))
    other = _phi3(1)
    other.save_pretrained(str(tmp_path / "b"))
    llm = LLM(str(tmp_path / "a"), device="cpu", dtype="float32", skip_tokenizer_init=True)
    before = _outputs(llm)
    assert llm.load_weights(other) > 0
    after = _outputs(llm)
    assert after != before
    assert after == _outputs(LLM(str(tmp_path / "b"), device="cpu", dtype="float32", skip_tokenizer_init=True))


def test_a_fused_tensor_of_the_wrong_size_is_named_and_changes_nothing(tmp_path):
    _phi3(0).save_pretrained(str(tmp_path / "a"))
    llm = LLM(str(tmp_path / "a"), device="cpu", dtype="float32", skip_tokenizer_init=True)
    before = _outputs(llm)
    bad = {"model.layers.0.self_attn.qkv_proj.weight": torch.zeros(100, 64)}  # needs 4*16 + 2*2*16 = 128 rows
    with pytest.raises(ValueError, match=r"qkv_proj.weight.*100 rows.*64 \+ 32 \+ 32 = 128"):
        llm.load_weights(bad)
    with pytest.raises(ValueError, match=r"gate_up_proj.weight.*96 \+ 96"):
        llm.load_weights({"model.layers.1.mlp.gate_up_proj.weight": torch.zeros(96, 64)})
    assert _outputs(llm) == before


def test_tensor_parallel_2_matches_1(tmp_path):
    """TP=2 on CPU (gloo): the fused checkpoint's parts are each sliced by rank (q/k/v heads, gate/up columns),
    so greedy tokens equal TP=1's and logprobs agree within rounding (only the row-parallel sums' order differs);
    in-place weight updates from a transformers module reach both ranks."""
    _phi3(0).save_pretrained(str(tmp_path / "a"))
    opts = dict(device="cpu", dtype="float32", skip_tokenizer_init=True)
    one = LLM(str(tmp_path / "a"), **opts)
    two = LLM(str(tmp_path / "a"), tensor_parallel_size=2, **opts)
    try:
        before = _check_same(one, two)
        assert one.load_weights(_phi3(1)) > 0 and two.load_weights(_phi3(1)) > 0
        assert _check_same(one, two) != before
    finally:
        two.llm_engine.shutdown()


def _check_same(one: LLM, two: LLM) -> list:
    """TP=1's outputs, after asserting TP=2's tokens and top-2 ids equal them and its logprobs are within rounding."""
    ref, got = _outputs(one), _outputs(two)
    assert [t for t, _ in got] == [t for t, _ in ref]
    for (_, lp_ref), (_, lp_got) in zip(ref, got):
        for d_ref, d_got in zip(lp_ref, lp_got):
            assert [t for t, _ in d_got] == [t for t, _ in d_ref]
            assert max(abs(x.logprob - y.logprob) for (_, x), (_, y) in zip(d_ref, d_got)) <= LOGPROB_TOL
    return ref
