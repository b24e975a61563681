"""`replayllm bench serve`: vLLM's `bench serve` against a running server: random prompts (token ids, or their
text with --text-prompts; serve_prompts.py) streamed through /v1/completions, or as one user message each through
/v1/chat/completions (--backend openai-chat), greedy or replaying random traces; TTFT / TPOT / ITL / E2EL and
throughput."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from dataclasses import asdict, dataclass, field

from .serve_prompts import BACKENDS, check_backend, make_bodies
from .workload import check_output_path


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default=None, help="server URL, e.g. http://127.0.0.1:8000 (default: from "
                                                         "--host/--port)")
    parser.add_argument("--host", default="127.0.0.1", help="server host (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="server port (default: 8000)")
    parser.add_argument("--backend", default="openai", choices=BACKENDS,
                        help="the API driven: streaming /v1/completions (openai; vllm is vLLM's alias of it) or "
                             "/v1/chat/completions (openai-chat: each prompt's text as one user message; needs "
                             "--tokenizer, or --model naming a local folder)")
    parser.add_argument("--endpoint", default=None,
                        help="the streaming route (default: /v1/completions, openai-chat's /v1/chat/completions)")
    parser.add_argument("--model", default=None, help="the model name sent (default: the server's first)")
    parser.add_argument("--served-model-name", default=None,
                        help="vLLM's: the model name sent in requests when it differs from --model (which then "
                             "names the folder the vocabulary size is read from)")
    parser.add_argument("--tokenizer", default=None, metavar="PATH",
                        help="a tokenizer folder: prompt/trace ids are drawn below its vocabulary size (default: "
                             "--model's folder when it is one)")
    parser.add_argument("--dataset-name", default="random", choices=["random"],
                        help="prompts: random token ids (the only dataset)")
    parser.add_argument("--text-prompts", action="store_true",
                        help="send each prompt as the text its random ids decode to with --tokenizer, as vLLM's "
                             "random dataset does: the server tokenizes every prompt (token ids skip that); the "
                             "input tokens counted are the server's (usage)")
    parser.add_argument("--random-input-len", type=int, default=1024, help="prompt tokens per request")
    parser.add_argument("--random-output-len", type=int, default=128, help="max_tokens per request")
    parser.add_argument("--random-range-ratio", type=float, default=0.0, metavar="R",
                        help="draw each request's input and output lengths uniformly from [len x (1-R), len x (1+R)] "
                             "(0 <= R < 1; default 0: every request the same)")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="draw prompt/trace ids below this (default: from --tokenizer or --model's "
                             "config.json when it is a local folder, else Qwen3's vocabulary)")
    parser.add_argument("--num-prompts", type=int, default=1000, help="requests sent (default: 1000)")
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="requests per second, Poisson arrivals (default inf: all at once)")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="vLLM's: arrival gaps from a gamma distribution of this shape at --request-rate (1: "
                             "Poisson; below 1 burstier, above 1 more even)")
    parser.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    parser.add_argument("--ignore-eos", action="store_true", help="generate exactly --random-output-len tokens")
    parser.add_argument("--trace", action="store_true",
                        help="each request replays a random trace of --random-output-len tokens with logprobs=1 "
                             "(the server needs --enable-trace-replay)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts and traces")
    parser.add_argument("--api-key", default=os.environ.get("REPLAYLLM_API_KEY") or os.environ.get("OPENAI_API_KEY"),
                        help="bearer key (default: env REPLAYLLM_API_KEY, else OPENAI_API_KEY as vLLM's clients)")
    parser.add_argument("--percentile-metrics", default="ttft,tpot,itl", metavar="LIST",
                        help=f"comma-separated metrics whose percentiles are printed, of {','.join(METRICS)} "
                             "(default: ttft,tpot,itl; the JSON has all four)")
    parser.add_argument("--metric-percentiles", default="99", metavar="LIST",
                        help="comma-separated percentiles reported, e.g. 25,50,99 (default: 99)")
    parser.add_argument("--save-result", nargs="?", const=True, default=None, metavar="FILE",
                        help="write the result as JSON: to FILE, or (vLLM's spelling, no value) to "
                             "--result-dir/--result-filename")
    parser.add_argument("--result-dir", default=None, metavar="DIR",
                        help="folder of the --save-result file (default: the current one; created if missing)")
    parser.add_argument("--metadata", nargs="*", default=[], metavar="KEY=VALUE",
                        help="vLLM's: KEY=VALUE pairs written into the --save-result JSON (e.g. version=1 gpu=h200)")
    parser.add_argument("--disable-tqdm", action="store_true",
                        help="vLLM's; accepted for its scripts: this client draws no progress bar anyway")
    parser.add_argument("--result-filename", default=None, metavar="NAME",
                        help="name of the --save-result file (default: BACKEND-RATEqps-MODEL-YYYYmmdd-HHMMSS.json)")


METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestResult:
    """One streamed request as the client saw it (seconds, time.perf_counter differences)."""

    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)  # between successive chunks that carried text or tokens
    # From the request's start to its body's last byte handed to the socket: the client's own queueing (at
    # rate=inf one event loop sends every request), inside ttft; 0.0 when not seen.
    send_delay: float = 0.0
    error: str = ""


def check_args(args: argparse.Namespace) -> None:
    """Every flag checked before a request is sent (exit 2 with one error line), the result folder included: a run
    that cannot save its result fails here, not after it ran."""
    for name in ("num_prompts", "random_input_len", "random_output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (inf: all at once), got {args.request_rate}")
    if not 0 < args.burstiness < float("inf"):
        raise ValueError(f"--burstiness must be a finite number > 0, got {args.burstiness}")
    metadata(args)
    check_backend(args)
    if args.text_prompts and not args.tokenizer:
        raise ValueError("--text-prompts decodes the random ids with --tokenizer: name the tokenizer folder")
    if not 0 <= args.random_range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {args.random_range_ratio}")
    percentile_metrics(args)
    metric_percentiles(args)
    if (args.result_dir or args.result_filename) and not args.save_result:
        raise ValueError("--result-dir and --result-filename name the --save-result file: add --save-result")
    if args.result_dir:
        try:
            os.makedirs(args.result_dir, exist_ok=True)
        except OSError as e:
            raise ValueError(f"--result-dir {args.result_dir!r} cannot be created: {e}") from e
        if not os.access(args.result_dir, os.W_OK):
            raise ValueError(f"--result-dir {args.result_dir!r} is not writable")
    if isinstance(args.save_result, str):
        check_output_path("--save-result", os.path.join(args.result_dir or "", args.save_result))



def percentile_metrics(args: argparse.Namespace) -> list[str]:
    names = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    unknown = [m for m in names if m not in METRICS]
    if unknown or not names:
        raise ValueError(f"--percentile-metrics takes a comma-separated list of {', '.join(METRICS)}, "
                         f"got {args.percentile_metrics!r}")
    return names


def metric_percentiles(args: argparse.Namespace) -> list[float]:
    try:
        values = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    except ValueError:
        values = []
    if not values or not all(0 < p <= 100 for p in values):
        raise ValueError(f"--metric-percentiles takes comma-separated numbers in (0, 100], "
                         f"got {args.metric_percentiles!r}")
    return values


def result_path(args: argparse.Namespace, model: str) -> str | None:
    """Where --save-result writes: its FILE, else --result-dir / (--result-filename or vLLM's default name)."""
    if args.save_result is None:
        return None
    if isinstance(args.save_result, str):
        return os.path.join(args.result_dir, args.save_result) if args.result_dir else args.save_result
    rate = "inf" if args.request_rate == float("inf") else f"{args.request_rate:g}"
    name = args.result_filename or (f"{args.backend}-{rate}qps-{os.path.basename(model.rstrip('/'))}-"
                                    f"{time.strftime('%Y%m%d-%H%M%S')}.json")
    return os.path.join(args.result_dir or ".", name)


class Arrivals:
    """A streamed response's SSE `data:` payloads -> its RequestResult: the first token's time, the gaps between
    chunks that carried text or tokens, the completion tokens from the usage chunk, an in-band error."""

    def __init__(self, result: RequestResult, start: float):
        self.result, self.start, self.last = result, start, start

    def take(self, payload: bytes, now: float) -> bool:
        """One payload that arrived at `now`; False at [DONE] or an error (then `result.error` is set)."""
        if payload == b"[DONE]":
            return False
        result = self.result
        if b'"delta":{"role"' in payload:  # a chat stream's role chunk: no token (vLLM's client counts it)
            return True
        if b'"choices":[{' in payload and b'"usage":{' not in payload:
            # A token chunk in compact JSON (a quote inside a JSON string is escaped, so this cannot match
            # inside one): its arrival is all that is needed, no parse (~25% of the client's CPU per chunk).
            # Any other payload (usage, errors, JSON with spaces) is parsed.
            self._token(now)
            return True
        chunk = json.loads(payload)
        if "error" in chunk:
            result.error = str(chunk["error"].get("message", chunk["error"]))[:200]
            return False
        if chunk.get("choices"):
            self._token(now)
        usage = chunk.get("usage")
        if usage:
            result.output_tokens = usage["completion_tokens"]
            result.prompt_len = usage.get("prompt_tokens", result.prompt_len)  # the server's count (text prompts)
        return True

    def _token(self, now: float) -> None:
        if self.result.ttft == 0.0:
            self.result.ttft = now - self.start
        else:
            self.result.itl.append(now - self.last)
        self.last = now


async def _one(session, url: str, body: dict, headers: dict) -> RequestResult:
    """POST one streaming request; the SSE events are split here from whatever bytes each read brings (several
    events that arrive in one read count as arriving together, as with vLLM's client)."""
    prompt = body.get("prompt")
    result = RequestResult(prompt_len=len(prompt) if isinstance(prompt, list) else 0)  # text: from the usage
    start = time.perf_counter()
    sent: list[float] = []  # filled by _on_sent (aiohttp's trace hooks)
    try:
        async with session.post(url, json=body, headers=headers, trace_request_ctx=sent) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.read())[:200].decode(errors='replace')}"
                return result
            pending, arrivals = b"", Arrivals(result, start)
            async for data in response.content.iter_any():
                now = time.perf_counter()
                events = (pending + data).split(b"\n\n")
                pending = events.pop()  # an incomplete event waits for the next read
                for event in events:
                    if event.startswith(b"data: ") and not arrivals.take(event[6:], now):
                        break
                if result.error:
                    return result
        result.latency = time.perf_counter() - start
        result.send_delay = sent[-1] - start if sent else 0.0
        result.success = result.ttft > 0.0
        if not result.success:
            result.error = "no token came back"
    except Exception as e:  # noqa: BLE001 - counted as a failed request, reported in the result
        result.error = f"{type(e).__name__}: {e}"
    return result


async def _on_sent(session, trace_ctx, params) -> None:
    """aiohttp's on_request_chunk_sent: a body chunk of the request went to the socket (when, in its list)."""
    if isinstance(trace_ctx.trace_request_ctx, list):  # a benchmark request's (not the /v1/models probe)
        trace_ctx.trace_request_ctx.append(time.perf_counter())


async def _arrivals(n: int, rate: float, rng: random.Random, burstiness: float = 1.0):
    """Yield n times: at once for rate inf, else after exponential gaps (a Poisson process of `rate`/s), or with
    `burstiness` != 1 gamma gaps of that shape and mean 1 / rate (vLLM's)."""
    for i in range(n):
        yield i
        if rate != float("inf"):
            gap = rng.expovariate(rate) if burstiness == 1.0 else rng.gammavariate(burstiness, 1 / (rate * burstiness))
            await asyncio.sleep(gap)


def metadata(args: argparse.Namespace) -> dict[str, str]:
    """--metadata KEY=VALUE pairs (ValueError for one without "=")."""
    bad = [m for m in args.metadata if "=" not in m or m.startswith("=")]
    if bad:
        raise ValueError(f"--metadata takes KEY=VALUE pairs, got {bad}")
    return dict(m.split("=", 1) for m in args.metadata)


async def run_benchmark(args: argparse.Namespace) -> dict:
    # aiohttp, as vLLM's client: its C parser costs ~30 us of client CPU per streamed chunk where httpx's
    # line iterator cost ~200 us (CPU machine) -- at S1's 64k chunks the client, not the server, set the pace.
    import aiohttp

    base = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    connector = aiohttp.TCPConnector(limit=0, force_close=False)  # no cap: --max-concurrency is the only cap
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=60.0)
    tracing = aiohttp.TraceConfig()
    tracing.on_request_chunk_sent.append(_on_sent)  # each request's send delay (RequestResult.send_delay)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, trace_configs=[tracing]) as session:
        try:
            async with session.get(base + "/v1/models", headers=headers) as response:
                if response.status != 200:
                    raise ValueError(f"{base}/v1/models answered HTTP {response.status}: "
                                     f"{(await response.read())[:200].decode(errors='replace')}")
                models = (await response.json())["data"]
        except aiohttp.ClientError as e:
            raise ValueError(f"cannot reach the server at {base}: {e}") from e
        served = [m["id"] for m in models]
        flag = "--served-model-name" if args.served_model_name else "--model"
        name = args.served_model_name or args.model
        if name and name not in served:  # a typo must not benchmark another model quietly
            raise ValueError(f"{flag} {name!r} is not served at {base} (it serves {served})")
        model = name or served[0]
        bodies = make_bodies(args, model)
        limit = asyncio.Semaphore(args.max_concurrency or len(bodies))

        async def limited(body: dict) -> RequestResult:
            async with limit:
                return await _one(session, base + args.endpoint, body, headers)  # check_backend set it

        start = time.perf_counter()
        tasks = []
        async for i in _arrivals(len(bodies), args.request_rate, random.Random(args.seed + 1), args.burstiness):
            tasks.append(asyncio.create_task(limited(bodies[i])))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(args, model, results, duration)


def _stats(name: str, values: list[float], percentiles: list[float]) -> dict[str, float]:
    """mean / median / std and each percentile (numpy's linear interpolation, as vLLM) of values, in ms."""
    import numpy as np

    ms = np.asarray(values or [0.0], dtype=np.float64) * 1000
    out = {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
           f"std_{name}_ms": float(ms.std())}
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = float(np.percentile(ms, p))
    return out


def summarize(args: argparse.Namespace, model: str, results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.success]
    percentiles = metric_percentiles(args)
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    summary = {
        "date": time.strftime("%Y%m%d-%H%M%S"), "backend": args.backend, "model": model,
        "model_id": model, "tokenizer_id": args.tokenizer or model,  # vLLM's names for them
        "num_prompts": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        # vLLM's "inf" (JSON has no infinity: Python would write a bare Infinity, which parsers refuse)
        "request_rate": args.request_rate if args.request_rate != float("inf") else "inf",
        "burstiness": args.burstiness, **metadata(args),
        "max_concurrency": args.max_concurrency, "trace": bool(args.trace),
        "input_len": args.random_input_len, "output_len": args.random_output_len, "duration": duration,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "percentile_metrics": percentile_metrics(args), "metric_percentiles": percentiles,
        **_stats("ttft", [r.ttft for r in ok], percentiles), **_stats("tpot", tpots, percentiles),
        **_stats("itl", [x for r in ok for x in r.itl], percentiles),
        **_stats("e2el", [r.latency for r in ok], percentiles),
        # Not one of vLLM's metrics: the client's own share of ttft (its send queue), mean and median in ms.
        **{k: v for k, v in _stats("send_delay", [r.send_delay for r in ok], []).items() if not k.startswith("std")},
        "errors": sorted({r.error for r in results if not r.success})[:5],
    }
    summary["per_request"] = [asdict(r) | {"itl": None} for r in results]  # itl lists are long: left out
    return summary


def format_result(s: dict) -> str:
    """vLLM's result block."""
    rows = [("Successful requests:", s["completed"]), ("Failed requests:", s["failed"])]
    if s["max_concurrency"] is not None:  # as vLLM: the line only when a cap was set
        rows.append(("Maximum request concurrency:", s["max_concurrency"]))
    rows += [("Benchmark duration (s):", f"{s['duration']:.2f}"), ("Total input tokens:", s["total_input_tokens"]),
            ("Total generated tokens:", s["total_output_tokens"]),
            ("Request throughput (req/s):", f"{s['request_throughput']:.2f}"),
            ("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}"),
            ("Total Token throughput (tok/s):", f"{s['total_token_throughput']:.2f}")]
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]
    lines += [f"{k:<40} {v:<10}" for k, v in rows]
    titles = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
              "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    stats = [("mean", "Mean"), ("median", "Median")]
    stats += [(f"p{p:g}", f"P{p:g}") for p in s.get("metric_percentiles", [99])]
    for key in s.get("percentile_metrics", METRICS):
        lines.append("{s:{c}^50}".format(s=titles[key], c="-"))
        label = key.upper()
        for stat, name in stats:
            value = s[f"{stat}_{key}_ms"]  # None when no request succeeded
            lines.append(f"{f'{name} {label} (ms):':<40} {'n/a' if value is None else f'{value:.2f}':<10}")
    lines.append("=" * 50)
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict:
    """run_benchmark on uvloop when it is installed (as uvicorn runs the server): the client's event loop is
    a share of its CPU per streamed chunk, and a client that falls behind measures itself, not the server."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(run_benchmark(args))
    return uvloop.run(run_benchmark(args))


def main(args: argparse.Namespace) -> int:
    check_args(args)
    summary = run(args)
    print(format_result(summary))
    for error in summary["errors"]:
        print(f"failed request: {error}")
    path = result_path(args, summary["model"])
    if path:
        with open(path, "w") as f:
            json.dump(summary, f, indent=2)
        print(f"result written to {path}")
    return 0 if summary["completed"] == summary["num_prompts"] else 1
