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
from collections.abc import Callable
from dataclasses import dataclass

from ...config import EngineConfig
from ...engine.core_client import EngineCoreClient
from ...engine.core_watch import CoreAttachment, EngineStartupError
from ...engine.early_core import EarlyCore
from ...engine.tokenizer_pool import TokenizerPoolConfig
from ...model_source import resolve_model_path
from ..chat_template import load_chat_template
from ..generation_config import default_sampling_params, log_defaults
from ..http.connection_limits import ConnectionLimits, connection_limits_from_args
from ..http.http_protocol import protocol_class
from ..http.limits import limits_from_args
from ..http.log_throttle import throttle_repeated_errors
from ..http.stats_logger import log_stats_interval
from ..openai.api_server import API_KEY_ENV, build_app
from .api_workers import ApiWorkers
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
    # --api-server-count N: N - 1 more processes
    workers = ApiWorkers(args, ready.client, ready.sock, run_api_worker)
    try:
        return max(_serve(args, ready, workers=workers), workers.stop())
    finally:
        workers.stop()
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
    protocol: type  # uvicorn's `http=`: http_protocol.protocol_class(connections, --http)


@dataclass
class _Options:
    """The app's options read from the flags (checked before anything loads)."""

    compat_notes: list[str]
    stats_interval: float | None
    connections: ConnectionLimits
    pool: TokenizerPoolConfig
    chat_template: str | None
    default_sampling: dict | None  # None with --generation-config auto until the model folder is known
    auto: bool
    cors: dict
    protocol: type  # http_protocol.protocol_class(connections, --http), this process's own


def _options(args: argparse.Namespace) -> _Options:
    """Every flag check that needs no model (ValueError/TypeError on a bad one), and the options they give."""
    from prometheus_client import disable_created_metrics

    disable_created_metrics()  # no `*_created` timestamp series next to every counter in /metrics
    compat_notes = apply_compat_args(args)  # vLLM flags: a refused one fails here, before the model loads
    stats_interval = log_stats_interval(args.disable_log_stats)  # a bad environment value fails before the load
    check_ssl(args)  # a bad flag fails here, before the port is taken and the model loads (ValueError: the CLI)
    connections = connection_limits_from_args(args)
    connections.check_file_limit()
    protocol = protocol_class(connections, getattr(args, "http", "auto"))  # --http httptools, not installed: fails
    pool = tokenizer_pool_from_args(args)
    chat_template = load_chat_template(args.chat_template)
    tool_serving_from_args(args)  # --enable-auto-tool-choice without --tool-call-parser fails before the load
    auto = args.generation_config == "auto"  # reads the model's folder, known once the config is built
    default_sampling = None if auto else default_sampling_params(args.generation_config, "",
                                                                 args.override_generation_config)
    cors = dict(allow_origins=args.allowed_origins, allow_methods=args.allowed_methods,
                allow_headers=args.allowed_headers, allow_credentials=args.allow_credentials)
    return _Options(compat_notes, stats_interval, connections, pool, chat_template, default_sampling, auto, cors,
                    protocol)


def _prepare(args: argparse.Namespace, early: EarlyCore) -> _Prepared | None:
    """Every check, the port bound, the config and the client around `early`; None when the port cannot be
    bound (said on stderr); a bad option raises (ValueError/TypeError: the CLI reports)."""
    opts = _options(args)

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
        # the core builds the same config beside us (engine/early_core.py)
        early.send_args(args.model, kwargs, args.api_server_count)
        begin = time.monotonic()
        config = EngineConfig(model=args.model, **kwargs)
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        logger.info("engine config built in %.1f s, %.1f s after the engine core process was spawned",
                    time.monotonic() - begin, time.monotonic() - early.spawned_at)
        for note in opts.compat_notes:
            logger.info(note)
        # the tokenizer here; the model there
        client = EngineCoreClient(config, tokenizer_pool=opts.pool, early=early, num_clients=args.api_server_count)
        return prepared(args, opts, sock, client)
    except BaseException:
        sock.close()
        raise


def prepared(args: argparse.Namespace, opts: _Options, sock: socket.socket, client: EngineCoreClient,
             log: bool = True) -> _Prepared:
    """The app's pieces around a built client (the first API server process, or an extra one: api_workers.py)."""
    default_sampling = opts.default_sampling
    if opts.auto:
        default_sampling = default_sampling_params("auto", resolve_model_path(client.config.model),
                                                   args.override_generation_config)
    if log:
        log_defaults(default_sampling, args.generation_config)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    return _Prepared(sock, client, client.config, api_key, opts.chat_template, default_sampling, opts.cors,
                     opts.connections, opts.stats_interval, opts.protocol)


def _serve(args: argparse.Namespace, ready: _Prepared, workers: ApiWorkers | None = None,
           worker: int = 0) -> int:
    """Build the app around the started engine core and run uvicorn; 1 if the core (or, in the first process, an
    extra API server process: `workers`) died while serving. worker: this process's index (0: the first)."""
    import uvicorn

    from ..http.draining_server import GRACE_S, WRITE_S, DrainingServer

    app = build_app(engine_client=ready.client, api_key=ready.api_key, served_model_names=args.served_model_name,
                    enable_log_requests=args.enable_log_requests, chat_template=ready.chat_template,
                    default_sampling=ready.default_sampling, root_path=args.root_path or "", cors=ready.cors,
                    limits=limits_from_args(args), connections=ready.connections,
                    # one stats line for the engine: the first process's (its step counts are the engine's)
                    log_stats_interval=ready.stats_interval if worker == 0 else None,
                    max_stored_responses=args.max_stored_responses,
                    strict_request_fields=args.strict_request_fields, reasoning_parser=args.reasoning_parser,
                    tools=tool_serving_from_args(args))
    # Start-up left ~0.4M long-lived objects (torch, transformers, the model); every full collection would walk
    # them again. Freeze them out of the collector, as vLLM's server does. Here only: this process holds one
    # engine for its whole life (an LLM in a user's process may be built and dropped many times).
    gc.collect()
    gc.freeze()
    if worker == 0:
        logger.info("serving %s as %s on %s://%s:%d (trace replay %s, API key %s%s)", ready.config.model,
                    " / ".join(repr(n) for n in args.served_model_name or [ready.config.served_model_name]),
                    "https" if args.ssl_certfile else "http", args.host, args.port,
                    "on" if ready.config.enable_trace_replay else "off",
                    "required" if ready.api_key else "not required",
                    f"; {args.api_server_count} API server processes" if args.api_server_count > 1 else "")
    uvicorn_config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                                    timeout_graceful_shutdown=GRACE_S + WRITE_S, ssl_keyfile=args.ssl_keyfile,
                                    ssl_certfile=args.ssl_certfile,
                                    http=ready.protocol,
                                    timeout_keep_alive=ready.connections.timeout_keep_alive,
                                    h11_max_incomplete_event_size=ready.connections.h11_max_incomplete_event_size,
                                    )  # configures uvicorn's loggers
    throttle_repeated_errors()  # after that: one line per kind of error per 10 s, not one per request
    server = DrainingServer(uvicorn_config, ready.client.fail_in_flight,
                            before_shutdown=workers.terminate if workers is not None else None)
    failure: list[str] = []

    def stop_for(what: str) -> Callable[[str], None]:
        def stop(reason: str) -> None:  # requests in flight have their errors already; /health says 503
            failure.append(what)
            server.should_exit = True
        return stop

    ready.client.on_dead = stop_for("the engine core process died")
    if workers is not None:  # an extra process that dies takes the server down with it, as vLLM does
        workers.on_exit = stop_for("an API server process died")
        workers.start()  # after on_exit is set: one that dies at once is not missed
    with ready.sock:
        server.run(sockets=[ready.sock])
    if failure:
        print(f"error: {failure[0]}; the server stopped", file=sys.stderr)
    return 1 if failure else 0


def run_api_worker(args: argparse.Namespace, config: EngineConfig, attach: CoreAttachment,
                   sock: socket.socket) -> None:
    """An extra API server process's entry point (api_workers.py): the same app as the first process's, on the
    shared socket, over the core the first one started."""
    from ...parent_death import die_with_parent

    die_with_parent()
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s %(name)s (API server {attach.client}): "
                                                   "%(message)s")
    opts = _options(args)
    client = EngineCoreClient(config, tokenizer_pool=opts.pool, num_clients=args.api_server_count, attach=attach)
    try:
        code = _serve(args, prepared(args, opts, sock, client, log=False), worker=attach.client)
    except KeyboardInterrupt:  # Ctrl-C reaches the whole group; uvicorn re-raises it once it has drained
        code = 0
    finally:
        client.close()
    sys.exit(code)


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
