"""`replayllm chat` / `complete` against a CPU server started from a --config file; the server's stats line."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest
import yaml
from helpers.server_utils import API_KEY, RemoteServer

NAMES = ["alpha", "beta"]
SAMPLING = ["--temperature", "0", "--max-tokens", "6"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Configured by a YAML file only (vLLM's --config), logging its stats line every 0.5 s."""
    cwd = tmp_path_factory.mktemp("chat_client")
    config = cwd / "serve.yaml"
    config.write_text(yaml.safe_dump({"device": "cpu", "dtype": "float32", "max_model_len": 512,
                                      "served-model-name": NAMES, "api-key": API_KEY}))
    srv = RemoteServer(["--config", str(config)], cwd, api_key=API_KEY,
                       env={"REPLAYLLM_LOG_STATS_INTERVAL": "0.5"})
    yield srv
    srv.stop()


def _client(server, command: str, *args: str, stdin: str = "", api_key: str | None = API_KEY):
    env = {k: v for k, v in os.environ.items() if k not in ("REPLAYLLM_API_KEY", "OPENAI_API_KEY")}
    key = ["--api-key", api_key] if api_key else []
    return subprocess.run([sys.executable, "-m", "replayllm.entrypoints.cli", command, "--url", server.base_url, *key,
                           *args], input=stdin, capture_output=True, text=True, timeout=300, cwd=server.log_path.parent,
                          env=env)


def _reference(server, route: str, body: dict) -> str:
    r = httpx.post(server.base_url + route, json={"model": NAMES[0], "temperature": 0, "max_tokens": 6, **body},
                   headers=server.headers, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def test_server_runs_from_the_config_file(server):
    r = httpx.get(server.base_url + "/models", headers=server.headers)
    assert [m["id"] for m in r.json()["data"]] == NAMES and r.json()["data"][0]["max_model_len"] == 512
    assert httpx.get(server.base_url + "/models").status_code == 401  # api-key came from the file too


def test_chat_quick_prints_the_streamed_reply(server):
    out = _client(server, "chat", "--quick", "Hello there", *SAMPLING)
    assert out.returncode == 0, out.stderr
    want = _reference(server, "/chat/completions", {"messages": [{"role": "user", "content": "Hello there"}]})
    assert want and out.stdout == want + "\n"


def test_chat_interactive_keeps_the_conversation(server):
    out = _client(server, "chat", "--system-prompt", "Be brief.", "--model-name", NAMES[1], *SAMPLING,
                  stdin="Hello\nAnd then?\n")
    assert out.returncode == 0, out.stderr
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    first = _reference(server, "/chat/completions", {"messages": messages})
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "And then?"}]
    second = _reference(server, "/chat/completions", {"messages": messages})
    banner = f"Chatting with {NAMES[1]} at {server.base_url}; Ctrl-D to quit.\n"
    assert out.stdout == f"{banner}> {first}\n> {second}\n> \n"


def test_complete_quick_and_interactive(server):
    out = _client(server, "complete", "-q", "Once upon a time", *SAMPLING)
    assert out.returncode == 0, out.stderr
    assert out.stdout == _reference(server, "/completions", {"prompt": "Once upon a time"}) + "\n"
    out = _client(server, "complete", *SAMPLING, stdin="The cat\nA dog\n")
    assert out.returncode == 0, out.stderr
    replies = [_reference(server, "/completions", {"prompt": p}) for p in ("The cat", "A dog")]
    assert out.stdout == (f"Completing with {NAMES[0]} at {server.base_url}; Ctrl-D to quit.\n"
                          f"> {replies[0]}\n> {replies[1]}\n> \n")


@pytest.mark.parametrize("args, api_key, message", [
    (["--model-name", "nope"], API_KEY, "the server answered 404: The model `nope` does not exist"),
    ([], None, "the server answered 401: Incorrect or missing API key"),
])
def test_client_errors_are_one_line(server, args, api_key, message):
    out = _client(server, "chat", "-q", "hi", *args, api_key=api_key)
    assert out.returncode == 1 and message in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_client_without_a_server_says_so(tmp_path):
    out = subprocess.run([sys.executable, "-m", "replayllm.entrypoints.cli", "complete", "-q", "hi", "--url",
                          "http://127.0.0.1:9/v1"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 1 and "error: cannot reach http://127.0.0.1:9/v1" in out.stderr, out.stderr


def test_server_logs_its_stats_line(server):
    """On by default (the fixture only shortens the interval); the earlier requests moved the throughput."""
    deadline = time.monotonic() + 60
    while "Avg prompt throughput" not in server.log():
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.2)
    lines = [line for line in server.log().splitlines() if "Avg prompt throughput" in line]
    assert "Running: " in lines[0] and "KV cache usage: " in lines[0] and "Prefix cache hit rate: " in lines[0]
