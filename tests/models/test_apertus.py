"""Apertus (models/apertus.py) beyond test_engine_architectures.py[apertus] (logprobs against transformers, weight
updates, batch invariance): xIELU against transformers' own in fp32 and bf16, bit for bit, and a checkpoint without
xIELU's fixed scalars (beta, eps)."""

from __future__ import annotations

import pytest
import torch
from helpers.engine_archs import MISSING, _hf
from helpers.gpt_family import cases
from helpers.hf_reference import max_gap_to_transformers, trace_logprobs
from helpers.tolerances import LOGPROB_TOL
from safetensors.torch import load_file, save_file

from replayllm import LLM
from replayllm.model_runner_v2.models.apertus import XIELU

pytestmark = pytest.mark.skipif("apertus" in MISSING, reason=MISSING.get("apertus", ""))
ENGINE = dict(device="cpu", dtype="float32", skip_tokenizer_init=True, enable_trace_replay=True, max_model_len=128)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_xielu_is_transformers(dtype):
    """Both branches (x > 0, x <= 0, values around eps) with learned scalars away from their init."""
    from transformers.activations import XIELUActivation

    theirs = XIELUActivation(dtype=dtype)
    ours = XIELU().to(dtype)
    with torch.no_grad():
        theirs.alpha_p.fill_(0.3)
        theirs.alpha_n.fill_(-0.7)
        for name in ("alpha_p", "alpha_n", "beta", "eps"):
            getattr(ours, name).copy_(getattr(theirs, name).reshape(1))
    x = torch.cat([torch.randn(4, 256) * 4, torch.tensor([[0.0, -1e-7, -1e-6, 1e-7] * 64])]).to(dtype)
    assert torch.equal(ours(x), theirs._xielu_python(x))


def test_a_checkpoint_without_the_fixed_scalars(tmp_path):
    """beta and eps are transformers buffers; a checkpoint without them gets transformers' defaults (0.5, -1e-6)."""
    hf = _hf("apertus")
    hf.save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    kept = {k: v for k, v in tensors.items() if not k.endswith((".act_fn.beta", ".act_fn.eps"))}
    assert len(kept) == len(tensors) - 2 * hf.config.num_hidden_layers
    save_file(kept, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    prompts, traces = cases()
    assert max_gap_to_transformers(hf, prompts, traces, trace_logprobs(LLM(str(tmp_path), **ENGINE), prompts,
                                                                        traces)) <= LOGPROB_TOL
