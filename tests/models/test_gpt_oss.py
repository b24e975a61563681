"""GPT-OSS (models/gpt_oss.py) beyond test_engine_architectures.py's checks (logprobs against transformers, weight
updates, batch invariance, TP=2, localize): its checkpoint layout as loaded, its router (the top-k logits, a
softmax over them) in routed-experts capture and routing replay, and openai's MXFP4 checkpoints (dequantized at
load)."""

from __future__ import annotations

import copy
import json
import os

import numpy as np
import pytest
import torch
from helpers.hf_reference import teacher_forced
from helpers.tolerances import LOGPROB_TOL
from test_engine_architectures import ENGINE, _hf, skip_without_a_reference

from replayllm import LLM, SamplingParams
from replayllm.config import ModelConfig
from replayllm.model_runner_v2.loader import load_model
from replayllm.model_runner_v2.models.moe import route_top_logits
from replayllm.model_runner_v2.quantization.mxfp4 import E2M1, dequantize_mxfp4


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    hf = _hf("gpt_oss")
    path = str(tmp_path_factory.mktemp("gpt_oss"))
    hf.save_pretrained(path)
    return path, hf


def test_the_checkpoint_lands_in_our_layout(gpt_oss):
    """Interleaved gate | up columns [E, H, 2I] become gate rows then up rows [E, 2I, H]; down [E, I, H] becomes
    [E, H, I]; the biases follow; the router is `gate`, the sinks the attention's."""
    path, hf = gpt_oss
    mc = ModelConfig.from_pretrained(path)
    assert mc.architecture == "GptOssForCausalLM" and mc.moe_layers == (0, 1, 2) and mc.num_experts == 4
    model = load_model(mc, torch.device("cpu"))
    ours, theirs = model.model.layers[1], hf.model.layers[1]
    experts, e, inter = ours.mlp.experts, 3, 96
    w13 = experts.gate_up_proj.view(4, 2 * inter, 64)[e]
    gate_up = theirs.mlp.experts.gate_up_proj[e]  # [H, 2I]
    assert torch.equal(w13[:inter], gate_up[:, 0::2].T) and torch.equal(w13[inter:], gate_up[:, 1::2].T)
    assert torch.equal(experts.down_proj.view(4, 64, inter)[e], theirs.mlp.experts.down_proj[e].T)
    b13 = experts.gate_up_proj_bias.view(4, -1)[e]
    assert torch.equal(b13[:inter], theirs.mlp.experts.gate_up_proj_bias[e, 0::2])
    assert torch.equal(experts.down_proj_bias.view(4, -1), theirs.mlp.experts.down_proj_bias)
    assert torch.equal(ours.mlp.gate.bias, theirs.mlp.router.bias)
    assert torch.equal(ours.self_attn.attn.sinks, theirs.self_attn.sinks)
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == [8, None, 8]


def test_route_top_logits_and_its_forced_rows():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 6, generator=g)
    weights, ids = route_top_logits(logits, 2)
    top = logits.topk(2, dim=-1)
    assert torch.equal(ids, top.indices)
    torch.testing.assert_close(weights, top.values.softmax(-1))  # transformers' router: softmax over the top k
    forced = torch.full((5, 2), -1, dtype=torch.int16)
    forced[3] = torch.tensor([5, 0])
    fw, fids = route_top_logits(logits, 2, forced)
    rest = [0, 1, 2, 4]
    assert torch.equal(fids[rest], ids[rest]) and torch.equal(fw[rest], weights[rest])
    assert fids[3].tolist() == [5, 0]
    torch.testing.assert_close(fw[3], logits[3, [5, 0]].softmax(-1))


def test_routes_equal_transformers_and_replay_bit_for_bit(gpt_oss):
    skip_without_a_reference("gpt_oss")
    path, hf = gpt_oss
    llm = LLM(path, **ENGINE, enable_return_routed_experts=True)
    prompt = torch.randint(3, 300, (14,), generator=torch.Generator().manual_seed(8)).tolist()
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=9, ignore_eos=True, logprobs=1)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    routes = out.routed_experts  # [P + 8, layers, 2]
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out.token_ids[:-1]]), output_router_logits=True).router_logits
    top = torch.stack(list(logits), dim=1).topk(3, dim=-1)  # [T, layers, 3]: the router's order, as topk gives it
    clear = (top.values[..., 1] - top.values[..., 2]).numpy() > 1e-4  # no near-tie for the second expert
    assert clear.mean() > 0.9
    assert (routes == top.indices[..., :2].numpy())[clear].all()
    replay = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(
        trace_decode_token_ids=out.token_ids, trace_replay_chunk_size=1, logprobs=1, trace_routed_experts=routes),
        use_tqdm=False)[0].outputs[0]
    lps = [[d[t].logprob for t, d in zip(c.token_ids, c.logprobs)] for c in (out, replay)]
    assert lps[0] == lps[1] and np.array_equal(replay.routed_experts, routes)


def _to_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, rows, K] float (K a multiple of 32) -> (blocks uint8 [E, rows, K / 32, 16], scales uint8 [E, rows, K / 32]):
    each group of 32 scaled by the power of two that brings its largest |value| within e2m1's 6, each value then
    the nearest e2m1 code (the test's own packer, a checkpoint writer's job)."""
    lut = torch.tensor(E2M1)
    groups = weight.reshape(*weight.shape[:-1], -1, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=2.0**-100) / 6.0))  # [E, rows, G]
    scaled = groups / torch.exp2(exponent)[..., None]
    codes = (scaled[..., None] - lut).abs().argmin(-1)  # [E, rows, G, 32]: the first of +-0 is +0
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (exponent + 127).to(torch.uint8)


def test_dequantize_mxfp4_matches_transformers():
    g = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (3, 5, 2, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(117, 133, (3, 5, 2), generator=g, dtype=torch.uint8)
    ours = dequantize_mxfp4(blocks, scales, torch.bfloat16)  # [3, 5, 64]
    try:
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    except ImportError:
        pytest.skip("this transformers has no MXFP4 converter to compare with")
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)  # [3, 64, 5]: transposed
    assert torch.equal(ours, theirs.transpose(1, 2))
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4(blocks, scales[..., :1], torch.float32)


def _mxfp4_checkpoint(src: str, dst, hf) -> dict[str, torch.Tensor]:
    """The checkpoint at `src` with its expert matrices in MXFP4 as openai stores them (rows = output features,
    gate_up's interleaved), the blocks in one file and the scales in another; returns the dequantized weights in
    transformers' layout by name."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    tensors = {}
    for name in os.listdir(src):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(src, name)))
        elif name != "config.json":
            os.symlink(os.path.join(src, name), dst / name)
    blocks, dequantized = {}, {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        b, s = _to_mxfp4(tensors.pop(name).transpose(1, 2))  # [E, out, in]
        blocks[name + "_blocks"], tensors[name + "_scales"] = b, s
        dequantized[name] = dequantize_mxfp4(b, s, torch.float32).transpose(1, 2)
    files = {"model-00001-of-00002.safetensors": tensors, "model-00002-of-00002.safetensors": blocks}
    for file, part in files.items():
        save_file(part, str(dst / file))
    index = {"weight_map": {name: file for file, part in files.items() for name in part}}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    config = hf.config.to_dict()
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["router", "self_attn"]}
    (dst / "config.json").write_text(json.dumps(config))
    return dequantized


def test_an_mxfp4_checkpoint_loads_exactly_and_others_are_refused(gpt_oss, tmp_path):
    """The engine on an MXFP4 checkpoint scores what transformers scores with the dequantized experts (fp32: the
    same computation), and its experts hold those values exactly; another quant_method is a ValueError."""
    path, hf = gpt_oss
    dequantized = _mxfp4_checkpoint(path, tmp_path / "mxfp4", hf)
    reference = copy.deepcopy(hf)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if name in dequantized:
                assert (param - dequantized[name]).abs().max() > 0  # the quantization moved the weights
                param.copy_(dequantized[name])
    llm = LLM(str(tmp_path / "mxfp4"), **ENGINE)
    experts = llm.llm_engine.runner.model.model.layers[2].mlp.experts
    w2 = dequantized["model.layers.2.mlp.experts.down_proj"].transpose(1, 2)  # [E, H, I]
    assert torch.equal(experts.down_proj.view(w2.shape).cpu(), w2)
    prompt = torch.randint(3, 300, (12,), generator=torch.Generator().manual_seed(2)).tolist()
    trace = torch.randint(3, 300, (6,), generator=torch.Generator().manual_seed(3)).tolist()
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(trace_decode_token_ids=trace, logprobs=0),
                       use_tqdm=False)[0].outputs[0]
    other = tmp_path / "awq"
    other.mkdir()
    for f in (tmp_path / "mxfp4").iterdir():
        if f.name != "config.json":
            (other / f.name).symlink_to(f)
    config = json.loads((tmp_path / "mxfp4" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantization_config 'awq' is not supported"):
        LLM(str(other), **ENGINE)
    skip_without_a_reference("gpt_oss")  # last: what follows needs transformers' model
    lp, tokens = teacher_forced(reference, prompt, out.token_ids)
    engine = torch.tensor([d[t].logprob for t, d in zip(out.token_ids, out.logprobs)])
    assert (engine - lp[torch.arange(len(tokens)), tokens]).abs().max().item() <= LOGPROB_TOL
