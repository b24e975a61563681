"""Tiny GPT-2-family checkpoints for the per-architecture tests (test_gpt2.py, test_gpt_bigcode.py, test_gptj.py):
a random model saved in fp32 with its LayerNorms moved away from weight 1 / bias 0 (a misapplied norm would not show
otherwise), and the prompts and traces both score."""

from __future__ import annotations

import torch


def save_random_model(model_cls, config, path):
    """model_cls(config) in fp32 with seed 0, LayerNorm weights in [0.5, 1.5) and biases in [-0.3, 0.3), saved to
    `path`; returns the module (the reference)."""
    torch.manual_seed(0)
    hf = model_cls(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if ".ln_" in name:
                param.uniform_(0.5, 1.5) if name.endswith("weight") else param.uniform_(-0.3, 0.3)
    hf.save_pretrained(str(path))
    return hf


def cases(vocab_size: int = 300) -> tuple[list[list[int]], list[list[int]]]:
    """Three prompts (3, 20 and 50 tokens) and an 8-token trace for each, ids in [3, vocab_size)."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in (3, 20, 50)]
    return prompts, [torch.randint(3, vocab_size, (8,), generator=g).tolist() for _ in prompts]


def save_original_form(current, original, rename) -> None:
    """The checkpoint in folder `current` as an older file layout in folder `original`: its tensors through
    `rename` ({name: tensor} -> {name: tensor}: the names the original files use, buffers they also stored), the
    other files (config, generation config) linked."""
    from safetensors.torch import load_file, save_file

    original.mkdir()
    save_file(rename(load_file(str(current / "model.safetensors"))), str(original / "model.safetensors"))
    for f in current.iterdir():
        if f.name != "model.safetensors":
            (original / f.name).symlink_to(f)
