"""`replayllm serve`'s process: bind the port, start the engine core process, run uvicorn around `build_app`."""

from __future__ import annotations

import argparse
import errno
import gc
import logging
import os
import socket
import sys
import time
from dataclasses import dataclass

from ...config import EngineConfig
from ...engine.core_client import EngineCoreClient, EngineStartupError
from ...engine.early_core import EarlyCore
from ...model_source import resolve_model_path
from ..chat_template import load_chat_template
from ..generation_config import default_sampling_params, log_defaults
from ..http.connection_limits import ConnectionLimits, connection_limits_from_args
from ..http.http_protocol import protocol_class
from ..http.limits import limits_from_args
from ..http.log_throttle import throttle_repeated_errors
from ..http.stats_logger import log_stats_interval
from ..openai.api_server import API_KEY_ENV, build_app
from .engine_args import engine_kwargs
from .serve_compat_args import apply_compat_args
from .server_args import check_ssl, tool_serving_from_args
from .tokenizer_pool_args import tokenizer_pool_from_args

logger = logging.getLogger("replayllm.server")


def run_server(args: argparse.Namespace, early: EarlyCore | None = None) -> int:
    """`replayllm serve`: build the engine from the CLI options, then serve until interrupted. `early`: the
    engine core process, already started and importing (engine/early_core.py; None: started here); stopped if
    the server gives up before handing it its config."""
    early = early if early is not None else EarlyCore()
    try:
        ready = _prepare(args, early)
    except BaseException:
        early.cancel()
        raise
    if ready is None:
        early.cancel()
        return 1
    try:
        ready.client.start_core()
    except EngineStartupError as e:
        ready.sock.close()
        ready.client.close()
        print(f"error: the engine could not start: {e}", file=sys.stderr)
        return 1
    try:
        return _serve(args, ready)
    finally:
        ready.client.close()  # normally already stopped by the app's lifespan


@dataclass
class _Prepared:
    """What the checks built before the engine core gets its config: the bound port, the client around the
    core, and the app's options."""

    sock: socket.socket
    client: EngineCoreClient
    config: EngineConfig
    api_key: str | None
    chat_template: str | None
    default_sampling: dict | None
    cors: dict
    connections: ConnectionLimits
    stats_interval: float | None


def _prepare(args: argparse.Namespace, early: EarlyCore) -> _Prepared | None:
    """Every check, the port bound, the config and the client around `early`; None when the port cannot be
    bound (said on stderr); a bad option raises (ValueError/TypeError: the CLI reports)."""
    from prometheus_client import disable_created_metrics

    disable_created_metrics()  # no `*_created` timestamp series next to every counter in /metrics
    compat_notes = apply_compat_args(args)  # vLLM flags: a refused one fails here, before the model loads
    stats_interval = log_stats_interval(args.disable_log_stats)  # a bad environment value fails before the load
    check_ssl(args)  # a bad flag fails here, before the port is taken and the model loads (ValueError: the CLI)
    connections = connection_limits_from_args(args)
    connections.check_file_limit()
    pool = tokenizer_pool_from_args(args)
    chat_template = load_chat_template(args.chat_template)
    tool_serving_from_args(args)  # --enable-auto-tool-choice without --tool-call-parser fails before the load
    auto = args.generation_config == "auto"  # reads the model's folder, known once the config is built
    default_sampling = None if auto else default_sampling_params(args.generation_config, "")

    # Bind before the model loads, as vLLM does: a taken port fails in a second, not after the load; uvicorn
    # then serves on this very socket (nothing can take the port in between).
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as e:
        print(f"error: cannot listen on {args.host}:{args.port}: {e.strerror or e}"
              f"{' (is another server running?)' if e.errno == errno.EADDRINUSE else ''}", file=sys.stderr)
        return None
    try:
        kwargs = engine_kwargs(args)
        early.send_args(args.model, kwargs)  # the core builds the same config beside us (engine/early_core.py)
        begin = time.monotonic()
        config = EngineConfig(model=args.model, **kwargs)
        api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        logger.info("engine config built in %.1f s, %.1f s after the engine core process was spawned",
                    time.monotonic() - begin, time.monotonic() - early.spawned_at)
        for note in compat_notes:
            logger.info(note)
        if auto:
            default_sampling = default_sampling_params("auto", resolve_model_path(config.model))
        log_defaults(default_sampling, args.generation_config)
        cors = dict(allow_origins=args.allowed_origins, allow_methods=args.allowed_methods,
                    allow_headers=args.allowed_headers, allow_credentials=args.allow_credentials)
        client = EngineCoreClient(config, tokenizer_pool=pool, early=early)  # the tokenizer here; the model there
    except BaseException:
        sock.close()
        raise
    return _Prepared(sock, client, config, api_key, chat_template, default_sampling, cors, connections,
                     stats_interval)


def _serve(args: argparse.Namespace, ready: _Prepared) -> int:
    """Build the app around the started engine core and run uvicorn; 1 if the core died while serving."""
    import uvicorn

    from ..http.draining_server import GRACE_S, WRITE_S, DrainingServer

    app = build_app(engine_client=ready.client, api_key=ready.api_key, served_model_names=args.served_model_name,
                    enable_log_requests=args.enable_log_requests, chat_template=ready.chat_template,
                    default_sampling=ready.default_sampling, root_path=args.root_path or "", cors=ready.cors,
                    limits=limits_from_args(args), connections=ready.connections,
                    log_stats_interval=ready.stats_interval, max_stored_responses=args.max_stored_responses,
                    strict_request_fields=args.strict_request_fields, reasoning_parser=args.reasoning_parser,
                    tools=tool_serving_from_args(args))
    # Start-up left ~0.4M long-lived objects (torch, transformers, the model); every full collection would walk
    # them again. Freeze them out of the collector, as vLLM's server does. Here only: this process holds one
    # engine for its whole life (an LLM in a user's process may be built and dropped many times).
    gc.collect()
    gc.freeze()
    logger.info("serving %s as %s on %s://%s:%d (trace replay %s, API key %s)", ready.config.model,
                " / ".join(repr(n) for n in args.served_model_name or [ready.config.served_model_name]),
                "https" if args.ssl_certfile else "http", args.host, args.port,
                "on" if ready.config.enable_trace_replay else "off", "required" if ready.api_key else "not required")
    uvicorn_config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                                    timeout_graceful_shutdown=GRACE_S + WRITE_S, ssl_keyfile=args.ssl_keyfile,
                                    ssl_certfile=args.ssl_certfile, http=protocol_class(ready.connections),
                                    timeout_keep_alive=ready.connections.timeout_keep_alive,
                                    h11_max_incomplete_event_size=ready.connections.h11_max_incomplete_event_size,
                                    )  # configures uvicorn's loggers
    throttle_repeated_errors()  # after that: one line per kind of error per 10 s, not one per request
    server = DrainingServer(uvicorn_config, ready.client.fail_in_flight)
    exit_code = [0]

    def core_died(reason: str) -> None:  # requests in flight have their errors already; /health says 503
        exit_code[0] = 1
        server.should_exit = True

    ready.client.on_dead = core_died
    with ready.sock:
        server.run(sockets=[ready.sock])
    if exit_code[0]:
        print("error: the engine core process died; the server stopped", file=sys.stderr)
    return exit_code[0]


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (OSError when it cannot be: port taken, unknown host, no permission)."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                       flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a TIME_WAIT port is free
        sock.bind(addr)
    except BaseException:
        sock.close()
        raise
    return sock
