"""Sleep mode (issue 29): sleep() gives the KV cache's and the weights' memory back, wake_up() takes it again at
the same addresses; level 1 keeps the weights (outputs after waking are bitwise the ones before), level 2
discards them (load_weights brings them back); while asleep nothing generates. On the CPU the regions shrink
their storage to 0 bytes (the same code path as CUDA's, minus the driver calls); on CUDA with
REPLAYLLM_TEST_DEVICE=cuda (bench/gpu_check.sh) the CUDA graphs replay unchanged after waking."""

from __future__ import annotations

import pytest
import torch
from helpers.hf_reference import _HF_CLASSES, tiny_configs
from helpers.trace_replay_common import _full, _tiny

PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]},
           {"prompt_token_ids": [30, 31, 32]}]


def _params():
    from replayllm import SamplingParams

    # Prompts computed in full every time (sleep drops the prefix cache): runs before and after compare like with
    # like, exactly.
    return SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True, skip_reading_prefix_cache=True)


def _outputs(llm):
    return [(o.outputs[0].token_ids, _full(o.outputs[0])) for o in llm.generate(PROMPTS, _params(), use_tqdm=False)]


def _regions(llm):
    sm = llm.llm_engine.runner.sleep_mode
    return sm.params, sm.buffers, sm.kv


def _held_bytes(llm) -> int:
    """Bytes the three regions hold now (their storage; 0 for a released CPU region)."""
    if _on_cpu(llm):
        return sum(r.buffer.untyped_storage().nbytes() for r in _regions(llm))
    return sum(0 if r.released else r.nbytes for r in _regions(llm))


def _on_cpu(llm) -> bool:
    return llm.llm_engine.config.torch_device.type == "cpu"


@pytest.fixture(scope="module")
def llm(tiny_models):
    return _tiny(tiny_models["qwen3"], enable_sleep_mode=True)


def test_level_1_frees_the_memory_and_wakes_to_the_same_outputs(llm):
    before = _outputs(llm)
    weights = {n: p.data_ptr() for n, p in llm.llm_engine.runner.model.named_parameters()}
    kv = [t.data_ptr() for t in llm.llm_engine.runner.kv_caches]
    full = _held_bytes(llm)
    assert full > 0 and not llm.is_sleeping()
    llm.sleep(level=1)
    assert llm.is_sleeping()
    assert _held_bytes(llm) == 0  # the KV cache, the weights and the buffers all gave their memory back
    llm.wake_up()
    assert not llm.is_sleeping() and _held_bytes(llm) == full
    # Same tensors at the same places (CUDA graphs replay them), same contents: the same outputs, exactly.
    if not _on_cpu(llm):  # a CPU storage may come back elsewhere (no graph holds its address)
        assert {n: p.data_ptr() for n, p in llm.llm_engine.runner.model.named_parameters()} == weights
        assert [t.data_ptr() for t in llm.llm_engine.runner.kv_caches] == kv
    assert _outputs(llm) == before


def test_asleep_refuses_work_and_wakes_in_parts(llm, tiny_models, caplog):
    from replayllm import SamplingParams

    before = _outputs(llm)
    llm.sleep(2)
    with pytest.raises(ValueError, match="asleep"):
        llm.generate(PROMPTS, _params(), use_tqdm=False)
    with pytest.raises(ValueError, match="weights are asleep"):
        llm.load_weights([])
    # vLLM's RL order: the weights first (a trainer copies into them), then the KV cache.
    with caplog.at_level("WARNING"):
        llm.wake_up(tags=["weights"])
    assert "woken after a level-2 sleep: the weights are zeros" in caplog.text  # never a zero model quietly
    assert llm.is_sleeping()
    with pytest.raises(ValueError, match="asleep"):
        llm.generate(PROMPTS, SamplingParams(max_tokens=2), use_tqdm=False)
    params, buffers, kv = _regions(llm)
    assert not params.released and not buffers.released and kv.released
    # Level 2 discarded the parameters: they are zeros now, the rotary tables (buffers) came back.
    assert all(not p.any() for p in llm.llm_engine.runner.model.parameters())
    assert any(b.any() for b in llm.llm_engine.runner.model.buffers())
    assert llm.llm_engine.update_weights_from_disk(tiny_models["qwen3"]) > 0
    llm.wake_up(["kv_cache"])
    assert not llm.is_sleeping()
    assert _outputs(llm) == before


def test_a_second_sleep_while_asleep_does_nothing(llm, caplog):
    """vLLM's executor ignores a sleep while asleep (a warning). Here a level-2 sleep after a level-1 one used to
    drop the host copy of the released weights: wake_up then failed with a TypeError, and a second wake_up gave
    zeros for weights. Also while partly awake (only the KV cache woken)."""
    before = _outputs(llm)
    for wake_first in ([], ["kv_cache"]):
        llm.sleep(1)
        if wake_first:
            llm.wake_up(tags=wake_first)
        with caplog.at_level("WARNING", logger="replayllm.engine.engine_core"):
            llm.sleep(2)
        assert "ignored: the engine is already asleep" in caplog.text
        assert llm.is_sleeping()
        llm.wake_up()
        assert not llm.is_sleeping()
        assert _outputs(llm) == before  # level 1's weights came back


def test_bad_calls_are_clear_errors(llm, tiny_models):
    for level in (0, 3, True, "1"):
        with pytest.raises(ValueError, match="sleep level"):
            llm.sleep(level)
    with pytest.raises(ValueError, match="tags"):
        llm.wake_up(["weights", "kv"])
    with pytest.raises(ValueError, match="tags"):
        llm.wake_up("weights")
    with pytest.raises(ValueError, match="cannot load weights"):
        llm.llm_engine.update_weights_from_disk("/nonexistent/checkpoint")
    llm.wake_up()  # awake already: nothing to do
    assert not llm.is_sleeping()
    # Requests in flight: sleep refuses (their KV would vanish), and the engine is unchanged.
    llm.llm_engine.add_request("busy", PROMPTS[0], _params())
    with pytest.raises(ValueError, match="idle"):
        llm.sleep(1)
    while llm.llm_engine.has_unfinished_requests():
        llm.llm_engine.step()
    assert not llm.is_sleeping()


def test_sleep_needs_sleep_mode(tiny_models):
    llm = _tiny(tiny_models["llama"])
    with pytest.raises(ValueError, match="enable_sleep_mode"):
        llm.sleep()
    assert llm.llm_engine.runner.sleep_mode is None


def test_level_2_then_a_trainer_update_equals_a_fresh_engine(tiny_models, tmp_path):
    """The RL loop's cycle: sleep(2) (the trainer takes the GPU), wake the weights, load the trainer's new
    weights, wake the KV cache: exactly what an engine built from those weights computes."""
    torch.manual_seed(3)
    other = _HF_CLASSES["llama"](tiny_configs()["llama"]).to(torch.float32).eval()
    other.save_pretrained(str(tmp_path / "other"), safe_serialization=True)
    llm = _tiny(tiny_models["llama"], enable_sleep_mode=True)
    _outputs(llm)
    for _ in range(2):  # twice: a region released and restored again
        llm.sleep(2)
        llm.wake_up(["weights"])
        llm.load_weights(other)
        llm.wake_up(["kv_cache"])
    assert _outputs(llm) == _outputs(_tiny(str(tmp_path / "other")))
    llm.shutdown()
    assert llm.llm_engine.is_shut_down
