"""The HTTP side's floor per request: what a streamed completion's intake costs the API process before any of our
route's work, to compare with `bench/api_cost.py`'s whole `/v1/completions` (docs/benchmarks.md, session 26).

Usage: python bench/http_floor.py [--num-prompts 1000 --input-len 512]
                                 [--modes guarded,guarded-h11,h11,httptools,app,app-h11]
Each mode serves one trivial streaming endpoint (read the body, json.loads it, answer 3 SSE chunks shaped like a
completion's: a token, the usage, [DONE]) in a process of its own, and `replayllm bench serve` (rate=inf, one
output token) drives it; printed: the server process's CPU (user + system) per request and the median TTFT.
- guarded / guarded-h11: a bare ASGI app on `replayllm serve`'s own protocols (`http_protocol.protocol_class`:
  GuardedHttpToolsProtocol, GuardedH11Protocol)
- h11 / httptools: the same app on uvicorn's own protocols (httptools modes only when it is installed)
- app / app-h11: `build_app`'s whole stack (its middlewares, FastAPI routing; the tiny embedded model
  in-process, unused) on the guarded protocols, with the trivial endpoint added as a route taking `Request`
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time

import httpx
from api_cost import cpu_seconds  # bench/ is this script's folder (sys.path[0])
from fastapi import Request  # module level: the route's annotations are strings FastAPI resolves here
from starlette.responses import Response

from replayllm.entrypoints.bench.serve import add_cli_args, run

CHUNKS = (b'data: {"id":"x","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":"a",'
          b'"logprobs":null,"finish_reason":"length"}]}\n\n',
          b'data: {"id":"x","object":"text_completion","created":1,"model":"m","choices":[],"usage":'
          b'{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}\n\n',
          b"data: [DONE]\n\n")
MODELS = json.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]}).encode()
SSE = [(b"content-type", b"text/event-stream")]


async def bare_app(scope, receive, send) -> None:
    """The trivial endpoint as a bare ASGI app (GET: the model list bench serve asks for first)."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    if scope["method"] == "GET":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": MODELS})
        return
    body, more = b"", True
    while more:
        message = await receive()
        body, more = body + message.get("body", b""), message.get("more_body", False)
    json.loads(body)
    await send({"type": "http.response.start", "status": 200, "headers": SSE})
    for chunk in CHUNKS:
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


def whole_app():
    """build_app's stack around an in-process tiny engine, plus the trivial endpoint at /floor."""
    from replayllm.config import EngineConfig
    from replayllm.engine.llm_engine import LLMEngine
    from replayllm.entrypoints.openai.api_server import build_app

    app = build_app(engine=LLMEngine(EngineConfig(model=None, device="cpu", dtype="float32", max_model_len=512)))

    @app.post("/floor")
    async def floor(request: Request):
        json.loads(await request.body())
        return Response(b"".join(CHUNKS), media_type="text/event-stream")

    return app


def serve(mode: str, port: int) -> None:
    """The server process's entry point (`python bench/http_floor.py --serve MODE PORT`)."""
    import uvicorn

    from replayllm.entrypoints.http.connection_limits import ConnectionLimits
    from replayllm.entrypoints.http.http_protocol import protocol_class

    http = {"h11": "h11", "httptools": "httptools"}.get(mode) or protocol_class(
        ConnectionLimits(), "h11" if mode.endswith("-h11") else "httptools")
    app = None if mode.startswith("app") else bare_app
    uvicorn.run(app or whole_app(), host="127.0.0.1", port=port, http=http, log_level="warning")


def measure(mode: str, port: int, opts: argparse.Namespace) -> dict:
    proc = subprocess.Popen([sys.executable, __file__, "--serve", mode, str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the {mode} server did not start")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        p = argparse.ArgumentParser()
        add_cli_args(p)
        args = p.parse_args(["--port", str(port), "--num-prompts", str(opts.num_prompts), "--random-input-len",
                             str(opts.input_len), "--random-output-len", "1", "--ignore-eos", "--endpoint",
                             "/floor" if mode.startswith("app") else "/v1/completions"])
        cpu0 = cpu_seconds(proc.pid)
        result = run(args)
        cpu = cpu_seconds(proc.pid) - cpu0
    finally:
        proc.terminate()
        proc.wait(30)
    return {"mode": mode, "completed": result["completed"],
            "server_us_per_request": round(1e6 * cpu / max(result["completed"], 1)),
            "median_ttft_ms": round(result["median_ttft_ms"], 1)}


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--serve":
        return serve(sys.argv[2], int(sys.argv[3]))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--modes", default="guarded,guarded-h11,h11,httptools,app,app-h11")
    opts = ap.parse_args()
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for mode in opts.modes.split(","):
        if mode in ("guarded", "httptools", "app") and importlib.util.find_spec("httptools") is None:
            print(json.dumps({"mode": mode, "skipped": "httptools is not installed"}))
            continue
        print(json.dumps(measure(mode, port, opts)), flush=True)


if __name__ == "__main__":
    main()
