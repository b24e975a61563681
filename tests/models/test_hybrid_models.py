"""Hybrid models (Qwen3-Next, Qwen3.5, Qwen3.5-MoE: Gated DeltaNet layers beside gated attention; Granite 4.0-H,
NemotronH (and its MoE form): Mamba-2 beside attention; LFM2: short convolutions beside attention) in the engine,
beyond test_engine_architectures.py's comparison with transformers: the options they rule out, the KV cache only for
the full-attention layers and the recurrent state beside it, the same bits however a request's tokens are cut into
steps (chunked prefill, fast replay, a batch around it, preemption), sleep mode, the hub's multimodal and
fused-experts checkpoints, NemotronH's routes, Lara-4-Mini's fused DeltaNet checkpoints and bf16 gated norm."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from helpers.engine_archs import ENGINE, MISSING, _hf
from safetensors.torch import load_file, save_file

from replayllm import LLM, SamplingParams
from replayllm.config import EngineConfig
from replayllm.entrypoints.bench.roofline import ModelCost
from replayllm.hybrid_facts import layer_types, recurrent_layers
from replayllm.model_runner_v2.models.nemotron_h import NemotronHForCausalLM
from replayllm.model_runner_v2.recurrent_state import state_bytes

pytestmark = pytest.mark.skipif("qwen3_5" in MISSING, reason=MISSING.get("qwen3_5", ""))


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict:
    out = {}
    for arch in ("qwen3_5", "qwen3_5_moe", "granitemoehybrid-mamba", "nemotron_h", "lfm2", "lfm2_moe",
                 "nemotron_h-moe", "falcon_h1", "olmo_hybrid", "jamba", "mamba", "mamba2", "lara_mini",
                 "minimax_text", "zamba2", "bailing_hybrid", "qwen4_exp", "inkling"):
        if arch in MISSING:
            continue
        path = str(tmp_path_factory.mktemp(arch))
        _hf(arch).save_pretrained(path)
        out[arch] = path
    return out


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in (3, 19, 37)]


def _replay(llm: LLM, chunk: int = 1, trace_len: int = 9) -> list:
    """Trace-replay logprobs (top 3) of _prompts() with random traces: one token a step, or `chunk` (fast replay)."""
    g = torch.Generator().manual_seed(12)
    params = [SamplingParams(trace_decode_token_ids=torch.randint(3, 300, (trace_len,), generator=g).tolist(),
                             logprobs=3, trace_replay_chunk_size=chunk) for _ in _prompts()]
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)
    return [[{t: (lp.logprob, lp.rank) for t, lp in d.items()} for d in o.outputs[0].logprobs] for o in outs]


def test_options_a_recurrent_state_rules_out(paths, caplog):
    path = paths["qwen3_5"]
    with caplog.at_level(logging.WARNING, logger="replayllm.hybrid_facts"):
        config = EngineConfig(model=path, device="cpu", skip_tokenizer_init=True)
    assert config.model_config.recurrent_layers == (0, 2) and config.model_config.num_kv_layers == 1
    assert config.enable_prefix_caching is False and "prefix caching is off" in caplog.text
    assert config.cudagraph_mode == "FULL_DECODE_ONLY"
    for bad, says in ((dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}), "speculative"),
                      (dict(tensor_parallel_size=4), "must divide the linear layers' .*linear_num_key_heads"),
                      (dict(cudagraph_mode="FULL_AND_PIECEWISE"), "cudagraph_mode")):
        with pytest.raises(ValueError, match=says):
            EngineConfig(model=path, device="cpu", skip_tokenizer_init=True, **bad)


def test_a_model_without_attention_layers_is_refused(tmp_path):
    import transformers

    if not hasattr(transformers, "NemotronHConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no NemotronHConfig")
    transformers.NemotronHConfig(hybrid_override_pattern="MM", hidden_size=64, mamba_num_heads=8, mamba_head_dim=16,
                                 ssm_state_size=16, n_groups=2, vocab_size=300,
                                 architectures=["NemotronHForCausalLM"]).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no attention layer"):
        EngineConfig(model=str(tmp_path), device="cpu", skip_tokenizer_init=True)


def test_layer_kinds_in_every_spelling():
    """hybrid_facts.layer_types: Granite 4.0-H's released names ("mamba" / "attention"), transformers 5.25's, and
    NemotronH's hub pattern string; a kind the model does not build is a ValueError naming the list."""
    def config(**kw):
        return SimpleNamespace(num_hidden_layers=4, **kw)

    lin, full = "linear_attention", "full_attention"
    assert layer_types(config(layer_types=["mamba", "attention", "mamba", "mamba"])) == [lin, full, lin, lin]
    assert layer_types(config(layer_types=[lin, full, lin, lin])) == [lin, full, lin, lin]
    nemotron = config(hybrid_override_pattern="M*-E")
    assert layer_types(nemotron, (lin, full, "mlp", "moe")) == [lin, full, "mlp", "moe"]
    assert recurrent_layers("NemotronHForCausalLM", nemotron) == (0,)
    with pytest.raises(ValueError, match="layer kinds"):
        layer_types(nemotron)  # Qwen's and Granite's layers are attention or linear only
    qwen = config(linear_num_value_heads=4, full_attention_interval=2)  # Qwen3-Next's rule derives the list
    assert layer_types(qwen) == [lin, full, lin, full]
    with pytest.raises(ValueError, match="names no layer_types"):
        layer_types(config(mamba_n_heads=8))  # a Granite config without its list: not guessed
    with pytest.raises(ValueError, match="layer kinds"):
        NemotronHForCausalLM(SimpleNamespace(hybrid_override_pattern="M*-X", num_hidden_layers=4))


def test_kv_cache_for_attention_layers_only_and_the_state_from_its_budget(paths):
    # 9 slots (8 + the graphs' padding slot) x 2 linear layers: 3 inputs of history x 128 channels (q | k | v),
    # 4 x 16 x 16 fp32
    state = 2 * 9 * (3 * 128 * 4 + 4 * 16 * 16 * 4)
    per_block = 2 * 16 * 2 * 16 * 4  # one layer with a cache: K and V, 16 tokens, 2 KV heads of 16, fp32
    llm = LLM(paths["qwen3_5"], kv_cache_memory_bytes=state + 21 * per_block, max_num_seqs=8, **ENGINE)
    runner = llm.llm_engine.runner
    assert len(runner.kv_caches) == 1  # layer 1's; layers 0 and 2 are linear
    assert state_bytes(llm.llm_engine.config) == state
    assert runner.num_blocks == 20  # the budget less the state, less the sink block
    with pytest.raises(ValueError, match="recurrent state of max_num_seqs=8 requests takes"):
        LLM(paths["qwen3_5"], kv_cache_memory_bytes=state, max_num_seqs=8, **ENGINE)  # no room left for KV
    layers = [layer.linear_attn for layer in runner.model.model.layers if hasattr(layer, "linear_attn")]
    assert [tuple(layer.state.shape) for layer in layers] == [(9, 4, 16, 16)] * 2
    assert [tuple(layer.conv_state.shape) for layer in layers] == [(9, 3, 128)] * 2
    cost = ModelCost.of_engine(llm.llm_engine)  # the benchmarks' roofline: one layer's K/V, the state both ways
    assert cost.kv_bytes_per_token == 2 * 2 * 16 * 4 and cost.state_bytes_per_request == 2 * state // 9


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe", "granitemoehybrid-mamba", "nemotron_h", "lfm2_moe",
                                  "nemotron_h-moe", "falcon_h1", "olmo_hybrid", "jamba", "mamba", "mamba2",
                                  "lara_mini", "minimax_text", "zamba2", "bailing_hybrid", "qwen4_exp",
                                  "inkling"])
def test_the_same_bits_however_the_tokens_are_cut_into_steps(paths, arch):
    """Batch-invariant mode: one engine that prefills each prompt in one step beside the others, one that cuts the
    prompts into 5-token chunks, fast replay of 4 trace tokens a step, each request alone, and an engine so short
    of KV blocks that requests are preempted and recomputed: the same logprobs, bit for bit (a recurrent state
    advanced by each token alone, kernels/gated_delta.py and mamba_ssm.py; a preempted request's state starts again
    from zeros)."""
    if arch not in paths:
        pytest.skip(MISSING[arch])
    path = paths[arch]
    ref = _replay(LLM(path, batch_invariant=True, **ENGINE))
    assert _replay(LLM(path, batch_invariant=True, max_num_batched_tokens=5, **ENGINE)) == ref
    fast = LLM(path, batch_invariant=True, **ENGINE)
    assert _replay(fast, chunk=4) == ref
    alone = [_replay_one(fast, i) for i in range(3)]
    assert alone == ref
    # 30-token traces: the three prompts (6 blocks of 16) admitted together grow to 12 blocks' worth in 6
    long_ref = _replay(LLM(path, batch_invariant=True, **ENGINE), trace_len=30)
    short = LLM(path, batch_invariant=True, **{**ENGINE, "max_model_len": 80}, num_gpu_blocks_override=6,
                block_size=16)
    assert _replay(short, trace_len=30) == long_ref
    assert short.llm_engine.scheduler.num_preemptions > 0


def _replay_one(llm: LLM, i: int) -> list:
    g = torch.Generator().manual_seed(12)
    traces = [torch.randint(3, 300, (9,), generator=g).tolist() for _ in _prompts()]
    out = llm.generate([{"prompt_token_ids": _prompts()[i]}],
                       SamplingParams(trace_decode_token_ids=traces[i], logprobs=3), use_tqdm=False)[0]
    return [{t: (lp.logprob, lp.rank) for t, lp in d.items()} for d in out.outputs[0].logprobs]


@pytest.mark.parametrize("arch", ["qwen3_5", "granitemoehybrid-mamba", "lfm2", "falcon_h1", "mamba"])
def test_sleep_mode_keeps_the_state_with_the_cache(paths, arch):
    llm = LLM(paths[arch], enable_sleep_mode=True, **ENGINE)
    before = _replay(llm)
    llm.sleep(1)
    llm.wake_up()
    assert _replay(llm) == before


def test_hub_checkpoints_multimodal_and_fused_experts(paths, tmp_path):
    """Qwen3.5's hub checkpoints are the multimodal model (`model.language_model.*` beside a vision tower);
    Qwen3.5-MoE's store each layer's experts stacked ([E, 2I, H] / [E, H, I]): both serve the language model, with
    the logprobs of the text-only checkpoint of the same weights."""
    import transformers

    if not hasattr(transformers, "Qwen3_5ForConditionalGeneration"):
        pytest.skip(f"transformers {transformers.__version__} has no Qwen3_5ForConditionalGeneration")
    text = transformers.AutoModelForCausalLM.from_pretrained(paths["qwen3_5"])
    vl_config = transformers.Qwen3_5Config(
        text_config=text.config.to_dict(), tie_word_embeddings=False,
        vision_config=dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64,
                           num_position_embeddings=16))
    vl = transformers.Qwen3_5ForConditionalGeneration(vl_config).eval()
    vl.model.language_model.load_state_dict(text.model.state_dict())
    vl.lm_head.load_state_dict(text.lm_head.state_dict())
    vl.save_pretrained(tmp_path / "vl")
    assert any(k.startswith("model.visual.") for k in load_file(tmp_path / "vl" / "model.safetensors"))
    ref = _replay(LLM(paths["qwen3_5"], **ENGINE))
    assert _replay(LLM(str(tmp_path / "vl"), **ENGINE)) == ref

    moe = paths["qwen3_5_moe"]
    tensors = load_file(f"{moe}/model.safetensors")
    fused = {k: v for k, v in tensors.items() if ".mlp.experts." not in k}
    for layer in range(3):
        p = f"model.layers.{layer}.mlp.experts"
        gate = [tensors[f"{p}.{e}.gate_proj.weight"] for e in range(8)]
        up = [tensors[f"{p}.{e}.up_proj.weight"] for e in range(8)]
        fused[f"{p}.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up)])  # [E, 2I, H]
        fused[f"{p}.down_proj"] = torch.stack([tensors[f"{p}.{e}.down_proj.weight"] for e in range(8)])
    (tmp_path / "moe").mkdir()
    save_file(fused, tmp_path / "moe" / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "moe" / "config.json").write_text(open(f"{moe}/config.json").read())
    assert _replay(LLM(str(tmp_path / "moe"), **ENGINE)) == _replay(LLM(moe, **ENGINE))


def test_nemotron_h_moe_routes_match_transformers_and_replay(paths):
    """Nemotron 3 Nano's form (hybrid_override_pattern "ME*E"): -1 routes in the Mamba and attention layers, the
    grouped corrected-sigmoid router's top 2 in the MoE layers (1 and 3), as transformers' gate chooses them;
    replayed bit for bit."""
    if "nemotron_h-moe" not in paths:
        pytest.skip(MISSING["nemotron_h-moe"])
    from helpers.moe_routes import assert_routes_match_transformers_and_replay

    llm = LLM(paths["nemotron_h-moe"], **ENGINE, enable_return_routed_experts=True)
    assert llm.llm_engine.model_config.moe_layers == (1, 3)
    assert_routes_match_transformers_and_replay(
        llm, _hf("nemotron_h-moe"), dense_layers=(0, 2), sparse_layers=(1, 3),
        router=lambda m, i: (m.model.layers[i].mixer.gate, lambda out: out[2]))


def test_falcon_h1_keeps_a_kv_cache_and_a_state_in_every_layer(paths):
    """Falcon-H1's layers run attention and Mamba-2 side by side: three KV caches (one per layer, head dim 24) and
    three states (6 heads of 16 x 8, d_ssm 96 rather than expand x hidden = 128)."""
    if "falcon_h1" not in paths:
        pytest.skip(MISSING["falcon_h1"])
    llm = LLM(paths["falcon_h1"], max_num_seqs=4, **ENGINE)
    runner, mc = llm.llm_engine.runner, llm.llm_engine.model_config
    assert mc.recurrent_layers == (0, 1, 2) and mc.num_kv_layers == 3
    assert [tuple(c.shape[3:]) for c in runner.kv_caches] == [(2, 24)] * 3
    assert [tuple(layer.mamba.state.shape) for layer in runner.model.model.layers] == [(5, 6, 16, 8)] * 3


def test_jamba_routes_and_its_mamba1_state(paths):
    """Jamba: layers 0 and 2 Mamba-1 (a state row per channel: [128, 1, 8]), layer 1 attention; its sparse layer's
    (1) top 2 of a softmax as transformers' router chooses them, -1 in the dense layers 0 and 2; replayed bit for
    bit. Tensor parallelism is refused by name."""
    if "jamba" not in paths:
        pytest.skip(MISSING["jamba"])
    from helpers.moe_routes import assert_routes_match_transformers_and_replay

    llm = LLM(paths["jamba"], **ENGINE, enable_return_routed_experts=True)
    mc = llm.llm_engine.model_config
    assert mc.recurrent_layers == (0, 2) and mc.moe_layers == (1,) and mc.num_kv_layers == 1
    mixers = [layer.mamba for layer in llm.llm_engine.runner.model.model.layers if layer.linear]
    assert [tuple(m.state.shape[1:]) for m in mixers] == [(128, 1, 8)] * 2
    assert_routes_match_transformers_and_replay(
        llm, _hf("jamba"), dense_layers=(0, 2), sparse_layers=(1,),
        router=lambda m, i: (m.model.layers[i].feed_forward.router, _top2_ids))
    with pytest.raises(ValueError, match="Mamba-1"):
        EngineConfig(model=paths["jamba"], device="cpu", skip_tokenizer_init=True, tensor_parallel_size=2)


def _top2_ids(out) -> torch.Tensor:
    """Jamba's router's two experts: transformers 5.25's router returns (logits, weights, ids); the GPU machine's
    5.17 is a Linear giving the logits [T, E] alone (a softmax keeps their order)."""
    return out[2] if isinstance(out, tuple) else out.topk(2, dim=-1).indices


@pytest.mark.parametrize("arch", ["mamba", "mamba2"])
def test_an_attention_free_model_keeps_no_kv_cache(paths, arch):
    """Mamba / Mamba-2 (every layer a mixer): no KV cache; the blocks the scheduler hands out cost nothing, so as
    many as max_num_seqs full-length sequences need, whatever the budget; the state's bytes are the whole cost."""
    if arch not in paths:
        pytest.skip(MISSING[arch])
    llm = LLM(paths[arch], max_num_seqs=4, kv_cache_memory_bytes=1 << 20, **ENGINE)
    engine = llm.llm_engine
    assert engine.model_config.num_kv_layers == 0 and engine.runner.kv_caches == []
    assert engine.runner.num_blocks == engine.config.max_num_seqs * engine.config.max_blocks_per_seq + 1
    assert state_bytes(engine.config) > 0
    with pytest.raises(ValueError, match="attention-free"):
        EngineConfig(model=paths[arch], device="cpu", skip_tokenizer_init=True, tensor_parallel_size=2)


def test_lara_mini_hub_checkpoint_form(paths, tmp_path):
    """Lara-4-Mini's hub checkpoints fuse each DeltaNet's input projections into one `linear_attn.in_proj` (rows
    q | k | v | z | b | a) and name its gated norm `linear_attn.out_norm` (transformers' conversion_mapping splits
    and renames them at load, and back at save): that form, written here from the module's own tensors, loads in
    transformers to the module's weights, and the engine scores it bit for bit as the module's own names (what
    LLM.load_weights hands over) and as transformers' save (test_engine_architectures: within LOGPROB_TOL of
    transformers)."""
    if "lara_mini" not in paths:
        pytest.skip(MISSING["lara_mini"])
    import transformers

    saved = load_file(f"{paths['lara_mini']}/model.safetensors")  # transformers' own save: the hub's names
    assert {"model.layers.0.linear_attn.in_proj.weight", "model.layers.2.linear_attn.out_norm.weight"} <= set(saved)
    assert not any(".in_proj_qkv." in k or ".linear_attn.norm." in k for k in saved)
    hf = _hf("lara_mini")
    own = {k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"}  # tied to the embeddings
    hub = {}
    for name, tensor in own.items():
        if name.endswith(".linear_attn.in_proj_qkv.weight"):
            prefix = name[: -len("in_proj_qkv.weight")]
            parts = [own[f"{prefix}in_proj_{p}.weight"] for p in ("qkv", "z", "b", "a")]
            hub[f"{prefix}in_proj.weight"] = torch.cat(parts)  # [2 Hk Dk + 2 Hv Dv + 2 Hv, H]
        elif ".linear_attn.in_proj_" not in name:
            hub[name.replace(".linear_attn.norm.", ".linear_attn.out_norm.")] = tensor
    assert len(hub) == len(own) - 2 * 3  # per linear layer: four projections in one, the norm renamed
    config = open(f"{paths['lara_mini']}/config.json").read()
    for form, tensors in (("hub", hub), ("own", own)):
        (tmp_path / form).mkdir()
        save_file(tensors, tmp_path / form / "model.safetensors", metadata={"format": "pt"})
        (tmp_path / form / "config.json").write_text(config)
    back = transformers.LaraMiniForCausalLM.from_pretrained(str(tmp_path / "hub")).state_dict()
    assert all(torch.equal(back[k], v) for k, v in own.items())
    ref = _replay(LLM(paths["lara_mini"], **ENGINE))
    assert _replay(LLM(str(tmp_path / "hub"), **ENGINE)) == ref
    assert _replay(LLM(str(tmp_path / "own"), **ENGINE)) == ref


def test_lara_mini_gated_norm_is_transformers_in_bf16():
    """The DeltaNet's gated norm (GLM-5-Next's: the weight, the normed row and silu(z) multiplied in fp32, rounded
    once) bit for bit against transformers' in bf16, where Qwen3-Next's order (the row rounded before its weight)
    differs: the fp32 engine tests cannot tell the two apart."""
    if "lara_mini" in MISSING:
        pytest.skip(MISSING["lara_mini"])
    from transformers.models.lara_mini.modeling_lara_mini import LaraMiniRMSNormGated

    from replayllm.model_runner_v2.models.gated_deltanet import GatedRMSNorm
    from replayllm.model_runner_v2.models.lara_mini import Fp32GatedRMSNorm

    g = torch.Generator().manual_seed(0)
    x, z = ((torch.randn(64, 16, generator=g) * 3).bfloat16() for _ in range(2))  # [rows, Dv]
    theirs = LaraMiniRMSNormGated(16, eps=1e-6)
    with torch.no_grad():
        theirs.weight.copy_(torch.rand(16, generator=g) + 0.5)
    theirs = theirs.bfloat16()
    ours, qwen = Fp32GatedRMSNorm(16, 1e-6), GatedRMSNorm(16, 1e-6)
    for norm in (ours, qwen):
        norm.weight.data = theirs.weight.data.clone()
    with torch.no_grad():
        ref = theirs(x, z)
        assert torch.equal(ours(x, z), ref)
        assert not torch.equal(qwen(x, z), ref)


def test_minimax_text_block_prefill_state_and_refusals(paths):
    """MiniMax-Text-01 against transformers' one-pass forward, whose Lightning Attention runs its block-wise form
    (blocks of the config's block_size, 8: the 37-token prompt and its trace span 6 blocks; the engine runs the
    per-token recurrence, which test_engine_architectures meets in transformers' stepwise form), loaded from
    transformers' save (the hub's names: Mixtral's per-expert w1 / w3 / w2, and the decay buffers, skipped); a state
    [heads, D, D] per linear layer (0, 1, 3) and no convolution history; tensor parallelism refused by name."""
    if "minimax_text" not in paths:
        pytest.skip(MISSING["minimax_text"])
    from helpers.hf_reference import teacher_forced
    from helpers.tolerances import LOGPROB_TOL

    saved = load_file(f"{paths['minimax_text']}/model.safetensors")
    assert {"model.layers.0.block_sparse_moe.experts.3.w1.weight", "model.layers.3.self_attn.slope_rate",
            "model.layers.1.self_attn.diagonal_decay", "model.layers.2.self_attn.q_proj.weight"} <= set(saved)

    hf = _hf("minimax_text")
    assert hf.config.block_size == 8 and max(map(len, _prompts())) > 4 * hf.config.block_size
    llm = LLM(paths["minimax_text"], **ENGINE)
    mc = llm.llm_engine.model_config
    assert mc.recurrent_layers == (0, 1, 3) and mc.num_kv_layers == 1
    linear = [layer.self_attn for layer in llm.llm_engine.runner.model.model.layers if layer.linear]
    assert [tuple(m.state.shape[1:]) for m in linear] == [(4, 16, 16)] * 3
    assert all(m.conv_state.numel() == 0 for m in linear)
    g = torch.Generator().manual_seed(12)
    traces = [torch.randint(3, 300, (9,), generator=g).tolist() for _ in _prompts()]
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()],
                        [SamplingParams(trace_decode_token_ids=t, logprobs=0) for t in traces], use_tqdm=False)
    for prompt, out, trace in zip(_prompts(), outs, traces):
        lp, tokens = teacher_forced(hf, prompt, trace)
        engine = torch.tensor([d[t].logprob for t, d in zip(out.outputs[0].token_ids, out.outputs[0].logprobs)])
        assert (engine - lp[torch.arange(len(tokens)), tokens]).abs().max().item() <= LOGPROB_TOL
    with pytest.raises(ValueError, match="Lightning Attention's output norm spans every head"):
        EngineConfig(model=paths["minimax_text"], device="cpu", skip_tokenizer_init=True, tensor_parallel_size=2)
