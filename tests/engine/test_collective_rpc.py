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
