"""Fixtures of the kernel tests."""

from __future__ import annotations

import pytest

from replayllm.kernels import paged_attention as pa
from replayllm.model_runner_v2 import attention


@pytest.fixture
def kernel_calls(monkeypatch) -> dict[str, list]:
    """Records every launch of the Triton attention launchers made by the engine (and decode split counts)."""
    calls: dict[str, list] = {"prefill": [], "decode": [], "splits": []}

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            out = fn(*args, **kwargs)
            calls[name].append(out)
            return out
        return wrapped

    prefill, decode = attention.paged_prefill_attention_triton, attention.paged_decode_attention_triton
    monkeypatch.setattr(attention, "paged_prefill_attention_triton", spy("prefill", prefill))
    monkeypatch.setattr(attention, "paged_decode_attention_triton", spy("decode", decode))
    monkeypatch.setattr(pa, "decode_num_splits", spy("splits", pa.decode_num_splits))
    return calls
