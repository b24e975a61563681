"""`replayllm serve`'s own flags (vLLM's names): URL prefix, CORS, TLS, chat template, generation config."""

from __future__ import annotations

import argparse
import json
import os
import ssl

from ..generation_config import parse_overrides
from ..http.connection_limits import HTTP_PROTOCOLS
from ..http.limits import positive_int
from ..openai.responses_store import DEFAULT_MAX_STORED_RESPONSES
from ..openai.tool_calling import ToolServing
from ..openai.tool_parsers import TOOL_PARSERS


def _json_list(text: str) -> list[str]:
    """vLLM takes CORS lists as JSON: '["https://a.example", "https://b.example"]'."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings like '[\"*\"]', got {text!r}")
    return value


def add_server_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--api-server-count", "-asc", type=positive_int, default=1, metavar="N",
                        help="HTTP server processes on the one port, all feeding the one engine core (as vLLM): "
                             "more requests and streamed tokens a second when one process's CPU is the limit; "
                             "/metrics sums the processes, stored responses stay in the process that made them "
                             "(default: 1)")
    parser.add_argument("--http", choices=HTTP_PROTOCOLS, default="auto",
                        help="the HTTP/1.1 parser, as uvicorn's --http: httptools (C, about half h11's CPU a "
                             "request) or h11 (pure Python); auto: httptools when installed (default: auto)")
    parser.add_argument("--root-path", default=None, metavar="PREFIX",
                        help="the path prefix a proxy serves this server under (FastAPI's root_path)")
    parser.add_argument("--allowed-origins", type=_json_list, default=["*"], metavar="JSON",
                        help="CORS: origins allowed, a JSON list (default: [\"*\"], as vLLM)")
    parser.add_argument("--allowed-methods", type=_json_list, default=["*"], metavar="JSON",
                        help="CORS: methods allowed, a JSON list (default: [\"*\"])")
    parser.add_argument("--allowed-headers", type=_json_list, default=["*"], metavar="JSON",
                        help="CORS: headers allowed, a JSON list (default: [\"*\"])")
    parser.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    parser.add_argument("--ssl-keyfile", default=None, help="TLS private key (PEM); needs --ssl-certfile")
    parser.add_argument("--ssl-certfile", default=None, help="TLS certificate (PEM): serve https")
    parser.add_argument("--chat-template", default=None, metavar="PATH_OR_JINJA",
                        help="chat template for /v1/chat/completions and chat /tokenize instead of the tokenizer's: "
                             "a file or the template itself")
    parser.add_argument("--max-stored-responses", type=positive_int, default=DEFAULT_MAX_STORED_RESPONSES, metavar="N",
                        help="Responses API: stored responses kept in memory for GET /v1/responses/{id} and "
                             "previous_response_id; the least recently used is dropped past N (default: %(default)s)")
    parser.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                        help="default sampling parameters: 'auto' from the model's generation_config.json "
                             "(default), 'vllm' none, or the generation_config.json in FOLDER")
    add_override_generation_config(parser)
    parser.add_argument("--strict-request-fields", action="store_true",
                        help="refuse request bodies with fields the server does not know (400, as OpenAI's API) "
                             "instead of ignoring them with a warning and an x-replayllm-ignored-fields header "
                             "(as vLLM)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="chat completions: tool_choice 'auto' (the default with tools): the model's tool "
                             "calls are read from its output with --tool-call-parser (needs it)")
    parser.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                        help="the tool-call format of the model's output: hermes (Qwen2.5/Qwen3, Hermes), qwen3_xml "
                             "(Qwen3-Coder), llama3_json (Llama 3.1/3.2 JSON calls)")
    parser.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                        help="tool_choice 'none': leave the tools out of the chat template (default: rendered, "
                             "as vLLM)")


def tool_serving_from_args(args: argparse.Namespace) -> ToolServing:
    """The tool flags, checked together (ValueError: --enable-auto-tool-choice needs --tool-call-parser)."""
    return ToolServing(args.enable_auto_tool_choice, args.tool_call_parser, args.exclude_tools_when_tool_choice_none)


def check_ssl(args: argparse.Namespace) -> None:
    """The key and certificate load (ValueError otherwise), checked before the model loads."""
    if args.ssl_certfile is None:
        if args.ssl_keyfile is not None:
            raise ValueError("--ssl-keyfile needs --ssl-certfile")
        return
    for flag, path in (("--ssl-certfile", args.ssl_certfile), ("--ssl-keyfile", args.ssl_keyfile)):
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"{flag} {path}: no such file")
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
    except (ssl.SSLError, OSError) as e:
        raise ValueError(f"--ssl-certfile/--ssl-keyfile: cannot load the certificate and key: {e}") from e


def add_override_generation_config(parser: argparse.ArgumentParser) -> None:
    """vLLM's --override-generation-config (serve and run-batch)."""
    parser.add_argument("--override-generation-config", type=_overrides, default=None, metavar="JSON",
                        help="vLLM's: generation config values over --generation-config's, e.g. "
                             "'{\"temperature\": 0.5, \"max_new_tokens\": 64}' (keys: temperature, top_p, top_k, "
                             "min_p, repetition_penalty, max_new_tokens)")


def _overrides(text: str) -> dict:
    try:
        return parse_overrides(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
