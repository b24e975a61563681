"""`replayllm chat` / `replayllm complete`: interactive clients of a running OpenAI-compatible server (vLLM's
`vllm chat` / `vllm complete`), streaming the reply as it comes."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import httpx

from .chat_client_args import API_KEY_ENVS

_TIMEOUT = httpx.Timeout(10.0, read=None)  # connect fast; a long generation may take its time between chunks


class ClientError(RuntimeError):
    """The server could not be reached or answered an error; the message is the server's own."""


@dataclass(frozen=True)
class Client:
    """A minimal OpenAI-API client: /models and streamed /chat/completions and /completions."""

    url: str  # the API root, e.g. http://localhost:8000/v1
    api_key: str | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def models(self) -> list[str]:
        try:
            r = httpx.get(self.url.rstrip("/") + "/models", headers=self.headers, timeout=_TIMEOUT)
        except httpx.HTTPError as e:
            raise ClientError(f"cannot reach {self.url}: {e}") from None
        _check(r)
        return [m["id"] for m in r.json()["data"]]

    def stream(self, route: str, body: dict) -> Iterator[str]:
        """POST body (with stream=true) to route; yield each chunk's text (chat delta or completion text)."""
        try:
            with httpx.stream("POST", self.url.rstrip("/") + route, json={**body, "stream": True},
                              headers=self.headers, timeout=_TIMEOUT) as r:
                if r.status_code >= 400:
                    r.read()
                    _check(r)
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: "):]
                    if data.strip() == "[DONE]":
                        return
                    chunk = json.loads(data)
                    if "error" in chunk:  # an error after the stream started (vLLM's SSE error event)
                        raise ClientError(chunk["error"].get("message", str(chunk["error"])))
                    for choice in chunk.get("choices", []):
                        text = (choice.get("delta") or {}).get("content") if "delta" in choice else choice.get("text")
                        if text:
                            yield text
        except httpx.HTTPError as e:
            raise ClientError(f"cannot reach {self.url}: {e}") from None


def _check(r: httpx.Response) -> None:
    if r.status_code < 400:
        return
    try:
        message = r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = r.text[:200]
    raise ClientError(f"the server answered {r.status_code}: {message}")


def main(args: argparse.Namespace, chat: bool) -> int:
    api_key = args.api_key or next((os.environ[e] for e in API_KEY_ENVS if os.environ.get(e)), None)
    client = Client(args.url, api_key)
    try:
        model = args.model_name or client.models()[0]
        sampling = {k: v for k, v in (("max_tokens", args.max_tokens), ("temperature", args.temperature))
                    if v is not None}
        return _chat(client, model, sampling, args) if chat else _complete(client, model, sampling, args)
    except ClientError as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 1


def _reply(chunks: Iterator[str]) -> str:
    """Print the streamed text as it comes; return all of it."""
    parts = []
    for text in chunks:
        print(text, end="", flush=True)
        parts.append(text)
    print(flush=True)
    return "".join(parts)


def _inputs(quick: str | None, banner: str) -> Iterator[str]:
    """--quick's one message, or lines read after a "> " prompt until end of input (Ctrl-D)."""
    if quick is not None:
        yield quick
        return
    print(banner, flush=True)
    while True:
        try:
            yield input("> ")
        except EOFError:
            print()
            return


def _chat(client: Client, model: str, sampling: dict, args: argparse.Namespace) -> int:
    messages = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
    for text in _inputs(args.quick, f"Chatting with {model} at {client.url}; Ctrl-D to quit."):
        messages.append({"role": "user", "content": text})
        answer = _reply(client.stream("/chat/completions", {"model": model, "messages": messages, **sampling}))
        messages.append({"role": "assistant", "content": answer})
    return 0


def _complete(client: Client, model: str, sampling: dict, args: argparse.Namespace) -> int:
    for text in _inputs(args.quick, f"Completing with {model} at {client.url}; Ctrl-D to quit."):
        _reply(client.stream("/completions", {"model": model, "prompt": text, **sampling}))
    return 0
