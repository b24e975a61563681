"""--generation-config auto|vllm|FOLDER (vLLM's): sampling defaults from generation_config.json for the fields a
request leaves unset, in the server (checked on the params the engine receives) and LLM.get_default_sampling_params."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from replayllm import LLM
from replayllm.config import DEFAULT_MODEL, EngineConfig
from replayllm.entrypoints.generation_config import default_sampling_params
from replayllm.model_source import resolve_model_path

GEN = {"temperature": 0.6, "top_k": 20, "top_p": 1.0, "max_new_tokens": 3, "do_sample": True}
DEFAULTS = {"temperature": 0.6, "top_k": 20, "max_tokens": 3}  # top_p 1.0 is transformers' default: no setting
ENGINE = dict(device="cpu", dtype="float32", max_model_len=512)


def model_with(tmp: Path, gen: dict) -> Path:
    """The embedded model (weights linked) with its generation_config.json replaced by `gen`."""
    src = Path(resolve_model_path(DEFAULT_MODEL))
    for f in src.iterdir():
        if f.name != "generation_config.json":
            os.symlink(f, tmp / f.name)
    (tmp / "generation_config.json").write_text(json.dumps(gen))
    return tmp


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return model_with(tmp_path_factory.mktemp("gen_model"), GEN)


def test_modes(model, tmp_path):
    assert default_sampling_params("auto", str(model)) == DEFAULTS
    assert default_sampling_params("vllm", str(model)) == {}
    assert default_sampling_params("auto", str(tmp_path)) == {}  # a model without the file: no defaults
    (tmp_path / "generation_config.json").write_text(json.dumps({"repetition_penalty": 1.1, "min_p": 0.05}))
    assert default_sampling_params(str(tmp_path), str(model)) == {"repetition_penalty": 1.1, "min_p": 0.05}


def test_override_generation_config_merges_over_the_file(model, capsys):
    """vLLM's --override-generation-config: its keys over --generation-config's (auto: merged with the model's
    file; vllm: alone); an unknown key is refused at the command line, not ignored."""
    from replayllm.entrypoints.cli.main import build_parser
    from replayllm.entrypoints.generation_config import parse_overrides

    over = parse_overrides('{"temperature": 0.2, "max_new_tokens": 9, "min_p": 0.1}')
    assert over == {"temperature": 0.2, "max_tokens": 9, "min_p": 0.1}
    assert default_sampling_params("auto", str(model), over) == {"temperature": 0.2, "top_k": 20, "max_tokens": 9,
                                                                 "min_p": 0.1}
    assert default_sampling_params("vllm", str(model), over) == over
    for command in ("serve", "run-batch"):
        argv = [command, "--override-generation-config", '{"temprature": 1}'] + (["-i", "x", "-o", "y"] * (
            command == "run-batch"))
        with pytest.raises(SystemExit):
            build_parser(command).parse_args(argv)
        assert "unknown generation config keys ['temprature']" in capsys.readouterr().err


def test_a_folder_without_the_file_is_an_error(model, tmp_path):
    with pytest.raises(ValueError, match="no generation_config.json"):
        default_sampling_params(str(tmp_path / "nowhere"), str(model))


def test_llm_default_sampling_params(model):
    llm = LLM(str(model), **ENGINE)
    p = llm.get_default_sampling_params()
    assert (p.temperature, p.top_k, p.max_tokens) == (0.6, 20, 3)
    out = llm.generate("hello", None, use_tqdm=False)[0]  # generate without params uses them (as vLLM's)
    assert len(out.outputs[0].token_ids) <= 3
    assert LLM(str(model), generation_config="vllm", **ENGINE).get_default_sampling_params().temperature == 1.0
    over = LLM(str(model), override_generation_config={"temperature": 0.3, "max_new_tokens": 5}, **ENGINE)
    p = over.get_default_sampling_params()
    assert (p.temperature, p.top_k, p.max_tokens) == (0.3, 20, 5)  # vLLM's LLM(override_generation_config=...)
    with pytest.raises(ValueError, match="unknown generation config keys"):
        LLM(str(model), override_generation_config={"temprature": 1}, **ENGINE)


def test_server_requests_get_the_defaults_unless_they_set_them(model, monkeypatch):
    from fastapi.testclient import TestClient

    from replayllm.engine.async_engine import AsyncLLMEngine
    from replayllm.entrypoints.openai.api_server import build_app

    seen = []
    add = AsyncLLMEngine.add_requests

    async def spy(self, request_id, prompts, params):
        seen.extend(params)
        return await add(self, request_id, prompts, params)

    monkeypatch.setattr(AsyncLLMEngine, "add_requests", spy)
    app = build_app(EngineConfig(model=str(model), **ENGINE),
                    default_sampling=default_sampling_params("auto", str(model)))
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    with TestClient(app) as c:
        for path, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", chat)):
            assert c.post(path, json=body).status_code == 200
            assert c.post(path, json={**body, "temperature": 0.0, "top_k": 5, "max_tokens": 2}).status_code == 200
    unset, overridden = seen[0::2], seen[1::2]
    assert [(p.temperature, p.top_k, p.max_tokens) for p in unset] == [(0.6, 20, 3)] * 2
    assert [(p.temperature, p.max_tokens) for p in overridden] == [(0.0, 2)] * 2  # temperature 0: greedy, top_k off


def test_beam_search_searches_the_default_length(model):
    """A beam search request without max_tokens runs --generation-config's length, as its sampling would (QA: the
    search ran OpenAI's 16 steps on completions and the whole context on chat); one that sets it, its own."""
    from fastapi.testclient import TestClient

    from replayllm.entrypoints.openai.api_server import build_app

    app = build_app(EngineConfig(model=str(model), **ENGINE),
                    default_sampling=default_sampling_params("auto", str(model)))  # max_new_tokens 3
    beam = {"use_beam_search": True, "n": 2, "ignore_eos": True}
    chat = {"messages": [{"role": "user", "content": "hi"}], **beam}
    with TestClient(app) as c:
        for path, body, key in (("/v1/completions", {"prompt": "hi", **beam}, "usage"),
                                ("/v1/chat/completions", chat, "usage")):
            for extra, length in (({}, 3), ({"max_tokens": 5}, 5)):
                r = c.post(path, json={**body, **extra})
                assert r.status_code == 200, r.text
                assert r.json()[key]["completion_tokens"] == 2 * length, (path, extra)
