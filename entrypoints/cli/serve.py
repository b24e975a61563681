"""`replayllm serve`: the OpenAI-compatible HTTP server's flags; server_main.run_server runs it."""

from __future__ import annotations

import argparse

from ..http.connection_limits import add_connection_args
from ..http.limits import add_limit_args
from .cli_parser import Subcommands
from .engine_args import add_engine_args_for
from .serve_compat_args import add_compat_args
from .server_args import add_server_args
from .tokenizer_pool_args import add_tokenizer_pool_args


def add_serve(sub: Subcommands, command: str | None) -> None:
    """`replayllm serve`: the HTTP server's flags (server_main.run_server reads them)."""
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("model", nargs="?", default=None, help="model dir or id (default: the embedded model)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    serve.add_argument("--port", type=_port, default=8000, help="port to listen on (default: 8000)")
    serve.add_argument("--api-key", default=None, help="require this bearer key (or env REPLAYLLM_API_KEY)")
    serve.add_argument("--enable-log-requests", action="store_true",
                       help="log each request's id and sizes (never its text)")
    serve.add_argument("--disable-log-stats", action="store_true",
                       help="do not log the engine's stats line every 10 s (throughput, requests, KV cache)")
    serve.add_argument("--uvicorn-log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug", "trace"],
                       help="uvicorn's log level (default: info)")
    serve.add_config_arg()
    add_server_args(serve)
    add_compat_args(serve)
    add_limit_args(serve)
    add_connection_args(serve)
    add_tokenizer_pool_args(serve)
    add_engine_args_for(command, serve, "serve")
    serve.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from ...engine.early_core import EarlyCore
    from ..http import multiprocess_metrics

    # The engine core process imports beside this process's own imports (engine/early_core.py): main() spawned
    # it before parsing the flags; started here when cmd_serve is called some other way.
    early = getattr(args, "early_core", None) or EarlyCore()
    # Before prometheus_client is imported (by the server below): several processes share their metrics' files.
    metrics_dir = multiprocess_metrics.enable(getattr(args, "api_server_count", 1))
    try:
        try:
            from .server_main import run_server  # the engine, FastAPI and uvicorn: loaded only when the server runs
        except BaseException:
            early.cancel()
            raise
        return run_server(args, early)
    finally:
        multiprocess_metrics.cleanup(metrics_dir)


def _port(text: str) -> int:
    """--port: 0 (any free port) to 65535; 99999 used to be taken as 99999 - 65536."""
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be 0-65535, got {port}")
    return port
