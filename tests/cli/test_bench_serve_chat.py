"""`replayllm bench serve --backend openai-chat` (vLLM's chat backend): each random prompt's text as one user message
streamed through /v1/chat/completions, the role chunk not counted as a token, the routes and tokenizer it needs."""

from __future__ import annotations

import json

from replayllm.embedded_model import DEFAULT_MODEL, materialize
from replayllm.entrypoints.bench import serve, serve_prompts
from replayllm.entrypoints.cli.main import main as cli_main


def test_chat_backend_against_a_cpu_server(shared_open_trace_server, tmp_path, capsys, monkeypatch):
    sent = []
    make = serve_prompts.make_bodies
    monkeypatch.setattr(serve, "make_bodies", lambda args, model: sent.extend(make(args, model)) or sent)
    for trace in (False, True):
        sent.clear()
        result = tmp_path / f"chat-{trace}.json"
        argv = ["bench", "serve", "--base-url", shared_open_trace_server.url, "--backend", "openai-chat",
                "--tokenizer", materialize(DEFAULT_MODEL), "--num-prompts", "3", "--random-input-len", "6",
                "--random-output-len", "4", "--ignore-eos", "--seed", "1", "--save-result", str(result),
                *(["--trace"] if trace else [])]
        assert cli_main(argv) == 0, capsys.readouterr().err
        assert "Serving Benchmark Result" in capsys.readouterr().out
        assert len(sent) == 3 and all("prompt" not in b and b["messages"][0]["role"] == "user" for b in sent)
        assert all(isinstance(b["messages"][0]["content"], str) and b["messages"][0]["content"] for b in sent)
        assert all(b.get("max_completion_tokens") == (None if trace else 4) for b in sent)
        summary = json.loads(result.read_text())
        assert summary["backend"] == "openai-chat" and summary["completed"] == 3
        assert summary["total_output_tokens"] == 12  # from the usage chunk: the role chunk is no token
        # each prompt is the server's count: the chat template's tokens around the user's text
        assert all(r["prompt_len"] > 6 for r in summary["per_request"])
        assert all(0 < r["ttft"] <= r["latency"] for r in summary["per_request"])
        # ITL: the gaps after the first token only (3 a request), none for the role chunk
        assert summary["median_itl_ms"] > 0


def test_chat_backend_refusals(tmp_path, capsys):
    """Each refused at once (exit 2), no server needed: a chat backend on a completions route and the reverse,
    and a chat backend without a tokenizer to turn the ids into text."""
    cases = [(["--backend", "openai-chat", "--tokenizer", str(tmp_path), "--endpoint", "/v1/completions"],
              "--backend openai-chat streams through a chat/completions route"),
             (["--endpoint", "/v1/chat/completions"], "not a chat one"),
             (["--backend", "openai-chat"], "--backend openai-chat sends each prompt as text: name --tokenizer")]
    for flags, message in cases:
        assert cli_main(["bench", "serve", "--port", "9", "--num-prompts", "1", *flags]) == 2
        assert message in capsys.readouterr().err


def test_role_chunk_is_not_the_first_token():
    """The role chunk (no content) does not start TTFT; the first content chunk does, and its gap to the next is
    the first ITL."""
    result = serve.RequestResult()
    arrivals = serve.Arrivals(result, start=0.0)
    role = b'{"id":"c","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null}]}'
    token = b'{"id":"c","choices":[{"index":0,"delta":{"content":"Hi"},"logprobs":null}]}'
    assert arrivals.take(role, 0.25) and result.ttft == 0.0
    assert arrivals.take(token, 0.5) and arrivals.take(token, 0.75)
    assert result.ttft == 0.5 and result.itl == [0.25]
