"""`replayllm diff --localize` against a transformers checkpoint with a fault planted in layer 1's attention: the
first jump it names must be that attention block."""

from __future__ import annotations

import torch

from replayllm.entrypoints.diff import TraceRecord, compare


def assert_localize_finds_layer_1_attention(model: str, faulty: str) -> None:
    """Engine on `model` against transformers on `faulty` (a checkpoint directory), two random traces, fp32 CPU."""
    g = torch.Generator().manual_seed(1)
    records = [TraceRecord(str(i), torch.randint(3, 300, (10,), generator=g).tolist(),
                           prompt_token_ids=torch.randint(3, 300, (5,), generator=g).tolist()) for i in range(2)]
    result = compare(records, "dtype=float32,device=cpu,max_model_len=64",
                     f"hf:dtype=float32,device=cpu,experts_implementation=eager,model={faulty}", model=model,
                     localize=2)
    assert result.localization.first_jump is not None
    assert result.localization.first_jump.name == "layer 1 attention"
