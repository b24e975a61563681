"""EngineClient (engine/protocol.py): both engine front-ends the server can run on have every member of it, with
signatures the serving layer can call the same way."""

from __future__ import annotations

import asyncio
import inspect

import pytest

from replayllm.config import EngineConfig
from replayllm.engine.async_engine import AsyncLLMEngine
from replayllm.engine.core_client import EngineCoreClient
from replayllm.engine.llm_engine import LLMEngine
from replayllm.engine.protocol import EngineClient, PromptProcessor

IMPLEMENTATIONS = (AsyncLLMEngine, EngineCoreClient)


def _config() -> EngineConfig:
    return EngineConfig(dtype="float32", device="cpu", max_model_len=256)


@pytest.fixture(scope="module")
def async_engine():
    return AsyncLLMEngine(LLMEngine(_config()))


@pytest.fixture(scope="module")
def core_client():
    client = EngineCoreClient(_config())  # no core process until start(): only the tokenizer side is built
    yield client
    client.close()


def _members(protocol: type) -> tuple[list[str], list[str]]:
    """(data members: annotated attributes, callable members: methods and properties) the protocol declares."""
    data = [n for n in protocol.__annotations__]
    calls = [n for n, v in vars(protocol).items()
             if not n.startswith("_") and (inspect.isfunction(v) or isinstance(v, property))]
    return data, calls


def test_both_front_ends_are_engine_clients(async_engine, core_client):
    assert isinstance(async_engine, EngineClient)
    assert isinstance(core_client, EngineClient)
    data, _ = _members(EngineClient)
    for instance in (async_engine, core_client):
        for name in data:
            assert hasattr(instance, name), f"{type(instance).__name__} has no {name}"


def test_what_run_tokenizer_hands_on_is_a_prompt_processor(async_engine, core_client):
    async def check() -> bool:
        async_engine.start()
        try:
            return await async_engine.run_tokenizer(lambda e: isinstance(e, PromptProcessor), size=0)
        finally:
            await async_engine.shutdown()

    assert asyncio.run(check())
    assert isinstance(core_client.inputs, PromptProcessor)  # what EngineCoreClient.run_tokenizer hands on


@pytest.mark.parametrize("cls", IMPLEMENTATIONS, ids=lambda c: c.__name__)
def test_signatures_match_the_protocol(cls):
    _, calls = _members(EngineClient)
    assert calls, "the protocol declares no methods"
    for name in calls:
        declared = inspect.getattr_static(EngineClient, name)
        actual = inspect.getattr_static(cls, name, None)
        assert actual is not None, f"{cls.__name__}.{name} is missing"
        if isinstance(declared, property):
            assert isinstance(actual, property), f"{cls.__name__}.{name} must be a property"
            continue
        assert inspect.iscoroutinefunction(actual) == inspect.iscoroutinefunction(declared), \
            f"{cls.__name__}.{name}: async in one, not the other"
        _check_parameters(cls.__name__ + "." + name, inspect.signature(declared), inspect.signature(actual))


def _check_parameters(where: str, declared: inspect.Signature, actual: inspect.Signature) -> None:
    """Every declared parameter exists with the same name and kind (a default where one is declared); the
    implementation's extra parameters have defaults, so a call written against the protocol binds."""
    params = actual.parameters
    for p in declared.parameters.values():
        assert p.name in params, f"{where}: no parameter {p.name}"
        q = params[p.name]
        assert q.kind == p.kind, f"{where}({p.name}): {q.kind} instead of {p.kind}"
        if p.default is not inspect.Parameter.empty:
            assert q.default == p.default, f"{where}({p.name}): default {q.default!r}, declared {p.default!r}"
    positional = [p.name for p in declared.parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert [n for n, q in params.items() if q.kind is q.POSITIONAL_OR_KEYWORD][:len(positional)] == positional, \
        f"{where}: positional parameters in another order"
    for q in params.values():
        if q.name not in declared.parameters and q.kind not in (q.VAR_POSITIONAL, q.VAR_KEYWORD):
            assert q.default is not inspect.Parameter.empty, f"{where}: extra parameter {q.name} without a default"
