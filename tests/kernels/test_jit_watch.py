"""kernels/jit_watch.py: Triton kernel variants first met after an engine's start-up are counted and logged (a
compile inside a user's run on a fresh machine), start-up's are not, and a hook set before keeps working. The hook
itself on CPU; on CUDA (marker `gpu`) a real new variant after `LLM(...)`."""

from __future__ import annotations

import logging
import types

import pytest
import torch

from replayllm.kernels import jit_watch


@pytest.fixture
def fresh(monkeypatch):
    """The module's state and Triton's hook slot, restored after the test."""
    from triton import knobs

    monkeypatch.setattr(jit_watch, "_LATE", [])
    monkeypatch.setattr(jit_watch, "_INSTALLED", [])
    monkeypatch.setattr(jit_watch, "_STARTING", [0])
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    return knobs.runtime


def _variant(name: str, module: str = "replayllm.kernels.paged_attention") -> dict:
    return dict(key=("k",), repr=f"{name}[num_warps=4](x: *bf16)", fn=types.SimpleNamespace(name=name, module=module),
                compile={}, is_manual_warmup=False, already_compiled=False)


def test_variants_after_start_up_are_late_and_logged(fresh, caplog):
    with jit_watch.starting():
        assert jit_watch.on_new_variant(None, **_variant("_paged_prefill_kernel")) is False  # go on compiling
        with jit_watch.starting():  # a second engine built meanwhile
            jit_watch.on_new_variant(None, **_variant("_rms_norm_kernel"))
    assert jit_watch.late_variants() == []  # start-up's variants are expected
    with caplog.at_level(logging.WARNING, logger="replayllm.kernels.jit_watch"):
        jit_watch.on_new_variant(None, **_variant("_paged_decode_kernel"))
        jit_watch.on_new_variant(None, **{**_variant("_manual"), "is_manual_warmup": True})  # on purpose: not late
        jit_watch.on_new_variant(None, **_variant("_trainer_kernel", "liger_kernel.ops.rms_norm"))  # not ours
    assert jit_watch.late_variants() == ["_paged_decode_kernel: _paged_decode_kernel[num_warps=4](x: *bf16)"]
    assert "after start-up" in caplog.text and "_paged_decode_kernel" in caplog.text and "_manual" not in caplog.text
    assert "_trainer_kernel" not in caplog.text


def test_watch_chains_the_hook_set_before(fresh):
    seen = []
    fresh.jit_cache_hook = lambda **kw: seen.append(kw["fn"].name) or True  # True: Triton skips the compile
    assert jit_watch.watch() and jit_watch.watch()  # installed once
    ours = fresh.jit_cache_hook
    assert ours is not None and ours(**_variant("a")) is True  # the previous hook's answer is kept
    assert seen == ["a"] and len(jit_watch.late_variants()) == 1
    # A hook set since (a test's) is wrapped in turn by the next watch(); both keep counting / being called.
    fresh.jit_cache_hook = lambda **kw: seen.append("later") or False
    assert jit_watch.watch() and fresh.jit_cache_hook is not ours
    assert fresh.jit_cache_hook(**_variant("b")) is False
    assert seen == ["a", "later"] and len(jit_watch.late_variants()) == 2


def test_an_engine_counts_nothing_while_it_starts(fresh, tiny_models):
    """LLM(...) builds inside `starting()`: on CPU it installs no hook (no Triton compiles run there) and leaves
    the start-up depth at 0 afterwards, so a later variant would count."""
    from replayllm import LLM

    llm = LLM(tiny_models["qwen3"], skip_tokenizer_init=True, max_model_len=64)
    assert jit_watch._STARTING == [0] and fresh.jit_cache_hook is None
    llm.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: a real Triton compile after start-up")
def test_a_new_variant_after_start_up_is_counted(tiny_models, monkeypatch):
    """After LLM(...): decode attention at a head size no model here has (80: a new constexpr) is one late variant,
    met once however often it runs."""
    from replayllm import LLM
    from replayllm.kernels.paged_attention import paged_decode_attention_triton

    monkeypatch.setattr(jit_watch, "_LATE", [])
    llm = LLM(tiny_models["qwen3"], skip_tokenizer_init=True, max_model_len=64)
    before = len(jit_watch.late_variants())
    q = torch.randn(2, 4, 80, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(2, 3, 16, 2, 80, device="cuda", dtype=torch.bfloat16)
    tables = torch.tensor([[0, 1], [2, 0]], dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor([20, 9], dtype=torch.int64, device="cuda")
    for _ in range(2):
        paged_decode_attention_triton(q, kv, seq_lens, tables, 0.1, 32, num_splits=1)
    late = jit_watch.late_variants()[before:]
    assert len(late) == 1 and late[0].startswith("_paged_decode_kernel"), late
    llm.shutdown()
