"""`replayllm run-batch` (entrypoints/cli/run_batch.py, vLLM's): an OpenAI batch file answered offline by the server's
routes in this process; each answer equals what the offline LLM computes, in input order, and every bad line gets
its own 400 line while the others are answered."""

from __future__ import annotations

import json

from replayllm import LLM, SamplingParams
from replayllm.entrypoints.cli.main import main

ENGINE = ["--device", "cpu", "--dtype", "float32", "--max-model-len", "256", "--enable-trace-replay",
          "--batch-invariant"]
TRACE = [1052, 12163, 264]


def _line(custom_id: str, url: str, body: dict, method: str = "POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


def test_a_batch_file_is_answered_as_the_offline_engine_answers(tmp_path):
    lines = [
        _line("chat", "/v1/chat/completions", {"model": "replayllm/tiny-qwen3", "max_tokens": 5, "temperature": 0,
                                               "messages": [{"role": "user", "content": "Hi there"}]}),
        _line("trace", "/v1/completions", {"model": "replayllm/tiny-qwen3", "prompt": "Once upon a time",
                                           "trace_decode_token_ids": TRACE, "logprobs": 0}),
        _line("url", "/v1/embeddings", {"input": "x"}),
        _line("method", "/v1/completions", {"prompt": "a"}, method="GET"),
        _line("stream", "/v1/completions", {"model": "replayllm/tiny-qwen3", "prompt": "a", "stream": True}),
        _line("refused", "/v1/completions", {"model": "replayllm/tiny-qwen3", "prompt": "a", "max_tokens": -1}),
        "not json",
        _line("after", "/v1/completions", {"model": "replayllm/tiny-qwen3", "prompt": "a", "max_tokens": 2,
                                           "temperature": 0}),
    ]
    source, sink = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(lines) + "\n\n")  # a blank line is skipped
    assert main(["run-batch", "-i", str(source), "-o", str(sink), "--model", "replayllm/tiny-qwen3", *ENGINE]) == 0
    out = [json.loads(line) for line in sink.read_text().splitlines()]
    assert [o["custom_id"] for o in out] == ["chat", "trace", "url", "method", "stream", "refused", None, "after"]
    assert [o["response"]["status_code"] for o in out] == [200, 200, 400, 400, 400, 400, 400, 200]
    assert all((o["error"] is None) == (o["response"]["status_code"] == 200) for o in out)
    assert all(o["response"]["body"] is None for o in out if o["error"] is not None)
    assert "max_tokens" in out[5]["error"]["message"] and "/v1/embeddings" in out[2]["error"]["message"]

    # batch-invariant on both sides: the batch file's requests ran together, the offline ones alone
    llm = LLM(device="cpu", dtype="float32", max_model_len=256, enable_trace_replay=True, batch_invariant=True)
    chat = llm.chat([{"role": "user", "content": "Hi there"}], SamplingParams(temperature=0, max_tokens=5),
                    use_tqdm=False)[0].outputs[0]
    assert out[0]["response"]["body"]["choices"][0]["message"]["content"] == chat.text
    replay = llm.generate("Once upon a time", SamplingParams(trace_decode_token_ids=TRACE, logprobs=0),
                          use_tqdm=False)[0].outputs[0]
    choice = out[1]["response"]["body"]["choices"][0]
    assert choice["text"] == replay.text
    assert choice["logprobs"]["token_logprobs"] == [d[t].logprob for t, d in zip(TRACE, replay.logprobs)]


def test_missing_files_are_one_line_errors(tmp_path, capsys):
    assert main(["run-batch", "-i", str(tmp_path / "none.jsonl"), "-o", str(tmp_path / "out.jsonl")]) == 2
    assert "none.jsonl" in capsys.readouterr().err
    (tmp_path / "in.jsonl").write_text("")
    assert main(["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "no" / "out.jsonl")]) == 2
