"""`replayllm chat` and `replayllm complete`: clients of a running server (chat_client.py runs them)."""

from __future__ import annotations

import argparse

from .chat_client_args import add_client_args
from .cli_parser import Subcommands


def add_clients(sub: Subcommands) -> None:
    """`replayllm chat` and `replayllm complete`: clients of a running server."""
    for name, chat in (("chat", True), ("complete", False)):
        client = sub.add_parser(name, help=f"{'chat' if chat else 'complete prompts'} with a running server "
                                           f"(interactive, or one --quick message)")
        add_client_args(client, chat)
        client.set_defaults(func=cmd_client, chat=chat)


def cmd_client(args: argparse.Namespace) -> int:
    from .chat_client import main as client_main  # httpx: loaded only when a client runs

    return client_main(args, args.chat)
