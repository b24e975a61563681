"""`replayllm` command line: generate (the demo), serve (OpenAI-compatible server), chat and complete (its
clients), capture, diff and replay (traces), run-batch (an OpenAI batch file, offline), rl-demo (a GRPO loop),
bench (throughput, latency, serve)."""

from __future__ import annotations

import argparse
import sys

from .bench import add_bench
from .capture import add_capture
from .chat import add_clients
from .cli_parser import CLIParser
from .diff import add_diff
from .generate import add_generate
from .replay import add_replay
from .rl_demo import add_rl_demo
from .run_batch import add_run_batch
from .serve import add_serve

INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a process stopped by Ctrl-C


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole CLI; with `command` (the first word of argv), engine flags only on that subcommand: they import
    EngineConfig (torch, seconds), which `chat`, `complete` and `--help` do not need."""
    from ... import __version__

    parser = CLIParser(prog="replayllm", description=__doc__)
    parser.add_argument("-V", "--version", action="version", version=__version__)
    sub = parser.add_subparsers(dest="command", required=True)  # each a CLIParser: --config, "did you mean"
    add_generate(sub, command)
    add_serve(sub, command)
    add_clients(sub)
    add_capture(sub, command)
    add_diff(sub)
    add_replay(sub, command)
    add_run_batch(sub, command)
    add_rl_demo(sub, command)
    add_bench(sub, command)
    return parser


def bench_throughput_args(argv: list[str]) -> argparse.Namespace:
    """`replayllm bench throughput ARGV` parsed as the CLI parses it, --model (vLLM's spelling) resolved into
    args.model: for the bench/ scripts that build the throughput workload themselves (profilers, sweeps)."""
    from .serve_compat_args import resolve_model_option

    args = build_parser("bench").parse_args(["bench", "throughput", *argv])
    resolve_model_option(args)
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    early = _early_core(argv)
    try:
        args = build_parser(argv[0] if argv else None).parse_args(argv)
    except BaseException:  # a bad flag or --help (SystemExit): no engine is coming
        if early is not None:
            early.cancel()
        raise
    if early is not None:
        args.early_core = early  # cmd_serve hands it the config (cancelled there on any failure)
    try:
        return args.func(args)
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a model folder without weights, a file that cannot be read: one line, as serve's
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: one line, no traceback (LLM.generate aborted its requests already)
        print("interrupted", file=sys.stderr)
        return INTERRUPTED


def _early_core(argv: list[str]):
    """`replayllm serve`: its engine core process, spawned before the flags are even parsed (parsing them imports
    EngineConfig, hence torch: ~1-3 s the core spends importing beside us instead; engine/early_core.py). None
    for every other command and for `--help`."""
    if not argv or argv[0] != "serve" or "-h" in argv or "--help" in argv:
        return None
    from ...engine.early_core import EarlyCore

    return EarlyCore()
