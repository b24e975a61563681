"""LLM.collective_rpc and worker_extension_cls (vLLM's; entrypoints/worker_rpc.py): an RL framework's extension
method changes the weights through the worker's model_runner, a callable reads them, and the bad calls are clear
ValueErrors."""

from __future__ import annotations

import pytest
import torch

from replayllm import LLM, SamplingParams

NAME = "model.norm.weight"


class Extension:
    """What RL frameworks hand vLLM as worker_extension_cls: methods run on the worker."""

    def set_norm(self, value: float) -> int:
        weight = self.model_runner.model.get_parameter(NAME)
        self.model_runner.load_weights([(NAME, torch.full_like(weight, value))])  # any subset, checked, in place
        return self.rank


    def remember(self, value) -> None:  # RL extensions keep state (a process group, a buffer) between calls
        self.saved = value

    def recall(self):
        return self.saved


class Clashing:
    def model_runner(self):  # would hide the worker's own attribute
        return None


def _logprobs(llm: LLM) -> list[float]:
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=3, logprobs=0),
                       use_tqdm=False)[0].outputs[0]
    return [d[t].logprob for t, d in zip(out.token_ids, out.logprobs)]


@pytest.fixture(scope="module")
def llm(tiny16):
    return LLM(tiny16, device="cpu", dtype="float32", skip_tokenizer_init=True,
               worker_extension_cls=f"{__name__}.Extension")


def test_an_extension_method_updates_the_weights_and_a_callable_reads_them(llm):
    before = _logprobs(llm)
    assert llm.collective_rpc("set_norm", args=(0.5,)) == [0]
    assert llm.collective_rpc(lambda worker, name: worker.model_runner.model.get_parameter(name).sum().item(),
                              args=(NAME,)) == [0.5 * llm.llm_engine.runner.model.get_parameter(NAME).numel()]
    changed = _logprobs(llm)
    assert changed != before
    llm.collective_rpc("set_norm", kwargs={"value": 1.0})
    assert _logprobs(llm) != changed


def test_the_worker_keeps_an_extensions_state_between_calls(llm):
    llm.collective_rpc("remember", args=("group",))
    assert llm.collective_rpc("recall") == ["group"]


def test_bad_calls_are_clear_errors(llm, tiny16):
    with pytest.raises(ValueError, match="no method 'nope'"):
        llm.collective_rpc("nope")
    with pytest.raises(ValueError, match="timeout"):
        llm.collective_rpc("set_norm", timeout=5.0, args=(1.0,))
    with pytest.raises(ValueError, match="could not be imported"):
        LLM(tiny16, device="cpu", worker_extension_cls="no_such_module.Ext")
    with pytest.raises(ValueError, match="would replace the worker's"):
        LLM(tiny16, device="cpu", worker_extension_cls=Clashing)


class VllmStyle:
    """How verl / OpenRLHF / TRL extensions update vLLM: the worker model's own load_weights with a subset."""

    def update_norm(self, value: float) -> set:
        weight = self.model_runner.model.get_parameter(NAME)
        return self.model_runner.model.load_weights(weights=[(NAME, torch.full_like(weight, value))])

    def update_norm_then_a_bad_one(self, value: float) -> None:
        weight = self.model_runner.model.get_parameter(NAME)
        self.model_runner.model.load_weights([(NAME, torch.full_like(weight, value)),
                                              ("model.layers.0.mlp.down_proj.weight", torch.zeros(3))])


def test_the_models_own_load_weights_takes_a_subset_and_is_atomic(tiny16):
    """vLLM's model.load_weights: any subset in place, the names written returned; a bad tensor anywhere in the
    call is a ValueError and nothing is copied (it used to copy the good ones, then report 17 'missing')."""
    llm = LLM(tiny16, device="cpu", dtype="float32", skip_tokenizer_init=True,
              worker_extension_cls=f"{__name__}.VllmStyle")
    weight = llm.llm_engine.runner.model.get_parameter(NAME)
    assert llm.collective_rpc("update_norm", args=(0.5,)) == [{NAME}]
    assert torch.equal(weight, torch.full_like(weight, 0.5))
    with pytest.raises(ValueError, match="down_proj"):
        llm.collective_rpc("update_norm_then_a_bad_one", args=(2.0,))
    assert torch.equal(weight, torch.full_like(weight, 0.5))


def test_a_call_that_raises_after_changing_weights_still_drops_the_prefix_cache(llm):
    prompt = {"prompt_token_ids": [i % 16 for i in range(40)]}
    params = SamplingParams(temperature=0, max_tokens=1)
    llm.generate(prompt, params, use_tqdm=False)
    assert llm.generate(prompt, params, use_tqdm=False)[0].num_cached_tokens > 0

    def change_then_fail(model):
        model.get_parameter(NAME).mul_(1.0)
        raise RuntimeError("trainer side failed")

    for call in (lambda: llm.apply_model(change_then_fail),
                 lambda: llm.collective_rpc(lambda worker: change_then_fail(worker.model_runner.model))):
        with pytest.raises(RuntimeError, match="trainer side"):
            call()
        assert llm.generate(prompt, params, use_tqdm=False)[0].num_cached_tokens == 0


def test_the_workers_load_weights_is_the_engines_checked_update(llm):
    """A request in flight: the worker's model_runner.load_weights refuses, as LLM.load_weights does."""
    llm.llm_engine.add_request("busy", {"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=4))
    try:
        with pytest.raises(ValueError, match="idle engine"):
            llm.collective_rpc("set_norm", args=(0.25,))
    finally:
        llm.llm_engine.abort_request("busy")
    assert llm.collective_rpc("set_norm", args=(1.0,)) == [0]


def test_the_model_is_refused_while_the_weights_are_asleep(tiny16):
    """Reading a sleeping model's tensors crashed the process (a segfault); now a ValueError, and a worker method
    that does not touch the model still runs."""
    llm = LLM(tiny16, device="cpu", dtype="float32", skip_tokenizer_init=True, enable_sleep_mode=True,
              worker_extension_cls=f"{__name__}.Extension")
    llm.sleep(level=1)
    with pytest.raises(ValueError, match="asleep.*apply_model"):
        llm.apply_model(lambda m: m.get_parameter(NAME).sum().item())
    with pytest.raises(ValueError, match="asleep"):
        llm.collective_rpc(lambda w: w.model_runner.model.get_parameter(NAME).sum().item())
    llm.collective_rpc("remember", args=("group",))
    assert llm.collective_rpc("recall") == ["group"]
    llm.wake_up(tags=["weights"])
    assert llm.apply_model(lambda m: m.get_parameter(NAME).numel()) == [weight_numel(llm)]
    llm.wake_up()


def weight_numel(llm: LLM) -> int:
    return llm.llm_engine.runner.model.get_parameter(NAME).numel()
