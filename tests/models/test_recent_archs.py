"""This session's architectures beyond test_engine_architectures.py's checks (logprobs against transformers, weight
updates, batch invariance): DeepSeek Sparse Attention's context cap (DeepSeek-V3.2, GLM-5), their indexer weights
left out of fp8 checkpoints too, the checkpoint forms of Mellum (its MTP layer), Cohere 2 MoE (per-expert tensors,
the hub's `first_k_dense_replace` alone), A.X-K1 (its layer-level norms, no correction bias), DBRX (its trained
rope theta) and Flint (fp32 sinks and router), CodeGen's fused qkv_proj refused in a wrong shape, and Apertus 1.5's
pruned head (code ids in prompts, never out; its multimodal files; the penalties skipping such ids)."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from helpers.engine_archs import MISSING
from helpers.fp8_checkpoint import save_fp8_checkpoint
from helpers.hf_reference import teacher_forced
from helpers.layer_plan_options import assert_options_refused
from helpers.tolerances import LOGPROB_TOL
from safetensors.torch import load_file, save_file
from test_engine_architectures import ENGINE
from test_engine_architectures import _hf as _engine_hf

from replayllm import LLM, SamplingParams
from replayllm.config import EngineConfig, ModelConfig
from replayllm.model_runner_v2.loader import load_model


def _hf(arch: str, seed: int = 0):
    """engine_archs' small transformers model of `arch`; the test skipped (saying why) where the installed
    transformers lacks the class (the GPU machine's older release)."""
    if arch in MISSING:
        pytest.skip(MISSING[arch])
    return _engine_hf(arch, seed)


def _saved(arch: str, tmp_path_factory) -> tuple[str, object]:
    """(checkpoint directory, the transformers model saved there) of engine_archs' small `arch`."""
    hf = _hf(arch)
    path = tmp_path_factory.mktemp(arch)
    hf.save_pretrained(str(path))
    return str(path), hf


@pytest.fixture(scope="module")
def v32(tmp_path_factory):
    return _saved("deepseek_v32", tmp_path_factory)


def _score(llm: LLM, hf, prompt: list[int], trace: list[int]) -> float:
    """The largest |engine - transformers| logprob over a replayed trace."""
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(trace_decode_token_ids=trace, logprobs=0),
                       use_tqdm=False)[0].outputs[0]
    lp, tokens = teacher_forced(hf, prompt, out.token_ids)
    engine = torch.tensor([d[t].logprob for t, d in zip(out.token_ids, out.logprobs)])
    return (engine - lp[torch.arange(len(tokens)), tokens]).abs().max().item()


def test_dsa_context_defaults_to_index_topk_and_refuses_more(v32, caplog):
    """index_topk (128 here) below max_position_embeddings (256): max_model_len defaults to it, saying so, and a
    longer one is refused naming it (past it the indexer would drop keys: sparse attention, not run here)."""
    path, _ = v32
    with caplog.at_level(logging.WARNING):
        config = EngineConfig(model=path, device="cpu", skip_tokenizer_init=True)
    assert config.model_config.dense_attention_limit == 128 and config.max_model_len == 128
    assert "index_topk=128" in caplog.text
    assert EngineConfig(model=path, device="cpu", skip_tokenizer_init=True, max_model_len=100).max_model_len == 100
    with pytest.raises(ValueError, match="index_topk=128"):
        EngineConfig(model=path, device="cpu", skip_tokenizer_init=True, max_model_len=129)


def test_dsa_within_index_topk_is_dense_mla_as_in_transformers(v32, tmp_path):
    """transformers' DeepSeek-V3.2 with index_topk 8 attends to every key up to 8 tokens and to its indexer's 8 best
    after: the engine (dense MLA, max_model_len 8) meets it on a 3-token prompt and 5 replayed tokens; past 8 tokens
    transformers' own model departs from what a dense model computes (why the context is capped)."""
    _, hf = v32
    hf.config.index_topk = 8
    for layer in hf.model.layers:
        layer.self_attn.indexer.index_topk = 8
    hf.save_pretrained(str(tmp_path / "topk8"))
    llm = LLM(str(tmp_path / "topk8"), **dict(ENGINE, max_model_len=8))
    assert _score(llm, hf, [5, 9, 17], [3, 7, 11, 13, 19]) <= LOGPROB_TOL
    long_prompt = torch.randint(3, 300, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    with pytest.raises(ValueError, match="index_topk=8"):
        LLM(str(tmp_path / "topk8"), **dict(ENGINE, max_model_len=32))
    # the same weights as DeepSeek-V3 (no indexer): what the engine computes at any length
    lp_sparse, _ = teacher_forced(hf, long_prompt[:20], long_prompt[20:])
    for layer in hf.model.layers:
        layer.self_attn.indexer.index_topk = 10_000
    lp_dense, _ = teacher_forced(hf, long_prompt[:20], long_prompt[20:])
    assert (lp_sparse - lp_dense).abs().max().item() > 1e-3


@pytest.mark.parametrize("arch", ["deepseek_v32", "axk2"])
def test_dsa_fp8_checkpoint_skips_the_indexer_and_its_scales(arch, tmp_path_factory, tmp_path):
    """DeepSeek-V3.2's released checkpoints are fp8 blocks: the indexer's projections (and their scales) are left
    out as in bf16; the rest dequantized scores what the dequantized checkpoint scores, bit for bit. A.X-K2's too
    (its q_b_proj's scale renamed with it; the gated norms' MLPs unquantized, as its modules_to_not_convert)."""
    path, _ = _saved(arch, tmp_path_factory)
    assert save_fp8_checkpoint(path, str(tmp_path / "fp8"), str(tmp_path / "plain"), (8, 8)) > 20
    names = load_file(str(tmp_path / "fp8" / "model-00002-of-00002.safetensors"))
    assert any(".indexer." in n and n.endswith("_scale_inv") for n in names)
    g = torch.Generator().manual_seed(4)
    prompts = [{"prompt_token_ids": torch.randint(3, 300, (n,), generator=g).tolist()} for n in (5, 30)]
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=0, ignore_eos=True)
    a = LLM(str(tmp_path / "fp8"), **ENGINE).generate(prompts, params, use_tqdm=False)
    b = LLM(str(tmp_path / "plain"), **ENGINE).generate(prompts, params, use_tqdm=False)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert [d[t].logprob for t, d in zip(x.outputs[0].token_ids, x.outputs[0].logprobs)] == \
            [d[t].logprob for t, d in zip(y.outputs[0].token_ids, y.outputs[0].logprobs)]


def test_mellum_skips_its_mtp_layer(tmp_path):
    hf = _hf("mellum")
    hf.save_pretrained(str(tmp_path))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["mtp.layers.0.self_attn.q_proj.weight"] = torch.zeros(64, 64)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    model = load_model(ModelConfig.from_pretrained(str(tmp_path)), torch.device("cpu"))
    assert torch.equal(model.model.layers[2].mlp.gate.weight, tensors["model.layers.2.mlp.gate.weight"])


def test_cohere2_moe_hub_form(tmp_path):
    """The hub's form: per-expert tensors (Qwen2-MoE's names, as transformers saves them) and a config.json with
    `first_k_dense_replace` alone (no layer_types / mlp_layer_types: transformers' config class derives them)
    scores what transformers scores."""
    hf = _hf("cohere2_moe")
    hf.save_pretrained(str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    for key in ("layer_types", "mlp_layer_types"):
        config.pop(key)
    (tmp_path / "config.json").write_text(json.dumps({**config, "first_k_dense_replace": 1}))
    names = load_file(str(tmp_path / "model.safetensors"))
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in names  # what transformers saves: per expert
    assert ModelConfig.from_pretrained(str(tmp_path)).moe_layers == (1, 2, 3, 4)
    assert _score(LLM(str(tmp_path), **ENGINE), hf, [5, 9, 17, 40, 41, 42, 43, 44, 45, 46, 47],
                  [3, 7, 11, 13, 19]) <= LOGPROB_TOL


def test_codegen_refuses_a_qkv_proj_of_another_shape(tmp_path):
    hf = _hf("codegen")
    hf.save_pretrained(str(tmp_path))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["transformer.h.0.attn.qkv_proj.weight"] = tensors["transformer.h.0.attn.qkv_proj.weight"][:96]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="qkv_proj"):
        load_model(ModelConfig.from_pretrained(str(tmp_path)), torch.device("cpu"))


def test_dbrx_hub_config_takes_its_trained_rope_theta(tmp_path):
    """The hub's config.json keeps DBRX's theta in attn_config.rope_theta alone (transformers 5 would rotate at its
    default 10000): read there when no top-level rope is named; a file naming one keeps it."""
    _hf("dbrx").save_pretrained(str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    config["attn_config"]["rope_theta"] = 123456.0
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert ModelConfig.from_pretrained(str(tmp_path)).hf_config.rope_parameters["rope_theta"] == 500000.0
    del config["rope_parameters"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert ModelConfig.from_pretrained(str(tmp_path)).hf_config.rope_parameters["rope_theta"] == 123456.0


def test_axk1_hub_form(tmp_path):
    """A.X-K1's released form: `post_mlp_layernorm` at the layer level in every layer (the dense layer's unused) and
    no router correction bias (zeros, as transformers leaves it): scores what transformers scores."""
    hf = _hf("axk1")
    with torch.no_grad():
        for name, buffer in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.zero_()
    hf.save_pretrained(str(tmp_path))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    hub = {n.replace(".mlp.post_mlp_layernorm.", ".post_mlp_layernorm."): t for n, t in tensors.items()
           if not n.endswith("e_score_correction_bias")}
    hub["model.layers.0.post_mlp_layernorm.weight"] = torch.full((64,), 7.0)  # the dense layer's: not applied
    assert len(hub) == len(tensors) - 2 + 1
    save_file(hub, str(tmp_path / "model.safetensors"))
    assert _score(LLM(str(tmp_path), **ENGINE), hf, [5, 9, 17, 40, 41, 42], [3, 7, 11, 13]) <= LOGPROB_TOL


def test_flint_keeps_its_sinks_and_router_in_fp32(tmp_path):
    """A bf16 Flint holds its attention sinks (stored as the hub's `softmax_offset`, transformers' `sinks` in memory)
    and its router in fp32, unrounded."""
    _hf("flint").save_pretrained(str(tmp_path))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    sinks = tensors["model.layers.1.self_attn.softmax_offset"]
    model = load_model(ModelConfig.from_pretrained(str(tmp_path), dtype="bfloat16"), torch.device("cpu"))
    layer = model.model.layers[1]
    assert not torch.equal(sinks.bfloat16().float(), sinks)  # what a bf16 rounding would change
    assert layer.self_attn.attn.sinks.dtype == torch.float32 and torch.equal(layer.self_attn.attn.sinks, sinks)
    assert torch.equal(layer.mlp.gate.weight, tensors["model.layers.1.mlp.gate.weight"])
    assert layer.self_attn.qkv_proj.weight.dtype == torch.bfloat16


@pytest.fixture(scope="module")
def apertus1p5(tmp_path_factory):
    return _saved("apertus1p5", tmp_path_factory)


def test_apertus1p5_codes_in_the_prompt_never_out(apertus1p5):
    """Apertus 1.5's head has 300 rows under 400 embedding rows: ids 300-399 (image / audio codes) are prompt tokens
    the engine embeds and transformers scores alike; a trace, prompt_logprobs or a logit bias past 300 is refused."""
    path, hf = apertus1p5
    llm = LLM(path, **ENGINE)
    assert llm.llm_engine.model_config.vocab_size == 300 and llm.llm_engine.model_config.prompt_vocab_size == 400
    prompt = [5, 399, 310, 17, 350, 42]
    assert _score(llm, hf, prompt, [3, 7, 299, 13]) <= LOGPROB_TOL
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(trace_decode_token_ids=[3, 300]), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=2, prompt_logprobs=0), use_tqdm=False)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=2, logit_bias={350: 1.0}),
                     use_tqdm=False)
    with pytest.raises(ValueError, match=r"\[0, 400\)"):
        llm.generate([{"prompt_token_ids": [5, 400]}], SamplingParams(max_tokens=2), use_tqdm=False)


def test_apertus1p5_multimodal_checkpoint_serves_its_language_model(apertus1p5, tmp_path):
    """The released form: `Apertus1p5ForConditionalGeneration` with a `text_config`, the language model under
    `model.language_model.`, the code tokenizers' tensors beside it (skipped)."""
    path, hf = apertus1p5
    with open(f"{path}/config.json") as f:
        text = json.load(f)
    config = {"architectures": ["Apertus1p5ForConditionalGeneration"], "model_type": "apertus1p5",
              "text_config": {k: v for k, v in text.items() if k != "architectures"},
              "tie_word_embeddings": False, "dtype": text.get("dtype", "float32"),
              # codes 300-349 image, 350-399 audio (the wrapper's validation wants both ranges inside the vocabulary)
              "image_token_offset": 300, "audio_token_offset": 350, "vision_config": {"codebook_size": 50},
              "audio_config": {"model_type": "wavtokenizer_encoder", "codebook_size": 50}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = {(n.replace("model.", "model.language_model.", 1) if n.startswith("model.") else n): t
               for n, t in load_file(f"{path}/model.safetensors").items()}
    tensors["model.vision_tokenizer.quantize.embedding.weight"] = torch.zeros(8, 4)
    tensors["model.audio_tokenizer.encoder.weight"] = torch.zeros(4)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    llm = LLM(str(tmp_path), **ENGINE)
    assert llm.llm_engine.model_config.architecture == "Apertus1p5ForConditionalGeneration"
    assert _score(llm, hf, [5, 399, 17, 42], [3, 7, 11]) <= LOGPROB_TOL


def test_penalties_skip_prompt_ids_past_the_logits():
    """A prompt id past the logits' width (an input-only code) counts toward no logit (clamping it would penalise
    the last token)."""
    from replayllm.sampling.ops import apply_penalties

    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    apply_penalties(logits, torch.tensor([[9, 0]]), prompt_len=torch.tensor([2]), total_len=torch.tensor([2]),
                    repetition=torch.tensor([2.0]), frequency=torch.tensor([0.0]), presence=torch.tensor([0.0]))
    assert logits.tolist() == [[0.5, 2.0, 3.0, 4.0]]


@pytest.mark.parametrize("arch, remote", [("sarvam_moe", "SarvamMoEForCausalLM"), ("param2moe", "Param2MoEForCausalLM"),
                                          ("sarvam_mla", "SarvamMLAForCausalLM"),
                                          ("iquestcoder", "IQuestCoderForCausalLM")])
def test_model_types_run_as_their_transformers_class_under_a_remote_code_name(tmp_path, arch, remote):
    """The hubs' config.json names a remote-code class (SarvamMoEForCausalLM, ...); transformers runs the model_type as
    GLM-4-MoE / DeepSeek-V3 / Llama, and so does the engine. Sarvam-30B's and Param2's files keep Bailing-MoE's names
    (a fused query_key_value, word_embeddings, gate.expert_bias), split and renamed at load."""
    hf = _hf(arch)
    hf.save_pretrained(str(tmp_path))
    if arch in ("sarvam_moe", "param2moe"):
        names = set(load_file(f"{tmp_path}/model.safetensors"))
        assert {"model.word_embeddings.weight", "model.layers.1.attention.query_key_value.weight",
                "model.layers.1.mlp.gate.expert_bias"} <= names
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = [remote]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert _score(LLM(str(tmp_path), **ENGINE), hf, [5, 17, 33, 250, 8], [9, 41, 77, 120]) <= LOGPROB_TOL


def test_mimo_v2_flash_hub_form_and_options(tmp_path):
    """The hub's files name the sinks `attention_sink_bias` and carry MTP layers (`model.mtp.*`, skipped as
    transformers skips them): the same logprobs. Its sliding layers cache twice the full layers' KV heads (a block
    sums each layer's shape); piecewise graphs and a tensor-parallel size not dividing a layer's KV heads refused."""
    from replayllm.model_runner_v2.kv_cache import kv_block_bytes

    hf = _hf("mimo_v2_flash")
    hf.save_pretrained(str(tmp_path / "hf"))
    tensors = {k.replace(".self_attn.sinks", ".self_attn.attention_sink_bias"): v
               for k, v in load_file(f"{tmp_path}/hf/model.safetensors").items()}
    assert any(k.endswith("attention_sink_bias") for k in tensors)
    tensors["model.mtp.layers.0.self_attn.q_proj.weight"] = torch.randn(96, 64)
    (tmp_path / "hub").mkdir()
    save_file(tensors, tmp_path / "hub" / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "hub" / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    prompt, trace = [5, 17, 33, 250, 8, 90, 14, 3, 77, 120, 41], [9, 41, 77, 120, 6, 200]
    assert _score(LLM(str(tmp_path / "hub"), **ENGINE), hf, prompt, trace) <= LOGPROB_TOL
    config = assert_options_refused(str(tmp_path / "hub"), [
        (dict(cudagraph_mode="PIECEWISE"), "KV heads differ"),
        (dict(tensor_parallel_size=2), "must divide every MiMo-V2-Flash layer's KV heads, got \\[1\\]")])
    assert config.model_config.kv_layer_shapes == ((1, 24), (2, 24), (2, 24), (1, 24))
    assert kv_block_bytes(config) == 2 * 16 * 4 * 24 * (1 + 2 + 2 + 1)  # K and V, 16 tokens, fp32


def test_longcat_flash_localize_refuses_its_blocks(tmp_path):
    """`replayllm diff --localize` names a layer's attention or MLP: a LongCat-Flash block holds two of each and a
    shortcut MoE, so a clear error rather than a wrong answer."""
    from helpers.localize_fault import assert_localize_finds_layer_1_attention

    _hf("longcat_flash").save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="--localize does not support .* two attention sub-layers"):
        assert_localize_finds_layer_1_attention(str(tmp_path), str(tmp_path))


def test_laguna_refuses_piecewise_graphs(tmp_path):
    """Laguna's layers have their own q head counts (4 and 8 here): piecewise graphs, whose buffers assume one q width,
    are refused and decode steps keep their full graphs; the engine sizes its buffers for the widest layer."""
    _hf("laguna").save_pretrained(str(tmp_path))
    config = assert_options_refused(str(tmp_path), [(dict(cudagraph_mode="FULL_AND_PIECEWISE"), "q heads differ")])
    assert config.model_config.num_heads == 8


def test_openai_gpt_activation_and_checkpoint_forms(tmp_path):
    """GPT-1's `afn`: "gelu" is transformers' gelu_new (the tanh form), "relu" its own (against transformers); the
    double-heads files (the multiple-choice head skipped) and the original names without `transformer.` load the
    same LM."""
    from replayllm.model_runner_v2.models.plain_mlp import ACTIVATIONS

    llm = LLM(_saved_at("openai_gpt", tmp_path / "gelu"), **ENGINE)
    assert llm.llm_engine.runner.model.model.layers[0].mlp.act is ACTIVATIONS["gelu_new"]
    hf = _hf("openai_gpt")
    hf.config.afn = "relu"
    relu = type(hf)(hf.config).eval()
    relu.load_state_dict(hf.state_dict())
    relu.save_pretrained(str(tmp_path / "relu"))
    assert _score(LLM(str(tmp_path / "relu"), **ENGINE), relu, [5, 17, 33, 250, 8], [9, 41, 77, 120]) <= LOGPROB_TOL
    tensors = {k.removeprefix("transformer."): v for k, v in load_file(f"{tmp_path}/relu/model.safetensors").items()}
    tensors["multiple_choice_head.summary.weight"] = torch.randn(1, 64)
    (tmp_path / "double").mkdir()
    save_file(tensors, tmp_path / "double" / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "relu" / "config.json").read_text())
    config["architectures"] = ["OpenAIGPTDoubleHeadsModel"]
    (tmp_path / "double" / "config.json").write_text(json.dumps(config))
    assert _score(LLM(str(tmp_path / "double"), **ENGINE), relu, [5, 17, 33, 250, 8], [9, 41, 77, 120]) <= LOGPROB_TOL


def _saved_at(arch: str, path) -> str:
    _hf(arch).save_pretrained(str(path))
    return str(path)


def test_longcat_flash_skips_zero_experts_weights(tmp_path):
    """transformers 5.17 builds weights for LongCat-Flash's zero (identity) experts and saves them (5.25 does not);
    such files load, those tensors skipped: the same logprobs."""
    hf = _hf("longcat_flash")
    hf.save_pretrained(str(tmp_path))
    tensors = load_file(f"{tmp_path}/model.safetensors")
    for layer in (0, 1):
        for e in (4, 5):  # n_routed_experts 4, zero_expert_num 2
            for proj, shape in (("gate_proj", (32, 64)), ("up_proj", (32, 64)), ("down_proj", (64, 32))):
                tensors[f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"] = torch.randn(shape)
    save_file(tensors, f"{tmp_path}/model.safetensors", metadata={"format": "pt"})
    assert _score(LLM(str(tmp_path), **ENGINE), hf, [5, 17, 33, 250, 8], [9, 41, 77, 120]) <= LOGPROB_TOL


def test_longcat_flash_counts_sub_layers_from_num_layers(tmp_path):
    """LongCat-Flash's blocks are counted by the file's `num_layers`; a file transformers 5.17 saved beside it holds
    that release's unrelated num_hidden_layers default (56 for num_layers=2). The engine builds num_layers blocks and
    2 x num_layers KV layers, as transformers builds, and scores what it scores."""
    import json

    hf = _hf("longcat_flash")
    hf.save_pretrained(str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(config, num_layers=2, num_hidden_layers=56)))
    llm = LLM(str(tmp_path), **ENGINE)
    assert llm.llm_engine.model_config.num_layers == 4 and len(llm.llm_engine.runner.model.model.layers) == 2
    assert _score(llm, hf, [5, 17, 33, 250, 8], [9, 41, 77, 120]) <= LOGPROB_TOL


def test_beam_bf16_keeps_transformers_roundings(tmp_path):
    """A bf16 Beam: the dense SwiGLU gives transformers' bits (the activation times up in fp32, one rounding: the
    engine's fused SiLU-and-mul rounds twice), the router and its correction stay fp32, and the logits come capped
    in fp32 (transformers' tanh after the upcast). The experts' MLP and the post-sum scale sit before a norm that
    cancels a uniform scale: test_engine_architectures' fp32 comparison cannot see them, the norms order can."""
    from replayllm.model_runner_v2.models.layers import SiluAndMul

    hf = _hf("beam").to(torch.bfloat16)
    hf.save_pretrained(str(tmp_path))
    llm = LLM(str(tmp_path), **dict(ENGINE, dtype="bfloat16", device="cpu"))  # the rows compared on the CPU
    model = llm.llm_engine.runner.model
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    dense, reference = model.model.layers[0].mlp, hf.model.layers[0].mlp
    with torch.no_grad():
        ours, theirs = dense.down(dense.gate_up_proj(x)), reference(x)
        twice = dense.down_proj(SiluAndMul()(dense.gate_up_proj(x)))
        assert torch.equal(ours, theirs) and not torch.equal(twice, theirs)
        assert model.model.layers[1].mlp.gate.weight.dtype == torch.float32
        assert model.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32
        logits = model.compute_logits(torch.randn(3, 64).to(torch.bfloat16))
        assert logits.dtype == torch.float32 and logits.abs().max() <= 30.0
