"""`replayllm chat` / `complete` flags (vLLM's names), apart from the client so the CLI starts without httpx."""

from __future__ import annotations

import argparse

DEFAULT_URL = "http://localhost:8000/v1"
API_KEY_ENVS = ("REPLAYLLM_API_KEY", "OPENAI_API_KEY")  # --api-key's default, in this order


def add_client_args(parser: argparse.ArgumentParser, chat: bool) -> None:
    parser.add_argument("--url", default=DEFAULT_URL, help=f"the server's API root (default: {DEFAULT_URL})")
    parser.add_argument("--model-name", default=None, help="the model to ask (default: the server's first)")
    parser.add_argument("--api-key", default=None, help="bearer key (default: env " + " or ".join(API_KEY_ENVS)
                                                        + ")")
    if chat:
        parser.add_argument("--system-prompt", default=None, help="a system message before the conversation")
    parser.add_argument("-q", "--quick", default=None, metavar="MESSAGE",
                        help="send this one " + ("message" if chat else "prompt") + ", print the reply and exit")
    parser.add_argument("--max-tokens", type=int, default=None, help="tokens per reply (default: the server's)")
    parser.add_argument("--temperature", type=float, default=None,
                        help="sampling temperature, 0 greedy (default: the server's)")
