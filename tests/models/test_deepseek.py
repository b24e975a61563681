"""DeepSeek-V2 / V3 (models/deepseek.py, models/mla.py) beyond test_engine_architectures.py's checks (logprobs against
transformers, weight updates, batch invariance, TP=2, localize): V2's router against transformers' own, the routes
reported and replayed, a config.json in the hub's form (DeepSeek-V2-Lite's keys: legacy `rope_scaling`, no head_dim,
`moe_layer_freq`), the cache's shape, and a bf16 V3 keeping its router in fp32 and skipping its MTP layer."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from helpers.fp8_checkpoint import save_fp8_checkpoint
from helpers.hf_reference import teacher_forced, trace_logprobs
from helpers.moe_routes import assert_routes_match_transformers_and_replay
from helpers.tolerances import LOGPROB_TOL
from safetensors.torch import load_file, save_file
from test_engine_architectures import ENGINE, _hf

from replayllm import LLM, SamplingParams
from replayllm.config import ModelConfig
from replayllm.model_runner_v2.loader import load_model
from replayllm.model_runner_v2.models.deepseek import route_softmax_groups


@pytest.fixture(scope="module")
def v2(tmp_path_factory):
    hf = _hf("deepseek_v2")
    path = tmp_path_factory.mktemp("deepseek_v2")
    hf.save_pretrained(str(path))
    return path, hf


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_the_v2_router_is_transformers_router(v2, method):
    """route_softmax_groups against transformers' DeepseekV2TopkRouter on the same logits: the same experts (as
    sets: both take topk unsorted) and weights; forced rows keep their ids, weighted by their own probabilities."""
    _, hf = v2
    router = hf.model.layers[1].mlp.gate
    router.topk_method = method
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, weights, ids = router(x)
    groups = (2, 1) if method == "group_limited_greedy" else (1, 1)
    ours_w, ours_ids = route_softmax_groups(logits, 2, *groups, False, 1.5)
    order, theirs = ours_ids.argsort(-1), ids.argsort(-1)
    assert torch.equal(ours_ids.gather(1, order), ids.gather(1, theirs))
    torch.testing.assert_close(ours_w.gather(1, order), weights.gather(1, theirs))
    in_one_group = ((ours_ids // 4) == (ours_ids[:, :1] // 4)).all(dim=1)
    assert in_one_group.all() if method == "group_limited_greedy" else not in_one_group.all()
    forced = torch.full((40, 2), -1, dtype=torch.int16)
    forced[5] = torch.tensor([7, 0])
    fw, fids = route_softmax_groups(logits, 2, *groups, True, 1.5, forced)
    assert fids[5].tolist() == [7, 0] and torch.equal(fids[:5], ours_ids[:5])
    probs = logits[5].softmax(-1)[[7, 0]]
    torch.testing.assert_close(fw[5], probs / probs.sum() * 1.5)


def test_routes_match_transformers_and_replay_bit_for_bit(v2):
    path, hf = v2
    llm = LLM(str(path), **ENGINE, enable_return_routed_experts=True)
    assert_routes_match_transformers_and_replay(llm, hf, dense_layers=(0,), sparse_layers=(1, 2))


def _hub_form(path, out) -> None:
    """The checkpoint at `path` with its config.json as the hub's DeepSeek-V2-Lite writes it: remote-code keys, the
    rope in a legacy `rope_scaling` ("type": "yarn") beside `rope_theta`, no head_dim / qk_head_dim, and the keys
    transformers ignores (moe_layer_freq, scoring_func, aux-loss settings)."""
    config = json.loads((path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    for key in ("head_dim", "qk_head_dim", "dtype", "transformers_version", "output_router_logits", "mlp_bias"):
        config.pop(key, None)
    config.update(rope_theta=rope.pop("rope_theta"), rope_scaling={**rope, "type": rope.pop("rope_type")},
                  moe_layer_freq=1, scoring_func="softmax", aux_loss_alpha=0.001, seq_aux=True, torch_dtype="float32",
                  auto_map={"AutoConfig": "configuration_deepseek.DeepseekV2Config",
                            "AutoModelForCausalLM": "modeling_deepseek.DeepseekV2ForCausalLM"})
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config))
    (out / "model.safetensors").symlink_to(path / "model.safetensors")


def test_a_hub_form_config_loads_with_the_cache_shape_of_mla(v2, tmp_path):
    """The engine reads the hub's form of the config as transformers does (logprobs against transformers' model
    loaded from the same directory); its cache holds one K and one V per q head of qk_nope + qk_rope elements."""
    path, _ = v2
    hub = tmp_path / "hub"
    _hub_form(path, hub)
    mc = ModelConfig.from_pretrained(str(hub))
    assert (mc.num_kv_heads, mc.head_dim, mc.moe_layers, mc.norm_topk_prob) == (4, 24, (1, 2), False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(hub), dtype=torch.float32,
                                                           attn_implementation="eager",
                                                           experts_implementation="eager").eval()
    llm = LLM(str(hub), **ENGINE)
    cache = llm.llm_engine.runner.kv_caches[0]
    assert cache.shape[0] == 2 and tuple(cache.shape[-2:]) == (4, 24)
    prompt = torch.randint(3, 300, (70,), generator=torch.Generator().manual_seed(2)).tolist()  # past the YaRN
    out = llm.generate([{"prompt_token_ids": prompt}],  # model's original context of 64
                       SamplingParams(temperature=0, max_tokens=6, logprobs=0, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    lp, tokens = teacher_forced(hf, prompt, out.token_ids)
    engine = torch.tensor([d[t].logprob for t, d in zip(out.token_ids, out.logprobs)])
    assert (engine - lp[torch.arange(len(tokens)), tokens]).abs().max().item() <= LOGPROB_TOL


def test_moe_layer_freq_spaces_the_sparse_layers(v2, tmp_path):
    """DeepSeek's own code (and vLLM) make layer i sparse when i >= first_k_dense_replace and i % moe_layer_freq
    == 0."""
    path, _ = v2
    hub = tmp_path / "hub"
    _hub_form(path, hub)
    config = json.loads((hub / "config.json").read_text())
    (hub / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 6, "moe_layer_freq": 2}))
    assert ModelConfig.from_pretrained(str(hub)).moe_layers == (2, 4)


def test_a_bf16_v3_keeps_its_router_in_fp32_and_skips_the_mtp_layer(tmp_path):
    hf = _hf("deepseek_v3")
    hf.save_pretrained(str(tmp_path / "v3"))
    tensors = load_file(str(tmp_path / "v3" / "model.safetensors"))
    tensors["model.layers.3.self_attn.q_a_proj.weight"] = torch.zeros(24, 64)  # the MTP layer: index L = 3
    save_file(tensors, str(tmp_path / "v3" / "model.safetensors"))
    model = load_model(ModelConfig.from_pretrained(str(tmp_path / "v3"), dtype="bfloat16"), torch.device("cpu"))
    gate = model.model.layers[2].mlp.gate
    bias = tensors["model.layers.2.mlp.gate.e_score_correction_bias"]
    assert not torch.equal(bias.bfloat16().float(), bias)  # what a bf16 rounding would change
    assert torch.equal(gate.e_score_correction_bias, bias)
    assert torch.equal(gate.weight, tensors["model.layers.2.mlp.gate.weight"])
    assert model.model.layers[2].self_attn.kv_b_proj.weight.dtype == torch.bfloat16


def test_a_checkpoint_stored_in_fp8_blocks_loads_dequantized(v2, tmp_path):
    """DeepSeek-V3's released checkpoints store fp8 blocks with their scales (quantization/fp8_checkpoint.py): the
    hub form in fp8 blocks of [8, 8] (the latent projections and every expert included) scores what the same
    checkpoint holding transformers' dequantized weights scores, bit for bit."""
    path, _ = v2
    hub = tmp_path / "hub"
    _hub_form(path, hub)
    assert save_fp8_checkpoint(str(hub), str(tmp_path / "fp8"), str(tmp_path / "plain"), (8, 8)) > 20
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 30)]
    traces = [torch.randint(3, 300, (6,), generator=g).tolist() for _ in prompts]
    fp8 = trace_logprobs(LLM(str(tmp_path / "fp8"), **ENGINE), prompts, traces)
    assert fp8 == trace_logprobs(LLM(str(tmp_path / "plain"), **ENGINE), prompts, traces)
