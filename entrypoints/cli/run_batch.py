"""`replayllm run-batch -i IN.jsonl -o OUT.jsonl [MODEL] [engine options]`: vLLM's run-batch, the OpenAI batch file
format run offline. Each input line is {"custom_id", "method": "POST", "url", "body"}; /v1/chat/completions and
/v1/completions bodies are answered by the server's own routes (the app of `replayllm serve`, in this process, no
socket), all requests in flight together so the engine batches them. Each output line, in input order:
{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}: a 200's body in `response.body`, a
refused request's OpenAI-style error in `error` with its status code (and `response.body` null); a line that is
not a request at all (bad JSON, a missing field, another method or URL, `stream: true`) gets status 400 and the
reason. The exit status is 0 when every line was read, as vLLM's."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import uuid

from .cli_parser import Subcommands
from .engine_args import add_engine_args_for, engine_kwargs
from .serve_compat_args import add_model_option, resolve_model_option
from .server_args import add_override_generation_config

URLS = ("/v1/chat/completions", "/v1/completions")  # the routes a batch line may name
IN_FLIGHT = 1024  # most requests handed to the app at once (the engine queues what its batch cannot hold)


def add_run_batch(sub: Subcommands, command: str | None) -> None:
    run = sub.add_parser("run-batch", help="answer an OpenAI batch file (JSONL of /v1/chat/completions and "
                                           "/v1/completions requests) offline, as vLLM's run-batch")
    run.add_argument("model", nargs="?", default=None, help="model dir or id (default: the embedded model)")
    add_model_option(run)  # vLLM's `vllm run-batch ... --model M`
    run.add_argument("-i", "--input-file", required=True, help="the batch file: one request object per line")
    run.add_argument("-o", "--output-file", required=True, help="where the answers go (JSONL, input order)")
    run.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                     help="default sampling parameters, as `replayllm serve`'s: 'auto' the model's "
                          "generation_config.json (default), 'vllm' none, or the one in FOLDER")
    add_override_generation_config(run)
    run.add_argument("--chat-template", default=None, metavar="PATH_OR_JINJA",
                     help="chat template instead of the tokenizer's: a file or the template itself")
    run.add_config_arg()
    add_engine_args_for(command, run, "run-batch")
    run.set_defaults(func=cmd_run_batch)


def cmd_run_batch(args: argparse.Namespace) -> int:
    from ...config import EngineConfig
    from ...model_source import resolve_model_path
    from ..chat_template import load_chat_template
    from ..generation_config import default_sampling_params
    from ..openai.api_server import build_app

    resolve_model_option(args)
    try:
        with open(args.input_file, encoding="utf-8") as f:
            lines = [line for line in f.read().splitlines() if line.strip()]
        open(args.output_file, "a", encoding="utf-8").close()  # writable, before the model loads
    except OSError as e:
        raise ValueError(f"run-batch: {e}") from None
    config = EngineConfig(model=args.model, **engine_kwargs(args))
    app = build_app(config, chat_template=load_chat_template(args.chat_template),
                    default_sampling=default_sampling_params(args.generation_config, resolve_model_path(config.model),
                                                             args.override_generation_config))
    outputs = asyncio.run(_answer_all(app, lines))
    with open(args.output_file, "w", encoding="utf-8") as f:
        for out in outputs:
            f.write(json.dumps(out, ensure_ascii=False) + "\n")
    failed = sum(out["error"] is not None for out in outputs)
    print(f"wrote {len(outputs)} answers to {args.output_file} ({failed} with an error)", file=sys.stderr)
    return 0


async def _answer_all(app, lines: list[str]) -> list[dict]:
    """Every line's answer, the app's lifespan (its engine) around them."""
    import httpx

    gate = asyncio.Semaphore(IN_FLIGHT)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://run-batch", timeout=None) as client:

            async def one(line: str) -> dict:
                async with gate:
                    return await _answer(client, line)

            return await asyncio.gather(*(one(line) for line in lines))


async def _answer(client, line: str) -> dict:
    """One input line -> its output line."""
    try:
        request = json.loads(line)
    except ValueError as e:
        return _output(None, 400, None, f"the line is not JSON: {e}")
    if not isinstance(request, dict):
        return _output(None, 400, None, "the line is not a JSON object")
    custom_id = request.get("custom_id")
    if not isinstance(custom_id, str):
        return _output(None, 400, None, "custom_id (a string) is required")
    if request.get("method") != "POST":
        return _output(custom_id, 400, None, f"method must be POST, got {request.get('method')!r}")
    if request.get("url") not in URLS:
        return _output(custom_id, 400, None, f"url {request.get('url')!r} is not served in a batch file; "
                                             f"supported: {', '.join(URLS)}")
    body = request.get("body")
    if not isinstance(body, dict):
        return _output(custom_id, 400, None, "body (a JSON object) is required")
    if body.get("stream"):
        return _output(custom_id, 400, None, "stream is not supported in a batch file")
    response = await client.post(request["url"], json=body)
    try:
        answer = response.json()
    except ValueError:  # not JSON (never expected from these routes): the status and the text say what happened
        return _output(custom_id, response.status_code, None, response.text or "no answer")
    if response.status_code == 200:
        return _output(custom_id, 200, answer, None)
    return _output(custom_id, response.status_code, None,
                   answer.get("error", answer) if isinstance(answer, dict) else answer)


def _output(custom_id: str | None, status: int, body: dict | None, error) -> dict:
    if isinstance(error, str):
        error = {"message": error, "type": "invalid_request_error", "param": None, "code": None}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": status, "request_id": f"batch-{uuid.uuid4().hex}", "body": body},
            "error": error}
