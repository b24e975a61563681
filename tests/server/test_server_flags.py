"""`replayllm serve`'s vLLM flags: --root-path, --allowed-origins (CORS), --ssl-keyfile/--ssl-certfile,
--chat-template, --generation-config; one server runs with the first four, and bad values stop `serve` before the
model loads."""

from __future__ import annotations

import json

import httpx
import pytest
from helpers.server_utils import API_KEY, ENGINE_ARGS, RemoteServer
from test_generation_config import model_with

from replayllm.entrypoints.cli import server_main
from replayllm.entrypoints.cli.main import main

ORIGIN = "https://ui.example"
TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    gen = tmp_path_factory.mktemp("gen")
    (gen / "generation_config.json").write_text(json.dumps({"temperature": 0.5, "max_new_tokens": 3}))
    model = model_with(tmp_path_factory.mktemp("model"), {"temperature": 0.9})  # not read: FOLDER wins
    srv = RemoteServer([str(model), *ENGINE_ARGS, "--api-key", API_KEY, "--root-path", "/proxy",
                        "--allowed-origins", json.dumps([ORIGIN]), "--chat-template", TEMPLATE,
                        "--generation-config", str(gen), "--enable-log-requests"],
                       tmp_path_factory.mktemp("server_flags"), api_key=API_KEY)
    yield srv
    srv.stop()


def test_root_path(server):
    assert httpx.get(server.url + "/openapi.json").json()["servers"] == [{"url": "/proxy"}]
    for path in ("/proxy/v1/models", "/v1/models"):  # with the prefix, or stripped by the proxy
        assert httpx.get(server.url + path, headers=server.headers).status_code == 200
        assert httpx.get(server.url + path).status_code == 401  # the key is required under the prefix too


def test_cors(server):
    def preflight(origin):
        return httpx.options(server.url + "/v1/completions", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})

    ok = preflight(ORIGIN)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    assert "access-control-allow-origin" not in preflight("https://other.example").headers
    r = httpx.get(server.url + "/v1/models", headers={**server.headers, "Origin": ORIGIN})
    assert r.headers["access-control-allow-origin"] == ORIGIN


def test_chat_template(server):
    def tokens(body):
        r = httpx.post(server.url + "/tokenize", json=body, headers=server.headers)
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    expected = tokens({"prompt": "[user] hi\n[assistant] ", "add_special_tokens": False})
    assert tokens({"messages": USER}) == expected
    r = httpx.post(server.base_url + "/chat/completions", json={"messages": USER, "max_tokens": 1},
                   headers=server.headers, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(expected), r.text


def test_generation_config_folder(server):
    r = httpx.post(server.base_url + "/completions", json={"prompt": "hi", "ignore_eos": True},
                   headers=server.headers, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    assert "max_tokens=3, temperature=0.5," in server.log()
    assert "default sampling parameters from generation_config.json" in server.log()


@pytest.mark.parametrize("flags, message", [
    (["--ssl-certfile", "/nonexistent/cert.pem"], "--ssl-certfile /nonexistent/cert.pem: no such file"),
    (["--ssl-keyfile", "/nonexistent/key.pem"], "--ssl-keyfile needs --ssl-certfile"),
    (["--chat-template", "/nonexistent/template.jinja"], "is no file"),
    (["--chat-template", "{% for m in messages %}"], "not a valid Jinja template"),
])
def test_bad_flags_stop_serve_before_the_model_loads(flags, message, monkeypatch, capsys):
    def no_model(**kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(server_main, "EngineConfig", no_model)
    assert main(["serve", *flags, "--port", "0"]) == 2
    assert message in capsys.readouterr().err


def test_bad_cert_is_a_clear_error(tmp_path, monkeypatch, capsys):
    cert = tmp_path / "cert.pem"
    cert.write_text("not a certificate")
    monkeypatch.setattr(server_main, "EngineConfig", lambda **kw: pytest.fail("the model was loaded"))
    assert main(["serve", "--ssl-certfile", str(cert), "--port", "0"]) == 2
    assert "cannot load the certificate and key" in capsys.readouterr().err


def test_allowed_origins_must_be_a_json_list(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--allowed-origins", "https://ui.example"])
    assert "expected a JSON list of strings" in capsys.readouterr().err


def test_generation_config_folder_without_the_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(server_main, "EngineConfig", lambda **kw: pytest.fail("the model was loaded"))
    assert main(["serve", "--generation-config", str(tmp_path), "--port", "0"]) == 2
    assert "no generation_config.json" in capsys.readouterr().err
