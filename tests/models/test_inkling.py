"""Inkling beyond test_engine_architectures.py's comparison with transformers (and test_hybrid_models.py's same bits
however its tokens are cut into steps): its learned scalars away from 1 and a padded head against transformers, the
hub's multimodal tensor names with MTP layers, each layer's KV cache and convolution history, and what the engine
refuses (tensor parallelism, CUDA graphs, configs it cannot honour)."""

from __future__ import annotations

import pytest
import torch
from helpers.engine_archs import ENGINE, MISSING, _hf
from helpers.hf_reference import teacher_forced
from safetensors.torch import load_file, save_file

from replayllm import LLM, SamplingParams
from replayllm.config import EngineConfig
from replayllm.model_runner_v2.models.inkling import InklingForCausalLM

pytestmark = pytest.mark.skipif("inkling" in MISSING, reason=MISSING.get("inkling", ""))


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("inkling"))
    _hf("inkling").save_pretrained(out)
    return out


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 280, (n,), generator=g).tolist() for n in (6, 23)]


def _replay(llm: LLM) -> list:
    g = torch.Generator().manual_seed(6)
    params = [SamplingParams(trace_decode_token_ids=torch.randint(3, 280, (7,), generator=g).tolist(), logprobs=2)
              for _ in _prompts()]
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)
    return [[{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs] for o in outs]


def test_scalars_and_a_padded_head_match_transformers(tmp_path):
    """The dense MLPs' and the routers' global_scale away from 1, a head padded past unpadded_vocab_size=290: greedy
    tokens below it and transformers' logprobs (its logits cut at 290, the engine's -inf past it)."""
    hf = _hf("inkling")
    hf.config.unpadded_vocab_size = 290
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith("global_scale"):
                param.uniform_(0.5, 1.5)
    hf.save_pretrained(str(tmp_path))
    llm = LLM(str(tmp_path), **ENGINE)
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()],
                        SamplingParams(temperature=0, max_tokens=8, logprobs=0, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(_prompts(), outs):
        comp = out.outputs[0]
        assert max(comp.token_ids) < 290
        lp, tokens = teacher_forced(hf, prompt, comp.token_ids)
        assert lp.shape[-1] == 290
        engine = torch.tensor([d[t].logprob for t, d in zip(comp.token_ids, comp.logprobs)])
        assert (engine - lp[torch.arange(len(tokens)), tokens]).abs().max().item() <= 1e-4


def test_the_hub_form_with_mtp_layers(path, tmp_path):
    """The text model's weights in the multimodal wrapper, saved as transformers saves it (the hub's form:
    `model.llm.*`, `attn.wq_du`, gate | up interleaved in w13 tensors, towers beside) with an MTP layer's tensor
    added (skipped): the text checkpoint's logprobs, bit for bit."""
    import transformers

    text = transformers.InklingForCausalLM.from_pretrained(path)
    wrapper = transformers.InklingForConditionalGeneration(transformers.InklingConfig(
        text_config=text.config.to_dict(), audio_config=dict(n_mel_bins=4, mel_vocab_size=8), vision_config=dict(
            hidden_size=16, num_hidden_layers=4, patch_size=4, temporal_patch_size=2, num_attention_heads=2)))
    wrapper.model.language_model.load_state_dict(text.model.state_dict())
    wrapper.lm_head.load_state_dict(text.lm_head.state_dict())
    wrapper.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    assert "model.llm.layers.1.mlp.experts.w13_weight" in tensors and "model.llm.layers.0.mlp.w13_dn.weight" in tensors
    tensors["model.mtp.0.attn_norm.weight"] = torch.ones(64)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    assert _replay(LLM(str(tmp_path), **ENGINE)) == _replay(LLM(path, **ENGINE))


def test_a_kv_cache_per_layer_shape_and_one_convolution_history_per_layer(path):
    llm = LLM(path, max_num_seqs=4, **ENGINE)
    runner = llm.llm_engine.runner
    # full layers 2 KV heads of 16, the sliding one 4 of 8: [2, blocks, block_size, Hkv, D]
    assert [tuple(c.shape[3:]) for c in runner.kv_caches] == [(2, 16), (4, 8), (2, 16)]
    # 5 slots (4 + the padding slot), 3 inputs of history, k | v (32 each, the widest kind) | attn out | MLP out (64)
    assert [tuple(layer.conv_state.shape) for layer in runner.model.model.layers] == [(5, 3, 192)] * 3
    assert llm.llm_engine.config.cudagraph_mode == "NONE"


def test_refusals(path, tmp_path):
    with pytest.raises(ValueError, match="tensor_parallel_size=2 is not supported with Inkling"):
        EngineConfig(model=path, device="cpu", skip_tokenizer_init=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="cudagraph_mode='FULL_DECODE_ONLY' is not supported with Inkling"):
        EngineConfig(model=path, device="cpu", skip_tokenizer_init=True, cudagraph_mode="FULL_DECODE_ONLY")
    config = _hf("inkling").config
    config.shared_expert_sink = False
    with pytest.raises(ValueError, match="shared_expert_sink=false is not supported"):
        InklingForCausalLM(config)
    config = _hf("inkling").config
    config.layer_types = ["hybrid", "full_attention", "hybrid"]
    with pytest.raises(ValueError, match="layer_types"):
        InklingForCausalLM(config)
