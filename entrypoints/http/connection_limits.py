"""ConnectionLimits: `replayllm serve`'s caps on connections and concurrent requests, and its HTTP timeouts."""

from __future__ import annotations

import argparse
import resource
from dataclasses import dataclass, fields

KiB = 1 << 10
FD_RESERVE = 256  # file descriptors kept for everything but client sockets (model files, logs, pipes, ...)
FD_TARGET = 65535  # the soft RLIMIT_NOFILE `serve` raises itself to (within the hard limit), as vLLM does
HTTP_PROTOCOLS = ("auto", "httptools", "h11")  # --http: auto is httptools when it is installed (uvicorn's rule)
# --limit-concurrency's default, or fewer where the open-file limit cannot hold it. vLLM's server has no cap at
# all: a benchmark of thousands of requests at once must be served, not answered 503 past an arbitrary 1024.
DEFAULT_LIMIT_CONCURRENCY = 8192


def raised_file_limit() -> int | None:
    """The soft open-file limit once `check_file_limit` has raised it (None: unlimited)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return None
    target = FD_TARGET if hard == resource.RLIM_INFINITY else min(FD_TARGET, hard)
    return max(soft, target)


def default_limit_concurrency() -> int:
    """DEFAULT_LIMIT_CONCURRENCY, or as many as the raised open-file limit holds beside FD_RESERVE."""
    files = raised_file_limit()
    return DEFAULT_LIMIT_CONCURRENCY if files is None else max(1, min(DEFAULT_LIMIT_CONCURRENCY,
                                                                      files - FD_RESERVE - 1))


@dataclass(frozen=True)
class ConnectionLimits:
    """Each field is a flag of `replayllm serve` (its name with dashes); uvicorn's and vLLM's names where they
    have one. Seconds are floats; the rest are counts or bytes."""

    # Requests in flight at once (past it: 503 JSON); also the open connections kept (past it the one idle the
    # longest is closed to make room). /health, /ping, /metrics and /version are never refused. None: the
    # default, default_limit_concurrency() (8192 where the open-file limit allows).
    limit_concurrency: int | None = None
    timeout_keep_alive: float = 5.0  # an idle keep-alive connection is closed after this (uvicorn's default)
    timeout_header: float = 30.0  # a request line + headers must arrive within this of the connection opening
    timeout_body: float = 60.0  # the longest wait for the next bytes of a request body the server is reading
    # The largest request head (request line + headers) h11 buffers; past it: 431. vLLM defaults to 4 MiB; 64 KiB
    # keeps the worst case (every connection sending a maximal head) at limit_concurrency x 64 KiB.
    h11_max_incomplete_event_size: int = 64 * KiB
    h11_max_header_count: int = 256  # header fields per request (vLLM's default); past it: 431

    def __post_init__(self):
        if self.limit_concurrency is None:
            object.__setattr__(self, "limit_concurrency", default_limit_concurrency())
        for f in fields(self):
            value = getattr(self, f.name)
            kind = (int, float) if f.type == "float" else int
            if not isinstance(value, kind) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"--{f.name.replace('_', '-')} must be a number > 0, got {value!r}")

    def check_file_limit(self) -> None:
        """Raise the soft open-file limit toward FD_TARGET (within the hard one); ValueError when the cap on
        connections cannot be held below it (accept() would fail with EMFILE under a connection flood)."""
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = FD_TARGET if hard == resource.RLIM_INFINITY else min(FD_TARGET, hard)
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        need = self.limit_concurrency + FD_RESERVE + 1  # +1: a new connection is open while it evicts another
        if soft != resource.RLIM_INFINITY and need > soft:
            raise ValueError(f"--limit-concurrency {self.limit_concurrency} needs {need} open files, but this "
                             f"process may open at most {soft} (ulimit -n); lower it or raise the limit")


HELP = {
    "limit_concurrency": "requests served at once, past which a request gets 503; also the open connections kept "
                         "(past it the longest-idle one is closed)",
    "timeout_keep_alive": "seconds an idle keep-alive connection stays open",
    "timeout_header": "seconds a client has to send a request's line and headers (slow clients are dropped)",
    "timeout_body": "seconds the server waits for the next bytes of a request body (slow clients are dropped)",
    "h11_max_incomplete_event_size": "bytes of a request line + headers; past it: 431",
    "h11_max_header_count": "header fields in one request; past it: 431",
}


DEFAULTS = {"limit_concurrency": f"{DEFAULT_LIMIT_CONCURRENCY}, fewer where the open-file limit cannot hold it"}


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = 0
        if not value > 0:
            raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
        return value

    return parse


def add_connection_args(parser: argparse.ArgumentParser) -> None:
    for f in fields(ConnectionLimits):
        kind = float if f.type == "float" else int
        default = DEFAULTS.get(f.name, f.default)
        parser.add_argument("--" + f.name.replace("_", "-"), type=_positive(kind), default=f.default,
                            metavar="S" if kind is float else "N", help=f"{HELP[f.name]} (default: {default})")


def connection_limits_from_args(args: argparse.Namespace) -> ConnectionLimits:
    return ConnectionLimits(**{f.name: getattr(args, f.name) for f in fields(ConnectionLimits)
                               if hasattr(args, f.name)})
