"""fp8 checkpoints (model_runner_v2/quantization/fp8_checkpoint.py): weights stored as e4m3 with block scales
(DeepSeek-V3 / Qwen3-FP8 / MiniMax-M2 releases) or per-tensor / per-row scales, dequantized at load to
transformers' `dequantize=True` values bit for bit, and the engine on such a checkpoint against transformers on
the dequantized weights."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from helpers.engine_archs import ENGINE, _hf
from helpers.fp8_checkpoint import (
    compressed_tensors_config,
    quantize_blocks,
    save_fp8_checkpoint,
    transformers_dequantize,
)
from helpers.gpt_family import cases
from helpers.hf_reference import load_hf, max_gap_to_transformers, minimax_m2_reference_problem, trace_logprobs
from helpers.tolerances import LOGPROB_TOL
from safetensors.torch import load_file

from replayllm import LLM
from replayllm.config import ModelConfig
from replayllm.fp8_checkpoint_config import fp8_weight_block
from replayllm.model_runner_v2.loader import load_model
from replayllm.model_runner_v2.quantization.fp8_checkpoint import (
    dequantize_fp8,
    dequantize_fp8_weights,
    scaled_weight_names,
)

CPU = {**ENGINE, "device": "cpu"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape, block", [((256, 384), (128, 128)), ((64, 96), (16, 32)), ((3, 48, 32), (16, 16))])
def test_block_dequantization_is_transformers(dtype, shape, block):
    torch.manual_seed(0)
    w = torch.randn(shape) * 3
    q, s = (quantize_blocks(w, block) if w.dim() == 2 else
            [torch.stack(t) for t in zip(*(quantize_blocks(e, block) for e in w))])
    assert torch.equal(dequantize_fp8(q, s, block, dtype), transformers_dequantize(q, s, dtype))


def test_a_partial_last_block_takes_its_own_scale():
    """Shapes that are not multiples of the block (the grid rounds up, as DeepSeek's and vLLM's): each element
    times the scale of block (n // bn, k // bk)."""
    torch.manual_seed(1)
    q = (torch.randn(50, 70) * 50).to(torch.float8_e4m3fn)
    s = torch.rand(4, 3) + 0.5  # ceil(50 / 16), ceil(70 / 32)
    got = dequantize_fp8(q, s, (16, 32), torch.float32)
    want = torch.tensor([[q[n, k].float().item() * s[n // 16, k // 32].item() for k in range(70)] for n in range(50)])
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match=r"needs a scale grid \[4, 3\], got \[4, 2\]"):
        dequantize_fp8(q, s[:, :2], (16, 32), torch.float32)


def test_per_tensor_and_per_row_scales():
    q = (torch.randn(6, 8) * 40).to(torch.float8_e4m3fn)
    assert torch.equal(dequantize_fp8(q, torch.tensor([0.25]), None, torch.float32), q.float() * 0.25)
    rows = torch.rand(6, 1)
    assert torch.equal(dequantize_fp8(q, rows, None, torch.float32), q.float() * rows)
    with pytest.raises(ValueError, match="neither one value nor one per row"):
        dequantize_fp8(q, torch.rand(3), None, torch.float32)


def test_the_stream_pairs_weights_and_scales_in_any_order(caplog):
    """A scale before its weight, a weight before its scale, tensors without a scale passed through, activation
    scales dropped (logged); a scale whose weight never comes is an error naming it."""
    q = (torch.randn(4, 4) * 10).to(torch.float8_e4m3fn)
    stream = [("a.scale_first.weight_scale_inv", torch.tensor([[2.0]])), ("norm.weight", torch.ones(4)),
              ("a.scale_first.weight", q), ("b.weight", q), ("b.input_scale", torch.tensor(1.0)),
              ("b.weight_scale", torch.tensor(0.5))]
    scaled = scaled_weight_names(n for n, _ in stream)
    assert scaled == {"a.scale_first.weight", "b.weight"}
    with caplog.at_level(logging.INFO):
        out = dict(dequantize_fp8_weights(stream, scaled, (4, 4), torch.float32))
    assert list(out) == ["norm.weight", "a.scale_first.weight", "b.weight"]
    assert torch.equal(out["a.scale_first.weight"], q.float() * 2) and torch.equal(out["b.weight"], q.float() * 0.5)
    assert "1 activation / KV-cache scales not used" in caplog.text
    with pytest.raises(ValueError, match="without their partner.*the scale of lone.weight"):
        list(dequantize_fp8_weights([("lone.weight_scale_inv", torch.ones(1, 1))], {"lone.weight"}, (4, 4),
                                    torch.float32))


def test_the_config_forms_are_read_and_checked():
    assert fp8_weight_block({"quant_method": "fp8", "weight_block_size": [128, 128]}) == (128, 128)
    assert fp8_weight_block({"quant_method": "fp8"}) is None
    assert fp8_weight_block(compressed_tensors_config("block", (128, 64))) == (128, 64)
    assert fp8_weight_block(compressed_tensors_config("channel")) is None
    with pytest.raises(ValueError, match="two positive integers"):
        fp8_weight_block({"quant_method": "fp8", "weight_block_size": [128]})
    int4 = compressed_tensors_config("channel")
    int4["config_groups"]["group_0"]["weights"].update(type="int", num_bits=4)
    with pytest.raises(ValueError, match="not symmetric 8-bit floats"):
        fp8_weight_block(int4)
    with pytest.raises(ValueError, match="format 'pack-quantized' is not supported"):
        fp8_weight_block({**int4, "format": "pack-quantized"})


@pytest.mark.parametrize("arch", ["llama", pytest.param("minimax_m2", marks=pytest.mark.skipif(
    minimax_m2_reference_problem() is not None, reason=str(minimax_m2_reference_problem())))])
def test_an_fp8_checkpoint_loads_as_its_dequantized_weights(tmp_path, arch):
    """Every layer weight in fp8 blocks of [16, 16], the scales in the other shard (MiniMax-M2: each expert's w1 /
    w2 / w3 too; its router and correction bias unquantized, as the releases' modules_to_not_convert): the engine's
    logprobs equal, bit for bit, those of the checkpoint holding transformers' dequantized weights, and meet
    transformers' forward on those weights; an input scale in the file is dropped."""
    hf = _hf(arch)
    hf.save_pretrained(tmp_path / "src")
    count = save_fp8_checkpoint(str(tmp_path / "src"), str(tmp_path / "fp8"), str(tmp_path / "plain"), (16, 16),
                                extra_tensors={"model.layers.0.self_attn.q_proj.input_scale": torch.tensor(1.0)})
    assert count >= 7 * 3  # q, k, v, o + the MLP's (or each expert's) projections, in 3 layers
    prompts, traces = cases()
    fp8 = trace_logprobs(LLM(str(tmp_path / "fp8"), **CPU), prompts, traces)
    assert fp8 == trace_logprobs(LLM(str(tmp_path / "plain"), **CPU), prompts, traces)
    reference = load_hf(str(tmp_path / "plain"))  # transformers' own loading maps the hub's expert names
    q_proj = (m.model.layers[0].self_attn.q_proj.weight for m in (reference, hf))
    assert not torch.equal(*q_proj)  # the reference holds the dequantized weights, not the originals
    assert max_gap_to_transformers(reference, prompts, traces, fp8) <= LOGPROB_TOL
    # the fp8 rounding is visible: the original weights score otherwise; an engine on them takes the fp8 files in
    # place (update_weights_from_disk: the same dequantization) and then scores what the fp8 engine scores
    original = LLM(str(tmp_path / "src"), **CPU)
    assert trace_logprobs(original, prompts, traces) != fp8
    assert original.llm_engine.update_weights_from_disk(str(tmp_path / "fp8")) > 0
    assert trace_logprobs(original, prompts, traces) == fp8


@pytest.mark.parametrize("form", ["ct-channel", "ct-block"])
def test_llm_compressors_fp8_exports_load_as_their_dequantized_weights(tmp_path, form):
    """compressed-tensors float-quantized (RedHatAI's FP8-dynamic: a `weight_scale` per output row; FP8-block: per
    block of [16, 32]): the engine scores what the checkpoint of transformers' dequantized weights scores, bit for
    bit; a compressed-tensors int4 pack is refused at start-up."""
    _hf("llama").save_pretrained(tmp_path / "src")
    save_fp8_checkpoint(str(tmp_path / "src"), str(tmp_path / "fp8"), str(tmp_path / "plain"), (16, 32), form=form)
    prompts, traces = cases()
    fp8 = trace_logprobs(LLM(str(tmp_path / "fp8"), **CPU), prompts, traces)
    assert fp8 == trace_logprobs(LLM(str(tmp_path / "plain"), **CPU), prompts, traces)
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    config["quantization_config"]["format"] = "pack-quantized"
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="compressed-tensors format 'pack-quantized' is not supported"):
        LLM(str(tmp_path / "fp8"), **CPU)


def test_a_bf16_model_holds_transformers_bf16_dequantization(tmp_path):
    """dtype bfloat16: each weight rounded once from the fp32 product, as transformers' dequantize=True load into a
    bf16 model (o_proj: a whole parameter; q_proj: the first rows of the fused qkv_proj)."""
    _hf("llama").save_pretrained(tmp_path / "src")
    save_fp8_checkpoint(str(tmp_path / "src"), str(tmp_path / "fp8"), str(tmp_path / "plain"), (16, 16))
    model = load_model(ModelConfig.from_pretrained(str(tmp_path / "fp8"), dtype="bfloat16"), torch.device("cpu"))
    stored = load_file(str(tmp_path / "fp8" / "model-00001-of-00002.safetensors"))
    scales = load_file(str(tmp_path / "fp8" / "model-00002-of-00002.safetensors"))
    attn = model.model.layers[1].self_attn
    for name, got in (("o_proj", attn.o_proj.weight), ("q_proj", attn.qkv_proj.weight[:64])):
        key = f"model.layers.1.self_attn.{name}.weight"
        want = transformers_dequantize(stored[key], scales[key + "_scale_inv"], torch.bfloat16)
        assert got.dtype == torch.bfloat16 and torch.equal(got, want)


def test_other_checkpoint_quantizations_are_still_refused(tmp_path):
    """At start-up, and by update_weights_from_disk (whose folder's config.json says what its files hold)."""
    _hf("llama").save_pretrained(tmp_path / "gptq")
    llm = LLM(str(tmp_path / "gptq"), **CPU)
    config = json.loads((tmp_path / "gptq" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (tmp_path / "gptq" / "config.json").write_text(json.dumps(config))
    refused = "quantization_config 'gptq' is not supported \\(fp8 checkpoints are"
    with pytest.raises(ValueError, match=refused):
        LLM(str(tmp_path / "gptq"), **CPU)
    with pytest.raises(ValueError, match=refused):
        llm.llm_engine.update_weights_from_disk(str(tmp_path / "gptq"))
