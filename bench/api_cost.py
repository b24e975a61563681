"""The API server process's CPU cost per streamed token: `replayllm serve` driven by `replayllm bench serve`.

Usage (CPU machine or device; the server is started here, on a free port, from a temporary folder):
    python bench/api_cost.py [--num-prompts 256 --input-len 512 --output-len 128 --trace --text-prompts
                              --py-spy OUT.txt]
        [-- SERVE ARGS]   # default: the embedded tiny model, --max-num-seqs 256 (any `replayllm serve` flags)
Prints the API server process's (with `-- --api-server-count N`: the N processes' together), the engine core
process's and the benchmark client's (this process) CPU seconds (user + system, /proc/PID/stat) over the measured
run, divided by the tokens streamed: the all-in host cost per token of each process (ZMQ receive + msgspec
decode, detokenization, stop strings, chunk JSON, SSE write, HTTP transport). The core's CPU per step tells
whether it could keep up. `--py-spy FILE` samples the API process with py-spy (installed
separately: `pip install py-spy`) and writes the hottest functions (own time and with callees) to FILE.
TTFT outside the engine (the client's mean TTFT minus the server's, which runs from the hand-off to the core to
the step that made the first token) and three of its parts: the client's own send queue
(`mean_client_send_delay_ms`, `replayllm bench serve`'s send_delay), the API's intake (`mean_api_intake_ms`:
request head received -> response started, /metrics `http_response_start_seconds`) and the first token's delivery
(`mean_first_token_delivery_ms`: the core's step end -> the API handled it, /metrics
`first_token_delivery_seconds`); the rest is waiting for the API's event loop before a request's head is read,
and the chunk's way from the socket into the client. `late_kernel_variants`: Triton variants the server logged
after its start-up (kernels/jit_watch.py; a compile inside the measured run).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from replayllm.entrypoints.bench.serve import add_cli_args, run
from replayllm.kernels import jit_watch

TICKS = os.sysconf("SC_CLK_TCK")
DEFAULT_SERVE = ["--max-num-seqs", "256", "--max-model-len", "1024", "--enable-trace-replay"]


def cpu_seconds(pid: int) -> float:
    """user + system CPU seconds of a process (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime (fields 14 and 15 of stat)


def spawned(pid: int) -> tuple[int, list[int]]:
    """(the engine core, the extra API server processes of --api-server-count): the server's children started by
    multiprocessing's spawn (not its resource tracker), oldest first: the core is spawned before anything else."""
    kids = [int(kid) for task in Path(f"/proc/{pid}/task").iterdir() for kid in (task / "children").read_text().split()
            if b"spawn_main" in Path(f"/proc/{kid}/cmdline").read_bytes()]
    if not kids:
        raise RuntimeError("no engine core process found under the server")
    kids.sort(key=lambda k: int(Path(f"/proc/{k}/stat").read_text().rsplit(")", 1)[1].split()[19]))  # start time
    return kids[0], kids[1:]


def server_metrics(url: str) -> dict[str, float]:
    """The /metrics samples this script reads: engine steps, the server-side TTFT histogram's sum and count, and
    the completions route's time to its responses' start (sum and count)."""
    wanted = ("replayllm:engine_steps_total", "replayllm:time_to_first_token_seconds_sum",
              "replayllm:time_to_first_token_seconds_count",
              'replayllm:http_response_start_seconds_sum{route="/v1/completions"}',
              'replayllm:http_response_start_seconds_count{route="/v1/completions"}',
              "replayllm:first_token_delivery_seconds_sum", "replayllm:first_token_delivery_seconds_count")
    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        name, _, value = line.partition(" ")
        if name in wanted:
            out[name.split(":")[1].split("{")[0]] = float(value)
    return out


def _mean_ms(d: dict[str, float], histogram: str) -> float:
    """A histogram's mean over the measured run, in ms (0 when it saw nothing)."""
    return 1e3 * d.get(histogram + "_sum", 0.0) / max(d.get(histogram + "_count", 0.0), 1)


def start_server(serve_args: list[str], cwd: str, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "replayllm.entrypoints.cli", "serve", *serve_args, "--host", "127.0.0.1",
           "--port", str(port), "--uvicorn-log-level", "warning", "--disable-log-stats"]
    log = open(os.path.join(cwd, "server.log"), "wb")
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}):\n" + Path(cwd, "server.log").read_text())
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise TimeoutError("the server did not become ready in 600 s")


def tokenizer_dir(serve_args: list[str]) -> str:
    """The served model's folder (serve's first argument when it is one), else the embedded model's."""
    if serve_args and not serve_args[0].startswith("-") and os.path.isdir(serve_args[0]):
        return serve_args[0]
    from replayllm.embedded_model import DEFAULT_MODEL, materialize

    return materialize(DEFAULT_MODEL)


def bench_args(opts: argparse.Namespace, port: int, num_prompts: int) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_cli_args(p)
    argv = ["--port", str(port), "--num-prompts", str(num_prompts), "--random-input-len", str(opts.input_len),
            "--random-output-len", str(opts.output_len), "--ignore-eos"]
    if opts.max_concurrency:
        argv += ["--max-concurrency", str(opts.max_concurrency)]
    if getattr(opts, "tokenizer", None):
        argv += ["--text-prompts", "--tokenizer", opts.tokenizer]
    return p.parse_args(argv + (["--trace"] if opts.trace else []))


def summarize_py_spy(raw: str, top: int) -> str:
    """py-spy's collapsed stacks ('a;b;c N' lines) -> the hottest functions by own and inclusive samples."""
    own, incl, total = collections.Counter(), collections.Counter(), 0
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames, n = stack.split(";"), int(n)
        if frames[-1].startswith("EpollSelector.select"):
            continue  # the event loop waiting: idle, not cost
        total += n
        own[frames[-1]] += n
        for f in set(frames):
            incl[f] += n
    out = [f"{total} busy samples of the API server process (idle waits in select() left out)", "", "own time:"]
    out += [f"{100 * n / total:6.1f}%  {f}" for f, n in own.most_common(top)]
    out += ["", "with callees:"] + [f"{100 * n / total:6.1f}%  {f}" for f, n in incl.most_common(top)]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--trace", action="store_true", help="every request replays a trace, logprobs=1")
    ap.add_argument("--text-prompts", action="store_true",
                    help="prompts as text (bench serve --text-prompts, with the served model's tokenizer: the "
                         "server tokenizes each, as with vLLM's client; the client's CPU then includes loading the "
                         "tokenizer and decoding the prompts)")
    ap.add_argument("--py-spy", default=None, metavar="FILE", help="sample the API process; hottest functions")
    ap.add_argument("--top", type=int, default=60)
    ap.add_argument("--py-spy-rate", type=int, default=200, help="py-spy samples per second")
    opts, serve_args = ap.parse_known_args()
    serve_args = [a for a in serve_args if a != "--"] or DEFAULT_SERVE
    opts.tokenizer = tokenizer_dir(serve_args) if opts.text_prompts else None
    with tempfile.TemporaryDirectory(prefix="api-cost-") as cwd:
        with __import__("socket").socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = start_server(serve_args, cwd, port)
        try:
            url = f"http://127.0.0.1:{port}"
            run(bench_args(opts, port, 16))  # warm-up (lazy imports, caches)
            core, workers = spawned(server.pid)
            api = [server.pid, *workers]  # every API server process: their CPU is summed
            spy = None
            if opts.py_spy:
                exe = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
                spy = subprocess.Popen([exe, "record", "--pid", str(server.pid), "--format", "raw",
                                        "--rate", str(opts.py_spy_rate), "--output", os.path.join(cwd, "spy.txt"),
                                        "--nonblocking"],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                time.sleep(1.0)
            m0, api0, core0 = server_metrics(url), sum(map(cpu_seconds, api)), cpu_seconds(core)
            client0 = time.process_time()  # the benchmark client runs in this process
            result = run(bench_args(opts, port, opts.num_prompts))
            client_cpu = time.process_time() - client0
            api1, core1, m1 = sum(map(cpu_seconds, api)), cpu_seconds(core), server_metrics(url)
            if spy is not None:
                spy.send_signal(signal.SIGINT)
                err = spy.communicate(timeout=120)[1].decode(errors="replace")
                spy_out = os.path.join(cwd, "spy.txt")
                text = (summarize_py_spy(Path(spy_out).read_text(), opts.top) if os.path.exists(spy_out)
                        else f"py-spy wrote nothing:\n{err}")
                Path(opts.py_spy).write_text(text + "\n")
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(60)
            # Triton variants the server met after its start-up (kernels/jit_watch.py logs each): compiles inside
            # the warm-up or the measured run on an empty cache, which would slow what this measures.
            late = Path(cwd, "server.log").read_text(errors="replace").count(jit_watch.LOG_MARK)
    tokens, steps = result["total_output_tokens"], m1["engine_steps_total"] - m0["engine_steps_total"]
    d = {k: m1[k] - m0[k] for k in m0}
    # The server's TTFT runs from the request's hand-off to the core client (tokenized, checked) to the end of the
    # engine step that made its first token; the client's, from sending the request to reading the first chunk.
    # Their difference is the API path around the engine: HTTP in, parsing, tokenization, then the output's way
    # from the core to the client (msgspec, routing, detokenization, the chunk, the socket).
    server_ttft = _mean_ms(d, "time_to_first_token_seconds")
    # Request head received -> response started (the stream's intake: body, parsing, checks, hand-off to the core)
    intake = _mean_ms(d, "http_response_start_seconds")
    delivery = _mean_ms(d, "first_token_delivery_seconds")  # the first token's step end -> the API handled it
    report = {
        "completed": result["completed"], "failed": result["failed"], "tokens": tokens, "steps": steps,
        "api_processes": len(api),
        "duration_s": round(result["duration"], 2), "output_tok_per_s": round(result["output_throughput"]),
        "api_cpu_s": round(api1 - api0, 2), "api_us_per_token": round(1e6 * (api1 - api0) / max(tokens, 1), 1),
        # The client's own CPU: at rate=inf it sends every request before it reads any answer (one event loop),
        # so its per-request cost delays the TTFTs it measures too.
        "client_cpu_s": round(client_cpu, 2),
        "client_ms_per_request": round(1e3 * client_cpu / max(result["completed"] + result["failed"], 1), 3),
        "core_cpu_s": round(core1 - core0, 2), "core_ms_per_step": round(1e3 * (core1 - core0) / max(steps, 1), 2),
        "tokens_per_step": round(tokens / max(steps, 1), 1),
        "median_ttft_ms": round(result["median_ttft_ms"], 1), "median_tpot_ms": round(result["median_tpot_ms"], 2),
        "mean_ttft_ms": round(result["mean_ttft_ms"], 2), "mean_server_ttft_ms": round(server_ttft, 2),
        "mean_ttft_outside_engine_ms": round(result["mean_ttft_ms"] - server_ttft, 2),
        # ... of which: the client's own send queue, and the API process's intake (both inside the client's ttft)
        "mean_client_send_delay_ms": round(result["mean_send_delay_ms"], 2), "mean_api_intake_ms": round(intake, 2),
        "mean_first_token_delivery_ms": round(delivery, 2),
        "late_kernel_variants": late,
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
