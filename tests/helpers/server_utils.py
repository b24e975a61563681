"""Test helper: run `replayllm serve` as a subprocess on a free 127.0.0.1 port, read its /metrics."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

# The settings the acceptance tests compare against the offline LLM with.
API_KEY = "test-key"
ENGINE_ARGS = ["--device", "cpu", "--dtype", "float32", "--max-model-len", "512"]


def children(pid: int) -> list[int]:
    """Live (non-zombie) child pids of pid, from /proc."""
    kids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            kids.append(int(entry))
    return kids


def alive(pid: int) -> bool:
    """pid runs (a zombie, exited but not yet reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteServer:
    """`python -m replayllm.entrypoints.cli serve ARGS` started from `cwd` (never the repo root: see the
    import hazard in docs/architecture.md), ready once /health answers 200; stopped by its own PID."""

    def __init__(self, args: list[str], cwd: Path, env: dict[str, str] | None = None, api_key: str | None = None,
                 startup_timeout: float = 120.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = Path(cwd) / f"server-{self.port}.log"
        full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
        cmd = [sys.executable, "-m", "replayllm.entrypoints.cli", "serve", *args, "--host", "127.0.0.1",
               "--port", str(self.port), "--uvicorn-log-level", "warning"]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=cwd, env=full_env, stdout=log, stderr=subprocess.STDOUT)
        try:
            self._wait_ready(startup_timeout)
        except BaseException:
            self.stop()
            raise

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not ready after {timeout}s:\n{self.log()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def post_all(self, path: str, bodies: list[dict], timeout: float = 300.0) -> list[httpx.Response]:
        """POST every body to base_url + path at once (one client, concurrent requests); responses in order."""
        import asyncio

        async def run():
            async with httpx.AsyncClient(headers=self.headers, timeout=timeout) as c:
                return await asyncio.gather(*(c.post(self.base_url + path, json=b) for b in bodies))

        return asyncio.run(run())

    def metrics(self) -> dict[str, float]:
        """Samples as {'name{label="v",...}': value} (labels sorted; no braces without labels)."""
        text = httpx.get(self.url + "/metrics", timeout=10.0).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def wait_idle(self, timeout: float = 30.0) -> dict[str, float]:
        """Poll /metrics until nothing runs or waits and every KV block is free; return the metrics."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = (m["replayllm:num_requests_running"] == 0 and m["replayllm:num_requests_waiting"] == 0
                    and m["replayllm:num_free_kv_blocks"] == m["replayllm:num_kv_blocks"]
                    and m["replayllm:kv_cache_usage_perc"] == 0)
            if idle:
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"server not idle after {timeout}s (KV blocks leaked?): "
                                     f"{ {k: v for k, v in m.items() if 'num_' in k or 'kv' in k} }")
            time.sleep(0.1)


def trace_server(tmp_path_factory):
    """The servers most tests share: trace replay on, API key required. Yields it, stops it afterwards."""
    srv = RemoteServer([*ENGINE_ARGS, "--enable-trace-replay", "--api-key", API_KEY],
                       tmp_path_factory.mktemp("server"), api_key=API_KEY)
    yield srv
    srv.stop()
