"""Served cold start: `replayllm serve` started to its first generated token, as a user meets it.

Usage: python bench/serve_cold_start.py [--port 8321] [--output-json F] -- MODEL [serve options]
Starts `replayllm serve MODEL ...` (run it with TRITON_CACHE_DIR pointing at an empty folder for a fresh machine),
polls /health every 50 ms, then sends one completion (64 token ids, max_tokens 1) and stops the server. Prints one
JSON line: healthy_s (start to /health 200), first_token_s (start to the completion's answer), the server's
start-up log lines (compile-ahead, captures, warm-up), and `timeline`: every line the server printed before its
first token, each with the seconds since the start at which it arrived (where the start-up time goes).
The 0.6B shape on the GPU machine: `-- DUMMY_DIR --load-format dummy --skip-tokenizer-init`
(bench/gpu_check.sh's cold rows).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time

import httpx

_LOG_MARKS = ("compiled ahead", "captured", "warm-up:", "engine core process")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=8321)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--output-json", default=None)
    ap.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- MODEL [serve options]")
    args = ap.parse_args()
    serve_args = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args
    if not serve_args:
        ap.error("give the model and serve options after --")
    base = f"http://127.0.0.1:{args.port}"
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "replayllm.entrypoints.cli", "serve", *serve_args,
                             "--port", str(args.port), "--served-model-name", "m"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    lines: list[tuple[float, str]] = []  # (seconds since start, line), read as the server prints them

    def read() -> None:
        for line in proc.stdout:
            lines.append((time.perf_counter() - start, line.rstrip()))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        while True:
            if proc.poll() is not None:
                reader.join(timeout=10)
                print("\n".join(line for _, line in lines[-60:]), file=sys.stderr)
                raise SystemExit(f"the server exited with code {proc.returncode} before it was healthy")
            if time.perf_counter() - start > args.timeout:
                raise SystemExit(f"the server was not healthy after {args.timeout:.0f} s")
            try:
                if httpx.get(f"{base}/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        healthy = time.perf_counter() - start
        r = httpx.post(f"{base}/v1/completions", timeout=120.0,
                       json={"model": "m", "prompt": [100 + i for i in range(64)], "max_tokens": 1})
        r.raise_for_status()
        first_token = time.perf_counter() - start
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        reader.join(timeout=10)
    result = {"healthy_s": round(healthy, 2), "first_token_s": round(first_token, 2), "serve_args": serve_args,
              "log": [line for _, line in lines if any(m in line for m in _LOG_MARKS)],
              "timeline": [f"{t:7.2f} {line[:200]}" for t, line in lines if t <= first_token]}
    print(json.dumps(result))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
