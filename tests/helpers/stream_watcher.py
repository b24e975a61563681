"""Test helper, run as its own process (`python stream_watcher.py URL K BODY_JSON`): K streams decoding back to
back against a server; prints `run chunk_time` per chunk (time.monotonic: one clock for all processes), so the
test process's own big requests can never delay the reading it measures."""

from __future__ import annotations

import asyncio
import json
import sys
import time

import httpx


async def _worker(url: str, body: dict, k: int) -> None:
    async with httpx.AsyncClient(timeout=600.0) as client:
        for run in range(10**9):
            async with client.stream("POST", url, json=body) as r:
                if r.status_code != 200:
                    print(f"error {r.status_code}", flush=True)
                    return
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        print(f"{k}.{run} {time.monotonic()!r}", flush=True)


async def main() -> None:
    url, k, body = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    await asyncio.gather(*[_worker(url, body, i) for i in range(k)])


if __name__ == "__main__":
    asyncio.run(main())
